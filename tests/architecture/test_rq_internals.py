"""The parts of RQ's private API that `eval_worker.service.worker` (worker.py, rq_compat.py) relies on still exist.

`setup.cfg` bounds rq below its next minor release; this test is what tells, on the day the bound
is raised, whether the names and parameters the worker relies on survived: a rename fails here,
not in a worker in production (where an override of a method that no longer exists is silently
never called).
"""
from __future__ import annotations

import inspect

import pytest
from rq.executions import Execution
from rq.job import Job
from rq.queue import Queue
from rq.scheduler import RQScheduler
from rq.worker import SimpleWorker, Worker

from eval_worker.service.worker.rq_compat import EvalScheduler
from eval_worker.service.worker.worker import EvalWorker

# (class, method, the parameters our code passes or our override declares)
USED = [
    (Queue, "_enqueue_job", ("job", "pipeline", "at_front")),
    (Worker, "_start_scheduler", ("burst", "logging_level", "date_format", "log_format")),
    (Worker, "maintain_heartbeats", ("job", "execution")),
    (Worker, "get_heartbeat_ttl", ("job", "working_time")),
    (Worker, "prepare_execution", ("job",)),
    (Worker, "perform_job", ("job", "queue", "execution")),
    (Worker, "dequeue_job_and_maintain_ttl", ("timeout", "max_idle_time")),
    (Worker, "heartbeat", ("timeout", "pipeline")),
    (Worker, "set_state", ("state", "pipeline")),
    (Worker, "check_for_suspension", ("burst",)),
    (Worker, "run_maintenance_tasks", ()),
    (Worker, "request_stop", ("signum", "frame")),
    (Worker, "handle_job_failure", ("job", "queue", "started_job_registry", "exc_string", "execution")),
    (Worker, "execute_job", ("job", "queue")),
    (RQScheduler, "acquire_locks", ()),
    (RQScheduler, "register_birth", ()),
    (RQScheduler, "enqueue_scheduled_jobs", ()),
    (RQScheduler, "release_locks", ()),
    (RQScheduler, "register_death", ()),
    (RQScheduler, "start", ()),
    (RQScheduler, "heartbeat", ()),
    (RQScheduler, "work", ()),
    (Execution, "heartbeat", ("started_job_registry", "ttl", "pipeline")),
    (Job, "heartbeat", ("timestamp", "ttl", "pipeline", "xx")),
]


@pytest.mark.parametrize(("cls", "name", "params"), USED, ids=[f"{c.__name__}.{n}" for c, n, _ in USED])
def test_rq_private_api_used_by_the_worker_exists(cls, name, params):
    method = getattr(cls, name, None)
    assert callable(method), f"rq {cls.__name__}.{name} is gone: eval_worker/service/worker/worker.py relies on it"
    accepted = inspect.signature(method).parameters
    missing = [p for p in params if p not in accepted]
    assert not missing, f"rq {cls.__name__}.{name} no longer takes {missing}"


def test_worker_overrides_name_methods_rq_calls():
    """Every method EvalWorker / EvalScheduler override is one RQ defines (an override of a renamed method
    would never run)."""
    ours = {
        EvalWorker: ("_start_scheduler", "get_heartbeat_ttl", "maintain_heartbeats", "execute_job",
                     "dequeue_job_and_maintain_ttl", "heartbeat", "set_state", "check_for_suspension",
                     "run_maintenance_tasks", "request_stop", "handle_job_failure"),
        EvalScheduler: ("start", "work", "heartbeat", "enqueue_scheduled_jobs"),
    }
    for cls, names in ours.items():
        base = cls.__mro__[1]
        for name in names:
            assert name in vars(cls), f"{cls.__name__}.{name} is no longer overridden: update this list"
            assert hasattr(base, name), f"{cls.__name__}.{name} overrides nothing in rq's {base.__name__}"


def test_worker_instance_attributes_the_worker_reads(redis_url):
    from eval_worker.redis_client import connect

    conn = connect(redis_url)
    worker = SimpleWorker([Queue("rq-internals", connection=conn)], connection=conn)
    for attr in ("worker_ttl", "maintenance_interval", "job_monitoring_interval", "_stop_requested", "serializer"):
        assert hasattr(worker, attr), f"rq Worker instances no longer have {attr}"
    scheduler = RQScheduler([Queue("rq-internals", connection=conn)], connection=conn)
    for attr in ("acquired_locks", "_stop_requested"):
        assert hasattr(scheduler, attr), f"rq RQScheduler instances no longer have {attr}"
