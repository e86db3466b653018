"""`EvalOnCheckpoint`: enqueue an acceptance eval for published checkpoints (dflash_train callback).

Implements the trainer hook protocol (dflash_train/training/callbacks.py), rank 0 only:

- `on_checkpoint_published(trainer, step, path, manifest)`: the marker is present. If this
  checkpoint reaches a new multiple of `every_n_steps` (the first published checkpoint at or
  after each multiple, so any publish interval works), the job is made from the manifest,
  the checkpoint is pinned against retention, the job is written to the durable outbox next
  to the checkpoints (for checkpoints in an object store: `$DFLASH_HOME/outbox/<run>`), and
  the delivery thread is woken. Nothing here talks to Redis: the training thread spends a
  file write, never a network timeout.
- the delivery thread enqueues (dedupe by deterministic id); while Redis is unreachable or
  refuses writes (out of memory, MISCONF, ...) the jobs wait in the outbox and go out on the
  next successful delivery, or at train end. Only a job refused for itself is set aside.
- a job that cannot be written to the outbox (its disk is full or read-only) is kept in memory
  and owed (at most outbox.MAX_OWED): each delivery tries to write it, then to queue it from
  memory; `dflash-eval status` lists owed jobs while the queue takes that note.
- `on_train_end`: enqueue the final checkpoint if it was not (with `eval_final`), then
  try to empty the outbox for `train_end_timeout` seconds; what is left on disk stays there
  (`dflash-eval enqueue --outbox DIR` sends it); what is owed in memory is listed as an error,
  step by step, marked lost for `status`, and its pin released (nothing will queue it).
- `protects(path)`: retention keeps a checkpoint whose job is still in the outbox (pins
  cover it once it is queued; the worker removes the pin when the result is recorded).
Any error in here is logged and swallowed: the hook never stops training.
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
from pathlib import Path
from typing import Any

import redis
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from dflash_train.checkpoints import storage
from dflash_train.checkpoints.publication import has_pin, pin_checkpoint, unpin_checkpoint
from dflash_train.common.errors import retryable
from dflash_train.common.redaction import redact
from dflash_train.common.settings import Settings
from eval_worker.redis_client import connect
from eval_worker.results.attempts import strip_attempt
from eval_worker.results.ledger import Ledger
from eval_worker.service.job_builder import make_job
from eval_worker.service.job_ids import job_fingerprint, job_id_for
from eval_worker.service.job_schema import JobError, JobPayload, validate_job
from eval_worker.service.outbox import OUTBOX_DIRNAME, Deliverer, Outbox, job_key
from eval_worker.service.queue import QueueConfig, enqueue, record_owed, server_risks
from eval_worker.service.redis_server import resolve_redis_url

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
                 settings: Settings | None = None, backlog: str = "all", route_by_target: bool = False):
        if int(every_n_steps) < 1:
            raise ValueError(f"every_n_steps must be >= 1, got {every_n_steps}")
        self.every_n_steps = int(every_n_steps)
        self.queue = queue
        self.suites = [suite] if isinstance(suite, str) else list(suite)  # one job per suite and checkpoint
        if not self.suites:
            raise ValueError("suite: name at least one suite")
        self.target, self.baseline = target, baseline
        self.options, self.wandb, self.priority = options, wandb, priority
        self.sinks, self.mlflow = sinks, mlflow
        self.redis_url = redis_url
        self.settings = settings or Settings.from_env()
        self.eval_final = eval_final
        self.train_end_timeout = train_end_timeout
        self.connect_timeout = connect_timeout
        self.job_timeout = job_timeout
        self.min_backoff, self.max_backoff = min_backoff, max_backoff
        self.reconcile_interval = reconcile_interval
        # many runs, several targets (eval_worker/service/routing.py): the run's backlog policy, target queues
        from eval_worker.service.routing import parse_policy

        parse_policy(backlog)  # a typo fails at construction, not at the first checkpoint
        self.backlog, self.route_by_target = backlog, route_by_target
        self.outcomes: list[Any] = []          # EnqueueOutcome of every delivered job (for callers/tests)
        self.errors: list[str] = []            # what went wrong (also logged)
        self._last_bucket = 0                  # highest multiple of every_n_steps already evaluated
        self._last_published: tuple[int, str, dict] | None = None
        self._enqueued_steps: set[int] = set()
        self._deliverers: dict[Path, Deliverer] = {}
        self._pins: dict[str, str] = {}        # job id -> checkpoint, pinned until the job is done
        self._sent: dict[str, dict] = {}       # job id -> the job queued (sent again if Redis loses it)
        self.resent: list[str] = []            # job ids sent again because Redis no longer had them
        self._owed_runs: set[str] = set()      # runs whose owed jobs `status` was last told of
        self._conn = None
        self._conn_lock = threading.Lock()
        self._risks_told = False               # the server's risky settings (server_risks) said once

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

    def _outbox_dir(self, path: str | os.PathLike) -> Path:
        """The outbox beside the run's checkpoints; for checkpoints in an object store (which
        has no local run directory), `$DFLASH_HOME/outbox/<run>`."""
        store = storage.store_for(path)
        run = store.parent(path)
        return Path(run) / OUTBOX_DIRNAME if store.local else self.settings.home / "outbox" / store.name(run)

    def protects(self, path: Path) -> bool:
        d = self._deliverers.get(self._outbox_dir(path))  # its jobs owed in memory count too
        box = d.outbox if d is not None else Outbox(self._outbox_dir(path))
        return box.holds(path)

    # ---- API -------------------------------------------------------------------------
    @property
    def suite(self) -> str:
        """The first suite (the hook's jobs run every one of `suites`)."""
        return self.suites[0]

    def make_job(self, path: str | os.PathLike, manifest: dict | None = None, suite: str | None = None) -> JobPayload:
        return make_job(path, manifest=manifest, suite=suite or self.suite, target=self.target,
                                 baseline=self.baseline, wandb=self.wandb, sinks=self.sinks, mlflow=self.mlflow,
                                 requested_by="hook",
                                 priority=self.priority, options=self.options)

    def submit(self, path: str | os.PathLike, manifest: dict | None = None) -> list[Path]:
        """For each suite: pin the checkpoint, write the job to the outbox; then wake the delivery
        thread. Returns the job files."""
        path = storage.canonical(path)
        outbox = self._deliverer(self._outbox_dir(path))
        files = []
        for suite in self.suites:
            job = self.make_job(path, manifest, suite)
            try:
                pin_checkpoint(path, job_id_for(job, job_fingerprint(job)))
            except JobError as e:  # unknown suite: still queued, the queue will say why
                self._note(f"cannot pin {path}: {e}")
            payload = job.to_json()  # the outbox holds JSON data, on disk or owed in memory
            written = outbox.outbox.put_or_owe(payload)
            if written is None:
                why = {job_key(j): w for j, w in outbox.outbox.owed()}.get(job_key(payload), "write failed")
                self._note(f"eval job for step {job.step} could not be written to {outbox.outbox.dir} "
                           f"({why}); kept in memory and retried until it is written or queued")
            else:
                files.append(written)
            self._enqueued_steps.add(job.step)
        outbox.kick()
        return files

    def flush(self, timeout: float) -> bool:
        """Try to deliver every waiting job for up to `timeout` s; True if none is left."""
        ok = True
        for d in list(self._deliverers.values()):
            report = d.flush(timeout)
            if not report.complete:
                ok = False
                on_disk = report.remaining - len(report.owed)
                if on_disk:
                    self._note(f"{on_disk} eval job(s) not delivered ({report.error}); they stay in "
                               f"{d.outbox.dir} and go out on the next delivery, or run "
                               f"`dflash-eval enqueue --outbox {d.outbox.dir}`")
                if report.owed:
                    self._give_up_owed(d.outbox)
        return ok

    def _give_up_owed(self, outbox: Outbox) -> None:
        """Training ends with jobs neither written nor queued: list each one loudly, mark it lost
        for `status` (when the queue answers), and release its pin (nothing will ever queue it)."""
        owed = outbox.give_up_owed()
        if not owed:
            return
        for payload, why in owed:
            job = validate_job(payload)  # what submit() made: valid
            job_id = job_id_for(job, job_fingerprint(job))
            unpin_checkpoint(job.checkpoint, job_id)
            self._pins.pop(job_id, None)
            self._note(f"eval job for step {job.step} was never queued nor written to disk ({why}); it is "
                       f"lost when training ends: queue it by hand with `dflash-eval enqueue {job.checkpoint} "
                       f"--suite {job.suite}`")
        log.error("eval jobs NOT QUEUED for step(s) %s of run %s: the outbox %s could not be written and the "
                  "queue did not take them", [j["step"] for j, _ in owed], owed[0][0].get("run_id"), outbox.dir)
        try:
            for run_id in {j["run_id"] for j, _ in owed}:
                record_owed(self._connection(), run_id, [(j, w) for j, w in owed if j["run_id"] == run_id],
                            lost=True)
        except Exception:  # noqa: BLE001 - the queue is unreachable: the log and `errors` have it
            log.debug("could not mark the owed jobs lost in Redis", exc_info=True)

    def _report_owed(self, report) -> None:
        """After each delivery: what is owed in memory, for `dflash-eval status` (best effort)."""
        runs = {j["run_id"] for j, _ in report.owed} | self._owed_runs
        if not runs:
            return
        conn = self._connection()
        for run_id in runs:
            record_owed(conn, run_id, [(j, w) for j, w in report.owed if j["run_id"] == run_id])
        self._owed_runs = {j["run_id"] for j, _ in report.owed}

    def release_pins(self) -> int:
        """Unpin checkpoints whose jobs are done (finished, canceled, stopped, or recorded and expired).

        The worker unpins after recording; this covers workers that see the checkpoints
        read-only. Failed jobs keep their pin (they can be re-queued). Returns how many were released.

        A job Redis no longer has, not recorded, whose pin is still on its checkpoint (no worker
        recorded it, nobody dismissed it) was lost by Redis itself: a restart without persistence,
        a FLUSHALL, an eviction policy other than `noeviction`. It goes back into the outbox and is
        queued again (a worker that did record it meanwhile does not evaluate it twice: the ledger).
        """
        if not self._pins:
            return 0
        conn = self._connection()
        ids = list(self._pins)
        done = {JobStatus.FINISHED, JobStatus.CANCELED, JobStatus.STOPPED}
        released = 0
        for job_id, job in zip(ids, Job.fetch_many(ids, connection=conn, serializer=JSONSerializer), strict=True):
            recorded = job is None and Ledger(connection=conn).lookup_job(strip_attempt(job_id)) is not None
            if job is None and not recorded and self._send_again(job_id):
                continue
            if recorded or (job is not None and job.get_status(refresh=False) in done):
                checkpoint = self._pins.pop(job_id, None)
                self._sent.pop(job_id, None)
                if checkpoint is not None:
                    unpin_checkpoint(checkpoint, job_id)
                    released += 1
            elif job is None:  # gone, its pin too (dismissed, cancelled): nothing left to release
                self._pins.pop(job_id, None)
                self._sent.pop(job_id, None)
        return released

    def _send_again(self, job_id: str) -> bool:
        """Put a job Redis lost back into its outbox (see `release_pins`); False when it was not lost."""
        checkpoint, payload = self._pins.get(job_id), self._sent.get(job_id)
        if checkpoint is None or payload is None or not has_pin(checkpoint, job_id):
            return False  # recorded (the worker unpinned), dismissed or cancelled by a user
        d = self._deliverer(self._outbox_dir(checkpoint))
        d.outbox.put_or_owe(payload)
        self._pins.pop(job_id, None)
        self._sent.pop(job_id, None)  # the delivery registers it again
        self.resent.append(job_id)
        self._note(f"Redis no longer has the eval job for step {payload.get('step')} ({job_id}), and no result "
                   "was recorded: the server lost it (restarted without persistence, flushed, or evicting keys: "
                   "use `maxmemory-policy noeviction` and AOF); queued again")
        d.kick()
        return True

    def close(self) -> None:
        for d in self._deliverers.values():
            d.stop()
            self._give_up_owed(d.outbox)  # closed without a flush: still listed, pins released
        self._deliverers.clear()
        with self._conn_lock:
            if self._conn is not None:
                try:
                    self._conn.close()
                finally:
                    self._conn = None

    # ---- delivery ----------------------------------------------------------------------
    def _deliverer(self, directory: Path) -> Deliverer:
        d = self._deliverers.get(directory)
        if d is None:
            d = Deliverer(Outbox(directory), self._send, min_backoff=self.min_backoff, max_backoff=self.max_backoff,
                          on_idle=self.release_pins, idle_interval=self.reconcile_interval,
                          on_report=self._report_owed).start()
            self._deliverers[directory] = d
        return d

    def _connection(self):
        with self._conn_lock:
            if self._conn is None:
                url = resolve_redis_url(self.redis_url, self.settings)
                self._conn = connect(url, socket_connect_timeout=self.connect_timeout,
                                     socket_timeout=max(self.connect_timeout, 5.0))
                if not self._risks_told:
                    with contextlib.suppress(redis.exceptions.RedisError):  # unreachable: told next time
                        for risk in server_risks(self._conn):  # said once in the trainer's log
                            self._note(f"Redis: {risk}")
                        self._risks_told = True
            return self._conn

    def _send(self, job: dict[str, Any]):
        config = QueueConfig(base=self.queue, backlog=self.backlog, route_by_target=self.route_by_target)
        if self.job_timeout:
            config.job_timeout = int(self.job_timeout)
        try:
            outcome = enqueue(self._connection(), job, config=config)
        except Exception as e:
            if retryable(e):  # the queue is at fault, not the job: a new connection next time
                with self._conn_lock:
                    self._conn = None
            raise
        self.outcomes.append(outcome)
        if outcome.status in ("enqueued", "duplicate"):
            self._pins[outcome.job_id] = outcome.job.checkpoint
            self._sent[outcome.job_id] = job
        log.info("eval job for step %s: %s", outcome.job.step, outcome.message)
        return outcome

    def _note(self, message: str) -> None:
        message = redact(message)
        self.errors.append(message)
        log.warning(message)
