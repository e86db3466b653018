"""The job guard after the service's split into sub-packages: a job queued by an earlier version names the
function by its old module (`eval_worker.service.eval_job.run_eval_job`) and still runs; anything else is
refused before anything it names is imported."""
from __future__ import annotations

import pytest
from rq.serializers import JSONSerializer

from eval_worker.redis_client import connect
from eval_worker.service.jobs.schema import JobError
from eval_worker.service.queueing.queue import JOB_FUNC, LEGACY_JOB_FUNCS
from eval_worker.service.queueing.rq_jobs import get_queue
from eval_worker.service.worker.eval_job import run_eval_job
from eval_worker.service.worker.job_guard import EvalJob


@pytest.mark.parametrize("name", [JOB_FUNC, *LEGACY_JOB_FUNCS])
def test_job_guard_runs_our_function_under_its_new_and_old_names(redis_url, name):
    conn = connect(redis_url)
    job = get_queue(conn, "guard-test").enqueue_call(name, args=({"schema": "x"},), job_id=f"g-{len(name)}")
    loaded = EvalJob.fetch(job.id, connection=conn, serializer=JSONSerializer)
    assert loaded.func is run_eval_job


def test_job_guard_refuses_a_name_that_only_resembles_ours(redis_url):
    conn = connect(redis_url)
    job = get_queue(conn, "guard-test").enqueue_call("eval_worker.service.eval_job.os_system", args=(1,),
                                                     job_id="g-foreign")
    loaded = EvalJob.fetch(job.id, connection=conn, serializer=JSONSerializer)
    with pytest.raises(JobError, match="only runs"):
        _ = loaded.func
