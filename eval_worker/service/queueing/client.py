"""`JobClient`: the one way an eval job reaches the queue.

Every producer calls it: the trainer's hook (`hooks.EvalOnCheckpoint`), DeepSpec's drop-in
(`hooks.deepspec`), `dflash-eval watch` and `dflash-eval enqueue` (`submission.Submission`).
It owns, once for all of them:

- the queue write (`enqueue`, below: the only call of RQ's `enqueue_call` in the code base):
  validation, the checkpoint checked (inside `roots` when given, marker, digest), dedupe by the
  deterministic job id (RQ's `unique=True` while the job exists, the ledger index after), `force`
  taking a new attempt number (`-r<n>` id) from a Redis counter;
- the durable path: `submit` pins the checkpoint and writes the job to the outbox beside the
  checkpoints (`outbox_for`; outbox.py), delivered by a background thread (`Delivery(background=True)`,
  the hook: the caller spends a file write, never a network timeout) or by `post` now (watch,
  DeepSpec: leftovers of earlier calls go out with the new ones);
- reconciliation: pins of finished jobs released, a job Redis lost (restart without persistence,
  FLUSHALL, eviction) sent again, jobs owed in memory reported for `status` and listed when given up;
- one connection, opened lazily (`$REDIS_URL` or the embedded server), renewed after an error of
  the queue, the server's risky settings said once.

A job is the validated, frozen `JobPayload`; `to_json()` makes the RQ argument, the outbox file
and the payload remembered for `requeue`.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import redis
from rq.exceptions import DuplicateJobError
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from dflash_train.checkpoints.location import CheckpointRef
from dflash_train.checkpoints.publication import has_pin, pin_checkpoint, unpin_checkpoint
from dflash_train.common.errors import retryable
from dflash_train.common.redaction import redact
from dflash_train.common.settings import Settings
from eval_worker.redis_client import connect
from eval_worker.results.attempts import strip_attempt
from eval_worker.results.ledger import INDEX_PREFIX, Ledger, note_step_checkpoint, step_checkpoints
from eval_worker.service.jobs.checkpoints import check_checkpoint
from eval_worker.service.jobs.ids import base_job_id, job_fingerprint, job_id_for
from eval_worker.service.jobs.schema import JobError, JobPayload, validate_job
from eval_worker.service.queueing import routing
from eval_worker.service.queueing.outbox import OUTBOX_DIRNAME, Deliverer, DeliveryReport, Outbox, job_key
from eval_worker.service.queueing.queue import (
    JOB_FUNC,
    JOBS_PREFIX,
    OWED_PREFIX,
    PENDING,
    QueueConfig,
    failure_reason,
    queue_name,
    record_owed,
    remembered,
    requeue_failed,
    server_risks,
)
from eval_worker.service.queueing.rq_jobs import fetch_job, get_queue

log = logging.getLogger(__name__)

ATTEMPT_PREFIX = "dflash:attempt:"  # counter per base job id (forced re-evaluations)


@dataclass
class EnqueueOutcome:
    """What `enqueue` did: status is `enqueued`, `duplicate` (job exists) or `evaluated` (in ledger)."""

    status: str
    job_id: str
    queue: str
    message: str
    job: JobPayload

    @property
    def enqueued(self) -> bool:
        return self.status == "enqueued"

    def to_dict(self) -> dict[str, Any]:
        return {"status": self.status, "job_id": self.job_id, "queue": self.queue, "message": self.message}


def enqueue(connection, payload: JobPayload | dict[str, Any], *, force: bool = False, config: QueueConfig | None = None,
            roots: Sequence[Path | str] | None = None, check: bool = True,
            suite_fp: str | None = None) -> EnqueueOutcome:
    """Validate `payload` and put it on its priority queue (or say why not).

    - validation: schema, then (with `check`) the checkpoint: inside `roots` when given,
      completion marker present, digest equal to the job's;
    - dedupe: the same evaluation already queued/running/finished/failed, or recorded in
      the ledger index, is not enqueued again (status `duplicate` / `evaluated`);
    - `force`: a new attempt with its own id, whatever exists.
    Raises JobError for an invalid job; Redis errors propagate (the hook's outbox catches them).
    """
    config = config or QueueConfig()
    job = validate_job(payload)  # a dict from the outbox, Redis or a caller; a JobPayload as it is
    if check:
        check_checkpoint(job, roots)
    suite_fp = suite_fp or job_fingerprint(job)
    base_id = base_job_id(job.run_id, job.step, job.checkpoint_digest, suite_fp)
    if force:
        attempt = int(connection.incr(ATTEMPT_PREFIX + base_id))
        done = Ledger(connection=connection).lookup_job(base_id)
        recorded = int(done.get("attempt") or 0) if done else -1
        if attempt <= recorded:  # the counter was lost with Redis' data, the index was rebuilt from the ledger:
            # an attempt number the ledger holds would hand back that record instead of evaluating anew
            attempt = int(connection.incrby(ATTEMPT_PREFIX + base_id, recorded + 1 - attempt))
        job = job.replace(attempt=attempt)
    job_id = job_id_for(job, suite_fp)
    family = routing.routed_base(config.base, job.target) if config.route_by_target else config.base
    qname = queue_name(family, job.priority)

    if not force:
        done = Ledger(connection=connection).lookup_job(base_id)
        if done:
            unpin_checkpoint(job.checkpoint, job_id)
            return EnqueueOutcome(
                "evaluated", done.get("job_id") or job_id, qname,
                f"already evaluated: run {job.run_id} step {job.step} τ={_fmt(done.get('tau'))} "
                f"(attempt {done.get('attempt')}, {done.get('path')}); use --force to evaluate again", job)

    queue = get_queue(connection, qname)
    meta = {"run_id": job.run_id, "step": job.step, "suite": job.suite, "suite_fingerprint": suite_fp,
            "checkpoint": job.checkpoint, "attempt": job.attempt, "requested_by": job.requested_by}
    # Pin first: a fast worker may run the job and unpin before enqueue_call even returns, and
    # a pin written after that would keep the checkpoint through retention for ever.
    pin_checkpoint(job.checkpoint, job_id)
    try:
        queue.enqueue_call(
            JOB_FUNC, args=(job.to_json(),), job_id=job_id, unique=True, timeout=config.job_timeout,
            result_ttl=config.result_ttl, failure_ttl=config.failure_ttl, ttl=config.ttl, retry=config.retry(),
            meta=meta, description=f"eval {job.run_id} step {job.step} suite {job.suite}"
                                   + (f" attempt {job.attempt}" if job.attempt else ""),
            at_front=False)
    except DuplicateJobError:
        outcome, state = _duplicate(connection, job_id, qname, job)
        # done, or recorded (the worker records, then unpins, then RQ hears it finished): our pin,
        # written before this check, would outlive the job
        if state in (JobStatus.FINISHED, JobStatus.CANCELED, JobStatus.STOPPED) or _recorded(connection, job_id):
            unpin_checkpoint(job.checkpoint, job_id)  # nothing will read it for this job any more
        return outcome
    except BaseException:
        unpin_checkpoint(job.checkpoint, job_id)  # not queued: nothing will ever release it
        raise
    others = other_checkpoints_at_step(connection, job)
    _remember(connection, job, job_id, suite_fp)
    note = _after_enqueue(connection, job, job_id, qname, family, config)
    if others:
        note = (f"; note: run {job.run_id} step {job.step} already has checkpoint(s) "
                f"{', '.join(d[:12] + '...' for d in others)} and this one is {job.checkpoint_digest[:12]}...: "
                "each is recorded and shown on its own (docs/design.md)")
    return EnqueueOutcome("enqueued", job_id, qname, f"enqueued {job_id} on {qname}{note}", job)


def _recorded(connection, job_id: str) -> bool:
    """Whether the ledger index holds this very job id (attempt included) as recorded."""
    done = Ledger(connection=connection).lookup_job(strip_attempt(job_id))
    return bool(done and done.get("job_id") == job_id)


def _after_enqueue(connection, job: JobPayload, job_id: str, qname: str, family: str,
                   config: QueueConfig) -> str:
    """Routing, backlog policy and eval-lag bookkeeping of a queued job (service/queueing/routing.py)."""
    if family != config.base:
        routing.remember_target(connection, job.target)
    routing.note_published(connection, job.run_id, job.step)
    done = routing.apply_backlog(connection, job, job_id, qname, config.backlog, family)
    return f"; {done}" if done else ""


def other_checkpoints_at_step(connection, job: JobPayload) -> list[str]:
    """Digests of other checkpoints queued or recorded at the job's (run, step) (one set read:
    the run's job hash and ledger index are only scanned once, for entries older than the sets)."""
    found = step_checkpoints(connection, job.run_id, job.step,
                             legacy_hashes=(INDEX_PREFIX + job.run_id, JOBS_PREFIX + job.run_id))
    return sorted(d for d in found if isinstance(d, str) and d != job.checkpoint_digest)


def _fmt(tau) -> str:
    return f"{tau:.3f}" if isinstance(tau, (int, float)) else "?"


def _duplicate(connection, job_id: str, qname: str, job: JobPayload):
    try:
        existing = fetch_job(connection, job_id)
        status = existing.get_status()
    except JobError:
        status = None
    if status == JobStatus.FAILED:
        msg = (f"already failed: {job_id} ({failure_reason(existing)}); "
               "re-run it with `dflash-eval requeue --failed` or evaluate anew with --force")
    elif status == JobStatus.FINISHED:
        msg = f"already evaluated: {job_id} finished; use --force to evaluate again"
    elif status in (JobStatus.STOPPED, JobStatus.CANCELED):
        msg = f"{job_id} was {status.value}; use --force to evaluate again"
    else:
        msg = f"already {status.value if status else 'present'}: {job_id} is not enqueued twice"
    return EnqueueOutcome("duplicate", job_id, qname, msg, job), status


def _remember(connection, job: JobPayload, job_id: str, suite_fp: str) -> None:
    """Index the payload by run/step so `requeue --run` can find it later."""
    payload = job.to_json()
    entry = json.dumps({"job_id": job_id, "suite_fingerprint": suite_fp, "job": payload}, sort_keys=True)
    with connection.pipeline() as pipe:
        pipe.hset(JOBS_PREFIX + job.run_id, f"{job.step}:{job.checkpoint_digest[:12]}:{suite_fp}", entry)
        pipe.hdel(OWED_PREFIX + job.run_id, job_key(payload))  # queued: a trainer owes it no more
        note_step_checkpoint(pipe, job.run_id, job.step, job.checkpoint_digest)
        pipe.execute()


@dataclass
class RequeueReport:
    """What `requeue_run` did: one outcome per job it found, and the asked-for steps it has no job for."""

    outcomes: list[EnqueueOutcome | tuple[str, str]]
    missing_steps: list[int]


def requeue_run(connection, run: str, steps: Iterable[int] | None = None, *, config: QueueConfig | None = None,
                roots: Sequence[Path | str] | None = None, target: str | None = None) -> RequeueReport:
    """Evaluate steps of a run again: failed jobs are re-queued as they are, finished ones and those a
    backlog policy skipped get a new attempt, pending ones are left alone. `steps=None` means every
    step the queue has seen; `target`: only the jobs on that target (same path, as routing compares
    them), not the run's other targets.

    Steps the queue has never seen for `run` (on `target`) are reported in `missing_steps`; the
    others are requeued all the same. JobError only when nothing at all matches."""
    config = config or QueueConfig()
    wanted = None if steps is None else {int(s) for s in steps}
    on_target = None if target is None else routing.target_key(target)
    entries = [e for e in remembered(connection, run) if (wanted is None or e["job"]["step"] in wanted)
               and (on_target is None or (e["job"].get("target") and routing.target_key(e["job"]["target"])
                                          == on_target))]
    missing = sorted(wanted - {e["job"]["step"] for e in entries}) if wanted is not None else []
    if not entries:
        raise JobError(f"run {run!r} has no enqueued job" + (f" for step(s) {missing}" if missing else "s")
                       + (f" on target {target}" if target else "")
                       + " to requeue; enqueue checkpoints with `dflash-eval enqueue DIR`")
    results: list[EnqueueOutcome | tuple[str, str]] = []
    for entry in entries:
        job_id = entry["job_id"]
        try:
            current = fetch_job(connection, job_id)
            state = current.get_status()
        except JobError:
            current, state = None, None
        if state in PENDING:
            results.append((job_id, f"{job_id} is {state.value}; left as it is"))
            continue
        if state == JobStatus.FAILED:
            requeued = requeue_failed(connection, config.base, [job_id])
            results.append((job_id,
                            f"re-queued failed job {job_id}" if requeued else f"{job_id}: not in failed registry"))
            continue
        payload = {**entry["job"], "requested_by": "requeue", "attempt": 0}
        routed = current is not None and "@" in (current.origin or "")  # back to its target's queues
        outcome = enqueue(connection, payload, force=True, config=replace(config, route_by_target=True)
                          if routed else config, roots=roots, suite_fp=entry["suite_fingerprint"])
        if state == JobStatus.CANCELED and outcome.enqueued:
            routing.note_requeued(connection, job_id, outcome.job_id)  # `status` lists it as skipped no more
        results.append(outcome)
    return RequeueReport(results, missing)


# --------------------------------------------------------------------------- the client

@dataclass(frozen=True)
class Delivery:
    """How the durable path delivers. `background`: a daemon thread per outbox, with back-off while the
    queue is unreachable and, when idle, reconciliation every `reconcile_interval` s (the trainer's
    hook); otherwise the caller delivers (`post`, `deliver`, `flush`)."""

    background: bool = False
    min_backoff: float = 1.0
    max_backoff: float = 60.0
    reconcile_interval: float = 30.0
    connect_timeout: float = 2.0


@dataclass
class Receipt:
    """What became of one job given to `post`: the queue's answer (`enqueued`, `duplicate`, `evaluated`),
    or `waiting` (in its outbox: the queue unreachable or refusing writes), `rejected` (set aside in
    `<outbox>/rejected/`: the queue refused the job itself), `owed` (neither written nor queued)."""

    status: str
    job_id: str
    message: str
    outbox: Path

    @property
    def taken(self) -> bool:
        return self.status in ("enqueued", "duplicate", "evaluated")


class JobClient:
    """The one way to enqueue (module docstring). `redis_url`: None -> $REDIS_URL -> the embedded
    redis-server, connected on first use; or an open `connection` (the commands'), never closed here.
    `roots`: every job's checkpoint must lie inside them (None: not checked, the trainer's own)."""

    def __init__(self, redis_url: str | None = None, *, connection=None, config: QueueConfig | None = None,
                 roots: Sequence[Path | str] | None = None, settings: Settings | None = None,
                 delivery: Delivery | None = None):
        self.redis_url, self.roots = redis_url, roots
        self.config = config or QueueConfig()
        self.delivery = delivery or Delivery()
        self._settings = settings
        self.outcomes: list[EnqueueOutcome] = []  # every answer of the queue (for callers and tests)
        self.errors: list[str] = []               # what went wrong (also logged)
        self.resent: list[str] = []               # job ids sent again because Redis no longer had them
        self.pins: dict[str, str] = {}            # job id -> checkpoint, pinned until the job is done
        self._sent: dict[str, dict] = {}          # job id -> the job queued (sent again if Redis loses it)
        self._answers: dict[str, EnqueueOutcome] = {}  # outbox key -> the queue's answer, read back by `post`
        self._deliverers: dict[Path, Deliverer] = {}
        self._owed_runs: set[str] = set()         # runs whose owed jobs `status` was last told of
        self._conn, self._owns_conn = connection, connection is None
        self._conn_lock = threading.Lock()
        self._risks_told = connection is not None  # a command's connection: the command told them

    @property
    def settings(self) -> Settings:
        if self._settings is None:
            self._settings = Settings.from_env()
        return self._settings

    def connection(self):
        with self._conn_lock:
            if self._conn is None:
                from eval_worker.service.local_redis.server import resolve_redis_url  # may start the embedded server

                timeout = self.delivery.connect_timeout
                self._conn = connect(resolve_redis_url(self.redis_url, self.settings),
                                     socket_connect_timeout=timeout, socket_timeout=max(timeout, 5.0))
            if not self._risks_told:
                with contextlib.suppress(redis.exceptions.RedisError):  # unreachable: told next time
                    for risk in server_risks(self._conn):  # said once, in the producer's log
                        self.note(f"Redis: {risk}")
                    self._risks_told = True
            return self._conn

    def note(self, message: str) -> None:
        message = redact(message)
        self.errors.append(message)
        log.warning(message)

    # ---- now ---------------------------------------------------------------------------
    def send(self, job: JobPayload | dict[str, Any], *, force: bool = False) -> EnqueueOutcome:
        """Queue `job` now (`enqueue`: checked, deduplicated). Raises JobError for a job refused for
        itself; the queue's errors propagate (the caller says them: a user at a terminal)."""
        try:
            outcome = enqueue(self.connection(), job, force=force, config=self.config, roots=self.roots)
        except Exception as e:
            if retryable(e) and self._owns_conn:  # the queue is at fault, not the job: a new connection next time
                with self._conn_lock:
                    self._conn = None
            raise
        self.outcomes.append(outcome)
        return outcome

    def deliver_outbox(self, directory: str | Path, *, retry_rejected: bool = False) -> dict[str, Any]:
        """Deliver the jobs waiting in an outbox (`enqueue --outbox`), checked like any job (`roots`);
        what happened, as JSON data."""
        box = Outbox(directory)
        restored = box.restore_rejected() if retry_rejected else []
        report = box.deliver(self.send)
        return {"dir": str(directory), "restored": restored, "delivered": report.delivered,
                "rejected": report.rejected, "remaining": report.remaining, "error": report.error,
                "set_aside": box.rejected()}

    # ---- durable -----------------------------------------------------------------------
    def outbox_for(self, checkpoint: str | os.PathLike | CheckpointRef) -> Path:
        """The outbox beside a checkpoint's run; for checkpoints in an object store (no local run
        directory), `$DFLASH_HOME/outbox/<run>`."""
        return self.run_outbox(CheckpointRef.parse(checkpoint).parent)

    def run_outbox(self, run: str | os.PathLike | CheckpointRef) -> Path:
        """A run's outbox: `<run>/.eval-outbox`, or `$DFLASH_HOME/outbox/<run>` for a run in a store."""
        ref = CheckpointRef.parse(run)
        return ref.path / OUTBOX_DIRNAME if ref.on_this_machine else self.settings.home / "outbox" / \
            ref.store().name(ref.text)

    def submit(self, job: JobPayload, outbox: Path | None = None) -> Path | None:
        """Pin the checkpoint, write the job to its outbox (default `outbox_for`) and wake its delivery.
        Returns the file; None when the outbox cannot be written (the job is owed in memory, written
        or queued as soon as either works). No network call."""
        d = self._deliverer(outbox or self.outbox_for(job.checkpoint_ref))
        try:
            pin_checkpoint(job.checkpoint, job_id_for(job, job_fingerprint(job)))
        except JobError as e:  # unknown suite: still queued, the queue will say why
            self.note(f"cannot pin {job.checkpoint}: {e}")
        payload = job.to_json()  # the outbox holds JSON data, on disk or owed in memory
        written = d.outbox.put_or_owe(payload)
        if written is None:
            why = {job_key(j): w for j, w in d.outbox.owed()}.get(job_key(payload), "write failed")
            self.note(f"eval job for step {job.step} could not be written to {d.outbox.dir} ({why}); kept in "
                      "memory and retried until it is written or queued")
        d.kick()
        return written

    def post(self, jobs: Iterable[JobPayload]) -> list[Receipt]:
        """`submit` each job, then deliver each outbox used once, now (what waited there from earlier
        calls goes out too); what became of each job."""
        boxes: dict[Path, list[JobPayload]] = {}
        for job in jobs:
            box = self.outbox_for(job.checkpoint)
            self.submit(job, box)
            boxes.setdefault(box, []).append(job)
        return [self._receipt(job, box, report) for box, mine in boxes.items()
                for report in [self.deliver(box)] for job in mine]

    def deliver(self, directory: str | Path) -> DeliveryReport:
        """One delivery of an outbox, in the caller's thread; owed jobs stay owed."""
        return self._deliverer(Path(directory)).flush(0)

    def _receipt(self, job: JobPayload, box: Path, report: DeliveryReport) -> Receipt:
        key = job_key(job.to_json())
        answer = self._answers.pop(key, None)
        if answer is not None:
            return Receipt(answer.status, answer.job_id, answer.message, box)
        job_id = job_id_for(job, job_fingerprint(job))
        if key in report.reasons:
            return Receipt("rejected", job_id, f"refused by the queue ({report.reasons[key]}); set aside in "
                           f"{box / 'rejected'}", box)
        if key in {job_key(j) for j, _ in report.owed}:
            return Receipt("owed", job_id, f"neither written to {box} nor queued ({report.error})", box)
        return Receipt("waiting", job_id, f"waiting in {box} ({report.error}); it goes out with the next "
                       f"delivery, or `dflash-eval enqueue --outbox {box}`", box)

    def flush(self, timeout: float) -> bool:
        """Try to deliver every waiting job for up to `timeout` s; True if none is left. Jobs owed in
        memory that still cannot go are given up (listed, marked lost, pins released): train end."""
        ok = True
        for d in list(self._deliverers.values()):
            report = d.flush(timeout)
            if not report.complete:
                ok = False
                on_disk = report.remaining - len(report.owed)
                if on_disk:
                    self.note(f"{on_disk} eval job(s) not delivered ({report.error}); they stay in "
                              f"{d.outbox.dir} and go out on the next delivery, or run "
                              f"`dflash-eval enqueue --outbox {d.outbox.dir}`")
                if report.owed:
                    self._give_up_owed(d.outbox)
        return ok

    def protects(self, checkpoint: str | os.PathLike) -> bool:
        """Whether a job waiting in its outbox (on disk or owed in memory) names this checkpoint."""
        d = self._deliverers.get(self.outbox_for(checkpoint))
        return (d.outbox if d is not None else Outbox(self.outbox_for(checkpoint))).holds(checkpoint)

    def close(self) -> None:
        """Stop delivery (what is on disk stays for later); what is owed in memory is given up."""
        for d in self._deliverers.values():
            d.stop()
            self._give_up_owed(d.outbox)
        self._deliverers.clear()
        with self._conn_lock:
            if self._conn is not None and self._owns_conn:
                try:
                    self._conn.close()
                finally:
                    self._conn = None

    def _deliverer(self, directory: Path) -> Deliverer:
        d = self._deliverers.get(directory)
        if d is None:
            p = self.delivery
            d = Deliverer(Outbox(directory), self._deliver_job, min_backoff=p.min_backoff, max_backoff=p.max_backoff,
                          on_idle=self.release_pins, idle_interval=p.reconcile_interval, on_report=self._report_owed)
            if p.background:
                d.start()
            self._deliverers[directory] = d
        return d

    def _deliver_job(self, job: dict[str, Any]) -> EnqueueOutcome:
        outcome = self.send(job)
        if not self.delivery.background:  # read back by `post`, in this thread
            self._answers[job_key(job)] = outcome
        if outcome.status in ("enqueued", "duplicate"):
            self.pins[outcome.job_id] = outcome.job.checkpoint
            self._sent[outcome.job_id] = job
        log.info("eval job for step %s: %s", outcome.job.step, outcome.message)
        return outcome

    # ---- reconciliation ----------------------------------------------------------------
    def release_pins(self) -> int:
        """Unpin checkpoints whose jobs are done (finished, canceled, stopped, or recorded and expired).

        The worker unpins after recording; this covers workers that see the checkpoints
        read-only. Failed jobs keep their pin (they can be re-queued). Returns how many were released.

        A job Redis no longer has, not recorded, whose pin is still on its checkpoint (no worker
        recorded it, nobody dismissed it) was lost by Redis itself: a restart without persistence,
        a FLUSHALL, an eviction policy other than `noeviction`. It goes back into the outbox and is
        queued again (a worker that did record it meanwhile does not evaluate it twice: the ledger).
        """
        if not self.pins:
            return 0
        conn = self.connection()
        ids = list(self.pins)
        done = {JobStatus.FINISHED, JobStatus.CANCELED, JobStatus.STOPPED}
        released = 0
        for job_id, job in zip(ids, Job.fetch_many(ids, connection=conn, serializer=JSONSerializer), strict=True):
            recorded = job is None and Ledger(connection=conn).lookup_job(strip_attempt(job_id)) is not None
            if job is None and not recorded and self._send_again(job_id):
                continue
            if recorded or (job is not None and job.get_status(refresh=False) in done):
                checkpoint = self.pins.pop(job_id, None)
                self._sent.pop(job_id, None)
                if checkpoint is not None:
                    unpin_checkpoint(checkpoint, job_id)
                    released += 1
            elif job is None:  # gone, its pin too (dismissed, cancelled): nothing left to release
                self.pins.pop(job_id, None)
                self._sent.pop(job_id, None)
        return released

    def _send_again(self, job_id: str) -> bool:
        """Put a job Redis lost back into its outbox (see `release_pins`); False when it was not lost."""
        checkpoint, payload = self.pins.get(job_id), self._sent.get(job_id)
        if checkpoint is None or payload is None or not has_pin(checkpoint, job_id):
            return False  # recorded (the worker unpinned), dismissed or cancelled by a user
        d = self._deliverer(self.outbox_for(checkpoint))
        d.outbox.put_or_owe(payload)
        self.pins.pop(job_id, None)
        self._sent.pop(job_id, None)  # the delivery registers it again
        self.resent.append(job_id)
        self.note(f"Redis no longer has the eval job for step {payload.get('step')} ({job_id}), and no result "
                  "was recorded: the server lost it (restarted without persistence, flushed, or evicting keys: "
                  "use `maxmemory-policy noeviction` and AOF); queued again")
        d.kick()
        return True

    def _report_owed(self, report: DeliveryReport) -> None:
        """After each delivery: what is owed in memory, for `dflash-eval status` (best effort)."""
        runs = {j["run_id"] for j, _ in report.owed} | self._owed_runs
        if not runs:
            return
        conn = self.connection()
        for run_id in runs:
            record_owed(conn, run_id, [(j, w) for j, w in report.owed if j["run_id"] == run_id])
        self._owed_runs = {j["run_id"] for j, _ in report.owed}

    def _give_up_owed(self, outbox: Outbox) -> None:
        """The producer ends with jobs neither written nor queued: list each one loudly, mark it lost
        for `status` (when the queue answers), and release its pin (nothing will ever queue it)."""
        owed = outbox.give_up_owed()
        if not owed:
            return
        for payload, why in owed:
            job = validate_job(payload)  # what submit() made: valid
            job_id = job_id_for(job, job_fingerprint(job))
            unpin_checkpoint(job.checkpoint, job_id)
            self.pins.pop(job_id, None)
            self.note(f"eval job for step {job.step} was never queued nor written to disk ({why}); it is "
                      f"lost when training ends: queue it by hand with `dflash-eval enqueue {job.checkpoint} "
                      f"--suite {job.suite}`")
        log.error("eval jobs NOT QUEUED for step(s) %s of run %s: the outbox %s could not be written and the "
                  "queue did not take them", [j["step"] for j, _ in owed], owed[0][0].get("run_id"), outbox.dir)
        try:
            for run_id in {j["run_id"] for j, _ in owed}:
                record_owed(self.connection(), run_id, [(j, w) for j, w in owed if j["run_id"] == run_id],
                            lost=True)
        except Exception:  # noqa: BLE001 - the queue is unreachable: the log and `errors` have it
            log.debug("could not mark the owed jobs lost in Redis", exc_info=True)
