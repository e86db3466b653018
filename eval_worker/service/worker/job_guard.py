"""The job security check: a worker built on this class runs only `run_eval_job(<one JSON payload>)`."""
from __future__ import annotations

from rq.exceptions import DeserializationError
from rq.job import Job

from eval_worker.service.jobs.schema import JobError
from eval_worker.service.queueing.queue import JOB_FUNC, LEGACY_JOB_FUNCS
from eval_worker.service.worker.eval_job import run_eval_job


class EvalJob(Job):
    """A job as the eval worker reads it: only `run_eval_job(<one JSON payload>)` ever runs.

    RQ resolves and calls whatever function, success/failure/stopped callback (and webhook)
    a job hash names, so anyone who can write to Redis could make a plain RQ worker run code.
    This class refuses every job that is not exactly our function with one positional
    argument, before importing or calling anything it names; callbacks and webhooks are
    dropped on load. Job data that is not JSON is refused without being unpickled (the
    worker's serializer is JSON).
    """

    def restore(self, raw_data):
        super().restore(raw_data)
        self._foreign = [n for n in (self._success_callback_name, self._failure_callback_name,
                                     self._stopped_callback_name) if n]
        if self.webhooks:
            self._foreign.append(f"{len(self.webhooks)} webhook(s)")
        self._success_callback_name = self._failure_callback_name = self._stopped_callback_name = None
        self.webhooks = []

    def _deserialize_data(self):
        try:
            super()._deserialize_data()
        except DeserializationError as e:
            raise DeserializationError(f"job {self.id}: data is not JSON (pickled or corrupt); refused, "
                                       "never unpickled") from e.__cause__

    @property
    def func(self):
        reason = None
        if getattr(self, "_foreign", None):
            reason = f"names callbacks/webhooks {self._foreign}"
        elif self.func_name not in (JOB_FUNC, *LEGACY_JOB_FUNCS) or self.instance is not None:
            reason = f"names the function {self.func_name!r}"
        elif len(self.args or ()) != 1 or self.kwargs:
            reason = "does not carry exactly one payload argument"
        if reason:
            self.retries_left = 0  # refused for good
            raise JobError(f"refusing job {self.id}: it {reason}; this worker only runs {JOB_FUNC}(payload)")
        return run_eval_job
