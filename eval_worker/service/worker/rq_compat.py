"""Every place the eval worker deviates from RQ: the subclasses of RQ's registry and scheduler, and the
helpers that lean on RQ's internals. One module, so a new RQ release is checked in one place: its names are
listed in tests/architecture/test_rq_internals.py, which fails when RQ drops one (`setup.cfg` bounds rq
until that test passes on the new release). `EvalWorker` (worker.py) overrides RQ's worker hooks itself;
`EvalJob` (job_guard.py) is the job class that refuses anything but our one function.
"""
from __future__ import annotations

import os
import signal

from rq import registry as rq_registry
from rq.defaults import RQ_KEY_PREFIX
from rq.registry import StartedJobRegistry
from rq.scheduler import RQScheduler

from eval_worker.redis_client import ride_out

# --------------------------------------------------------------------------- abandoned jobs

_LONG_AGO = 1  # a started-registry score every clock has passed


class HeartbeatStartedJobRegistry(StartedJobRegistry):
    """RQ's started registry, with abandonment judged by Redis' clock instead of the boxes'.

    RQ scores each running job with the running worker's wall clock plus the heartbeat TTL,
    and a maintenance pass takes every entry scored before its own wall clock for abandoned:
    a box whose clock runs ahead of another's by more than the TTL retries the other's running
    jobs (one that lags never recovers a crashed one in time). Each entry's execution key
    (`rq:execution:<job>:<execution>`) has the same TTL, counted down by Redis itself and
    renewed by every heartbeat, so whether it still exists is one verdict every box shares:
    cleanup takes exactly the entries whose execution key lapsed, whatever their scores.
    """

    def lapsed(self) -> list[str]:
        members = [m.decode() if isinstance(m, bytes) else str(m) for m in self.connection.zrange(self.key, 0, -1)]
        members = [m for m in members if ":" in m]  # job:execution (an older entry has no key to judge by)
        if not members:
            return []
        with self.connection.pipeline(transaction=False) as pipe:
            for m in members:
                pipe.exists(f"{RQ_KEY_PREFIX}:execution:{m}")
            alive = pipe.execute()
        return [m for m, a in zip(members, alive, strict=True) if not a]

    def cleanup(self, timestamp: float | None = None, exception_handlers: list | None = None):
        lapsed = self.lapsed()
        if not lapsed:
            return
        # moved before every clock's "now" (xx: an entry that ended meanwhile stays gone), then RQ's
        # own cleanup (retry or fail, callbacks, rate-limit slots) for exactly those entries
        self.connection.zadd(self.key, {m: _LONG_AGO for m in lapsed}, xx=True)
        super().cleanup(timestamp=_LONG_AGO, exception_handlers=exception_handlers)


def clean_queue_registries(queue, exception_handlers: list | None = None) -> None:
    """rq.registry.clean_registries, with the started registry judged by heartbeat keys."""
    kw = dict(name=queue.name, connection=queue.connection, job_class=queue.job_class, serializer=queue.serializer)
    rq_registry.FinishedJobRegistry(**kw).cleanup()
    HeartbeatStartedJobRegistry(**kw).cleanup(exception_handlers=exception_handlers)
    for name in ("FailedJobRegistry", "DeferredJobRegistry", "ReadyJobRegistry"):  # Ready: rq >= 3
        if hasattr(rq_registry, name):
            getattr(rq_registry, name)(**kw).cleanup()
    rate_limits = getattr(rq_registry, "RateLimitRegistry", None)  # rq >= 3 (rq.rate_limit)
    for registry in rate_limits.all(queue.connection) if rate_limits is not None else ():
        registry.cleanup()


# --------------------------------------------------------------------------- the scheduler

def _die_with_parent(sig: int = signal.SIGTERM) -> bool:
    """Ask the kernel to send `sig` to this process when its parent dies (Linux prctl); True if set."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(1, int(sig), 0, 0, 0) == 0  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return False


class EvalScheduler(RQScheduler):
    """RQ's scheduler process, which never outlives the worker that started it.

    RQ forks the scheduler as a child of the worker; a worker killed with SIGKILL (OOM killer,
    a crashed machine's supervisor) left it running, reparented to init, still moving retries
    onto the queues and holding the scheduler lock. Here the child asks for SIGTERM when its
    parent dies (prctl PR_SET_PDEATHSIG: its normal, graceful stop, which releases the lock),
    and, for kernels without it, checks on every heartbeat that its parent is still the worker.
    """

    _parent_pid: int | None = None

    def start(self):
        self._parent_pid = os.getpid()
        return super().start()

    def work(self):
        _die_with_parent(signal.SIGTERM)  # before the handlers RQ installs: the signal is handled by them
        super().work()

    def heartbeat(self):
        if self._parent_pid is not None and os.getppid() != self._parent_pid:
            self.log.warning("Scheduler %s: its worker (pid %s) is gone; stopping", self.name, self._parent_pid)
            self._stop_requested = True
            return
        with ride_out(self.log, f"Scheduler {self.name}: heartbeat"):  # like the worker: ride out an outage
            super().heartbeat()

    def enqueue_scheduled_jobs(self):
        with ride_out(self.log, f"Scheduler {self.name}: moving scheduled jobs"):
            super().enqueue_scheduled_jobs()


# --------------------------------------------------------------------------- rq-dashboard

def json_dashboard_workers() -> None:
    """rq-dashboard's views build workers through its module's `Worker`: one that reads jobs as JSON."""
    from rq.serializers import JSONSerializer
    from rq.worker import Worker
    from rq_dashboard import web

    if getattr(web.Worker, "_dflash_json", False):
        return

    class JSONWorker(Worker):
        _dflash_json = True

        @classmethod
        def all(cls, *args, **kwargs):
            kwargs.setdefault("serializer", JSONSerializer)
            return Worker.all(*args, **kwargs)

    web.Worker = JSONWorker
