"""`EvalOnCheckpoint`: enqueue an acceptance eval for published checkpoints (dflash_train callback).

Implements the trainer hook protocol (dflash_train/training/callbacks.py), rank 0 only. The hook
keeps the cadence and makes the jobs; `eval_worker.service.queueing.client.JobClient` (the one way every
producer enqueues) does the rest, in a background delivery thread:

- `on_checkpoint_published(trainer, step, path, manifest)`: the marker is present. If this
  checkpoint reaches a new multiple of `every_n_steps` (the first published checkpoint at or
  after each multiple, so any publish interval works), one job per suite is made from the
  manifest and submitted: the checkpoint pinned against retention, the job written to the durable
  outbox next to the checkpoints (for checkpoints in an object store: `$DFLASH_HOME/outbox/<run>`),
  the delivery thread woken. Nothing here talks to Redis: the training thread spends a file write,
  never a network timeout.
- the client's thread enqueues (dedupe by deterministic id); while Redis is unreachable or refuses
  writes (out of memory, MISCONF, ...) the jobs wait in the outbox and go out on the next successful
  delivery, or at train end. Only a job refused for itself is set aside. A job that cannot be
  written (its disk full or read-only) is owed in memory (`dflash-eval status` lists it). When idle,
  the thread releases pins of finished jobs and sends again a job Redis lost.
- `on_train_end`: enqueue the final checkpoint if it was not (with `eval_final`), then try to
  empty the outbox for `train_end_timeout` seconds; what is left on disk stays there
  (`dflash-eval enqueue --outbox DIR` sends it); what is owed in memory is listed as an error,
  step by step, marked lost for `status`, and its pin released (nothing will queue it).
- `protects(path)`: retention keeps a checkpoint whose job is still in the outbox (pins
  cover it once it is queued; the worker removes the pin when the result is recorded).
Any error in here is logged and swallowed: the hook never stops training.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from dflash_train.checkpoints.location import CheckpointRef
from dflash_train.common.settings import Settings
from eval_worker.service.jobs.request import EvalRequest
from eval_worker.service.jobs.schema import JobPayload
from eval_worker.service.queueing.client import Delivery, EnqueueOutcome, JobClient
from eval_worker.service.queueing.queue import QueueConfig

log = logging.getLogger(__name__)


def is_rank0() -> bool:
    from dflash_train.training.distributed import is_rank0  # torch: the trainer's process has it loaded already

    return is_rank0()


class EvalOnCheckpoint:
    """Queue an eval for every `every_n_steps` of published checkpoints.

    queue: the queue base name (`dflash-eval`; priorities add `-high`/`-low`).
    redis_url: `None` -> $REDIS_URL -> the embedded local redis-server.
    suite: one suite or a list; each published checkpoint gets one job per suite.
    target / baseline / options / wandb / priority / sinks / mlflow: copied into each job (`sinks`:
    where the worker publishes this run's results, default the worker's; `mlflow`: `experiment`,
    `parent_run_id` = the trainer's MLflow run to nest the eval run under).
    settings: the environment's settings (dflash_train.common.settings); read here when not given,
    the training script being the edge.
    """

    def __init__(self, every_n_steps: int = 1, queue: str = "dflash-eval", *,
                 suite: str | list[str] = "builtin:coding-v1",
                 target: str | os.PathLike | None = None, baseline: str | os.PathLike | None = None,
                 options: dict[str, Any] | None = None, wandb: dict[str, Any] | None = None,
                 sinks: list[str] | None = None, mlflow: dict[str, Any] | None = None,
                 priority: str = "default", redis_url: str | None = None, eval_final: bool = True,
                 train_end_timeout: float = 30.0, connect_timeout: float = 2.0, job_timeout: int | None = None,
                 min_backoff: float = 1.0, max_backoff: float = 60.0, reconcile_interval: float = 30.0,
                 settings: Settings | None = None, backlog: str = "all", route_by_target: bool = False,
                 request: EvalRequest | None = None):
        if int(every_n_steps) < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}")
        self.every_n_steps = int(every_n_steps)
        self.queue = queue
        if isinstance(suite, (list, tuple)) and not suite:
            raise ValueError("suite: name at least one suite")
        # checked now (a typo in an option fails when training starts, not at its first checkpoint); `request`
        # (EvalRequest.from_train_config, the `--eval-*` flags) stands for the arguments it holds
        self.request = request or EvalRequest.of(suites=suite, target=target, baseline=baseline, options=options,
                                                 wandb=wandb, sinks=sinks, mlflow=mlflow, priority=priority,
                                                 requested_by="hook")
        self.suites = list(self.request.suites)  # one job per suite and checkpoint
        self.settings = settings or Settings.from_env()
        self.eval_final = eval_final
        self.train_end_timeout = train_end_timeout
        # many runs, several targets (eval_worker/service/queueing/routing.py): the run's backlog policy, target queues
        from eval_worker.service.queueing.routing import parse_policy

        parse_policy(backlog)  # a typo fails at construction, not at the first checkpoint
        config = QueueConfig(base=queue, backlog=backlog, route_by_target=route_by_target)
        if job_timeout:
            config.job_timeout = int(job_timeout)
        self.client = JobClient(redis_url, config=config, settings=self.settings,
                                delivery=Delivery(background=True, min_backoff=min_backoff, max_backoff=max_backoff,
                                                  reconcile_interval=reconcile_interval,
                                                  connect_timeout=connect_timeout))
        self._last_bucket = 0                  # highest multiple of every_n_steps already evaluated
        self._last_published: tuple[int, str, dict] | None = None
        self._enqueued_steps: set[int] = set()

    @property
    def outcomes(self) -> list[EnqueueOutcome]:
        """The queue's answer for every job delivered (for callers and tests)."""
        return self.client.outcomes

    @property
    def errors(self) -> list[str]:
        """What went wrong (also logged)."""
        return self.client.errors

    @property
    def resent(self) -> list[str]:
        """Job ids sent again because Redis no longer had them."""
        return self.client.resent

    # ---- the trainer protocol ----------------------------------------------------------
    def on_checkpoint_published(self, trainer: Any, step: int, path: Path, manifest: dict) -> None:
        if not is_rank0():
            return
        try:
            self._last_published = (int(step), str(path), manifest)
            bucket = int(step) // self.every_n_steps
            if bucket > self._last_bucket:
                self._last_bucket = bucket
                self.submit(path, manifest)
        except Exception as e:  # noqa: BLE001 - never stop training
            self._note(f"eval hook failed at step {step}: {type(e).__name__}: {e}")

    def on_train_end(self, trainer: Any) -> None:
        if not is_rank0():
            return
        try:
            if self.eval_final and self._last_published is not None:
                step, path, manifest = self._last_published
                if step not in self._enqueued_steps:
                    self.submit(path, manifest)
            if self.flush(self.train_end_timeout):
                resent = len(self.resent)
                self.release_pins()
                if len(self.resent) > resent:  # Redis lost some: deliver them again before the hook closes
                    self.flush(self.train_end_timeout)
        except Exception as e:  # noqa: BLE001
            self._note(f"eval hook failed at train end: {type(e).__name__}: {e}")
        finally:
            self.close()

    def protects(self, path: Path) -> bool:
        return self.client.protects(path)

    # ---- API -------------------------------------------------------------------------
    @property
    def suite(self) -> str:
        """The first suite (the hook's jobs run every one of `suites`)."""
        return self.suites[0]

    def make_job(self, path: str | os.PathLike | CheckpointRef, manifest: dict | None = None,
                 suite: str | None = None) -> JobPayload:
        return self.request.job(path, suite or self.suite, manifest=manifest)

    def submit(self, path: str | os.PathLike, manifest: dict | None = None) -> list[Path]:
        """For each suite: make the job and submit it (pinned, written to the outbox, delivery woken).
        Returns the job files written."""
        ref = CheckpointRef.parse(path).as_canonical()  # parsed once for every job
        outbox = self.client.outbox_for(ref)
        files = []
        for suite in self.suites:
            job = self.make_job(ref, manifest, suite)
            written = self.client.submit(job, outbox)
            if written is not None:
                files.append(written)
            self._enqueued_steps.add(job.step)
        return files

    def flush(self, timeout: float) -> bool:
        """Try to deliver every waiting job for up to `timeout` s; True if none is left."""
        return self.client.flush(timeout)

    def release_pins(self) -> int:
        """Unpin checkpoints whose jobs are done; send again the jobs Redis lost (JobClient.release_pins)."""
        return self.client.release_pins()

    def close(self) -> None:
        self.client.close()

    def _note(self, message: str) -> None:
        self.client.note(message)
