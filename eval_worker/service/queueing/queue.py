"""The eval queue on RQ: its names and settings, status, requeue of failures, cancel, dismiss.

Queues: `<base>-high`, `<base>`, `<base>-low` (base `dflash-eval`); workers take them in that
order. Every RQ job stores JSON only (`JSONSerializer`: the function is named by its
dotted path, the argument is the job payload), so `rq info`, rq-dashboard and any
language can read them, and no pickle is ever loaded.

Putting a job on a queue (dedupe by deterministic job id, `force`, the outbox) is
`job_client.py`'s alone: every producer goes through its `JobClient`.
"""
from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from rq import Queue, Retry
from rq.command import send_stop_job_command
from rq.exceptions import InvalidJobOperation
from rq.job import Job, JobStatus
from rq.registry import FailedJobRegistry, ScheduledJobRegistry, StartedJobRegistry
from rq.serializers import JSONSerializer
from rq.worker import Worker

from dflash_train.checkpoints.publication import unpin_checkpoint
from dflash_train.common.redaction import redact
from eval_worker.results.ledger import Ledger, series_keys
from eval_worker.service.jobs.schema import PRIORITIES, JobError
from eval_worker.service.queueing import routing
from eval_worker.service.queueing.outbox import job_key
from eval_worker.service.queueing.rq_jobs import fetch_job, fetch_jobs, get_queue

# the only function an eval job may name (job_guard.EvalJob); jobs queued before the service was split into
# sub-packages name it by its old module, and still run
JOB_FUNC = "eval_worker.service.worker.eval_job.run_eval_job"
LEGACY_JOB_FUNCS = ("eval_worker.service.eval_job.run_eval_job",)
DEFAULT_BASE = "dflash-eval"
# Redis keys of this module (the ledger's index and the worker's quarantine are theirs)
JOBS_PREFIX = "dflash:jobs:"        # hash per run: "<step>:<digest[:12]>:<suitefp>" -> {"job_id", "job"}
TARGET_FIELD = "dflash_target"      # in an RQ worker's hash: its own --target (job_ids.canonical_target)
OWED_PREFIX = "dflash:owed:"        # hash per run: outbox key -> a job the trainer holds in memory only
PENDING = {JobStatus.QUEUED, JobStatus.STARTED, JobStatus.SCHEDULED, JobStatus.DEFERRED,
           JobStatus.CREATED, JobStatus.READY_TO_ENQUEUE}


@dataclass
class QueueConfig:
    """How jobs are enqueued. Durations in seconds."""

    base: str = DEFAULT_BASE
    job_timeout: int = 2 * 3600          # one evaluation, worst case
    retry_max: int = 2                   # also covers jobs abandoned by a crashed worker
    retry_intervals: list[int] = field(default_factory=lambda: [30, 300])  # back-off
    result_ttl: int = 7 * 86400          # finished jobs stay visible (and deduped) a week
    failure_ttl: int = 30 * 86400        # failed jobs stay re-queueable a month
    ttl: int | None = None               # max time waiting in the queue (None: forever)
    route_by_target: bool = False        # a job naming a target goes to its target's queues (routing.py)
    backlog: str = "all"                 # the run's backlog policy: all | newest-first | thin:K (routing.py)

    def retry(self) -> Retry | None:
        return Retry(max=self.retry_max, interval=list(self.retry_intervals) or 0) if self.retry_max > 0 else None


def queue_name(base: str, priority: str) -> str:
    if priority not in PRIORITIES:
        raise JobError(f"unknown priority {priority!r} (one of {list(PRIORITIES)})")
    return base if priority == "default" else f"{base}-{priority}"


def queue_names(base: str = DEFAULT_BASE) -> list[str]:
    """All queues of a base, highest priority first (the order workers listen in)."""
    return [queue_name(base, p) for p in PRIORITIES]


def failure_reason(job: Job) -> str:
    """The last meaningful line of a failed job's traceback: the reason it failed."""
    result = None
    try:
        result = job.latest_result()
    except Exception:  # noqa: BLE001 - an unreadable result must not break status
        pass
    text = (getattr(result, "exc_string", None) or "").strip()
    if not text:
        return "(no reason recorded)"
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if not ln.startswith(("File ", "^", "~")) and not ln.startswith("During handling"):
            return _cut(ln)
    return _cut(lines[-1])


MAX_REASON = 400  # characters of a failure reason shown by `status` (the full text stays in RQ)


def _cut(reason: str) -> str:
    reason = redact(reason)  # a reason recorded before redaction, or by another worker
    if len(reason) <= MAX_REASON:
        return reason
    return f"{reason[:MAX_REASON]}... ({len(reason)} characters; `rq info` or the job's result has all of it)"


def workers_target(connection, queue: str) -> str | None:
    """The target that a job naming none gets: the own `--target` of the workers serving `queue`
    (recorded in their registration), when they all have the same one. Spelling it in the job
    makes it the same evaluation, and the same job id, as one that names that target."""
    targets = set()
    for w in Worker.all(connection=connection, serializer=JSONSerializer):
        if queue in w.queue_names():
            raw = connection.hget(w.key, TARGET_FIELD)
            targets.add(raw.decode() if isinstance(raw, bytes) else raw)
    return targets.pop() if len(targets) == 1 and None not in targets else None


# --------------------------------------------------------------------------- owed by a trainer

def record_owed(connection, run_id: str, owed: list[tuple[dict[str, Any], str]], *, lost: bool = False) -> None:
    """Tell `status` which of a run's jobs its trainer holds in memory only (its outbox could not
    be written: disk full, read-only) and has not queued yet; `lost`: the trainer gave them up
    (training ended). An empty `owed` clears the run's entry (unless `lost`, which only adds).
    The jobs are the outbox's JSON data (what it would have written)."""
    key = OWED_PREFIX + run_id
    with connection.pipeline() as pipe:
        if not lost:
            pipe.delete(key)
        for payload, why in owed:
            entry = {"step": payload.get("step"), "checkpoint": payload.get("checkpoint"),
                     "suite": payload.get("suite"), "why": why, "lost": lost, "since": datetime.now(UTC).isoformat()}
            pipe.hset(key, job_key(payload), json.dumps(entry))
        pipe.execute()


def owed_jobs(connection, run: str | None = None) -> list[dict[str, Any]]:
    out = []
    for key in connection.scan_iter(match=OWED_PREFIX + (run or "*"), count=200):
        run_id = (key.decode() if isinstance(key, bytes) else key)[len(OWED_PREFIX):]
        for field_, raw in connection.hscan_iter(key):
            try:
                entry = json.loads(raw)
            except ValueError:
                continue
            out.append({"run_id": run_id, "key": field_.decode() if isinstance(field_, bytes) else field_, **entry})
    return sorted(out, key=lambda e: (e["run_id"], e.get("step") or 0))


# --------------------------------------------------------------------------- status

def _job_brief(job: Job) -> dict[str, Any]:
    meta = job.meta or {}
    return {"job_id": job.id, "run_id": meta.get("run_id"), "step": meta.get("step"), "suite": meta.get("suite"),
            "attempt": meta.get("attempt"), "origin": job.origin, "worker": job.worker_name,
            "spooled_result": meta.get("spooled_result"),  # computed; only its ledger write is retried
            "enqueued_at": job.enqueued_at.isoformat() if job.enqueued_at else None,
            "started_at": job.started_at.isoformat() if job.started_at else None}


STATUS_CHUNK = 1000  # job ids read per round trip when a long queue is filtered by run
_BRIEF_FIELDS = ("meta", "origin", "worker_name", "enqueued_at", "started_at")


def _queued_briefs_of(connection, ids: list[str]) -> list[dict[str, Any]]:
    """`_job_brief` of queued jobs from the five fields it shows (HMGET in pipelined chunks), not whole
    jobs: listing 100,000 queued jobs no longer decompresses and parses every payload."""
    from rq.utils import str_to_date

    def when(raw):
        try:
            return str_to_date(raw).isoformat() if raw else None
        except ValueError:
            return None

    out = []
    for lo in range(0, len(ids), STATUS_CHUNK):
        chunk = ids[lo:lo + STATUS_CHUNK]
        with connection.pipeline(transaction=False) as pipe:
            for job_id in chunk:
                pipe.hmget(Job.key_for(job_id), _BRIEF_FIELDS)
            rows = pipe.execute()
        for job_id, (meta, origin, worker, enqueued, started) in zip(chunk, rows, strict=True):
            if origin is None and meta is None:
                continue  # deleted meanwhile
            try:
                meta = json.loads(meta) if meta else {}
            except ValueError:
                meta = {}
            text = lambda b: b.decode() if isinstance(b, bytes) else b  # noqa: E731
            out.append({"job_id": job_id, "run_id": meta.get("run_id"), "step": meta.get("step"),
                        "suite": meta.get("suite"), "attempt": meta.get("attempt"), "origin": text(origin),
                        "worker": text(worker) or None, "spooled_result": meta.get("spooled_result"),
                        "enqueued_at": when(enqueued), "started_at": when(started)})
    return out


def _queued_briefs(connection, q: Queue, run: str | None, limit: int | None) -> tuple[list[dict[str, Any]], int]:
    """(briefs of the queued jobs in the order served, at most `limit` of them; how many there are).

    Only the jobs shown are loaded: a queue of 100,000 jobs is read as ids (and, for `run`,
    each job's meta field, in pipelined chunks), not as 100,000 job objects."""
    if run is None:
        total = q.count
        ids = q.get_job_ids(0, limit) if limit is not None else q.get_job_ids()
        return _queued_briefs_of(connection, ids), total
    ids, total = q.get_job_ids(), 0
    mine: list = []
    for lo in range(0, len(ids), STATUS_CHUNK):
        chunk = ids[lo:lo + STATUS_CHUNK]
        with connection.pipeline() as pipe:
            for job_id in chunk:
                pipe.hget(Job.key_for(job_id), "meta")
            metas = pipe.execute()
        for job_id, raw in zip(chunk, metas, strict=True):
            try:
                if raw is not None and json.loads(raw).get("run_id") == run:
                    total += 1
                    if limit is None or len(mine) < limit:
                        mine.append(job_id)
            except (ValueError, AttributeError):
                continue
    return _queued_briefs_of(connection, mine), total


def server_risks(connection) -> list[str]:
    """What in the Redis server's own configuration can drop accepted jobs without a trace, one
    sentence each (empty when nothing, or when the server does not say): an eviction policy other
    than `noeviction` (a shared server under memory pressure deletes job hashes, queue lists and
    the ledger index like any cache key; RQ and Celery require `noeviction`), and no persistence at
    all (a restart empties every queue). Told by the worker, `status`, the commands and the hook.
    Raises the connection's errors (an unreachable server)."""
    import redis

    out = []
    try:
        memory = connection.info("memory")
        policy, limit = memory.get("maxmemory_policy"), int(memory.get("maxmemory") or 0)
        if policy and policy != "noeviction":
            out.append(f"this Redis evicts keys (maxmemory-policy {policy}, maxmemory "
                       f"{f'{limit} bytes' if limit else 'unlimited for now'}): under memory pressure queued jobs, "
                       "running jobs' keys and the results index vanish without a failure; set "
                       "`maxmemory-policy noeviction` (or give the eval queue a Redis of its own)")
        aof = int(connection.info("persistence").get("aof_enabled") or 0)
        if not aof:
            save = connection.config_get("save").get("save")
            if save is not None and not str(save).strip():
                out.append("this Redis keeps no data on disk (no AOF, no RDB snapshots): a restart empties every "
                           "queue (a trainer's hook queues its lost jobs again; jobs queued by hand are gone); "
                           "set `appendonly yes`")
    except redis.exceptions.ResponseError:  # INFO or CONFIG refused (a managed server, an ACL): it does not say
        pass
    return out


def status(connection, base: str = DEFAULT_BASE, run: str | None = None, limit: int | None = None) -> dict[str, Any]:
    """Queue depths, running jobs and workers, failures with reasons, latest and best τ per run.

    `limit`: list at most this many queued jobs per queue (`queued_total` counts them all)."""
    out: dict[str, Any] = {"queues": {}, "queued": [], "running": [], "scheduled": [], "failed": [], "workers": [],
                           "runs": {}, "owed": owed_jobs(connection, run), "queued_total": 0,
                           "server_warnings": server_risks(connection)}
    for name in all_queue_names(connection, base):
        q = get_queue(connection, name)
        out["queues"][name] = q.count
        briefs, total = _queued_briefs(connection, q, run, limit)
        out["queued"] += briefs  # in the order served
        out["queued_total"] += total
        started = StartedJobRegistry(name, connection=connection, serializer=JSONSerializer)
        out["running"] += [_job_brief(j) for j in fetch_jobs(connection, started.get_job_ids(cleanup=False))]
        sched = ScheduledJobRegistry(name, connection=connection, serializer=JSONSerializer)
        out["scheduled"] += [_job_brief(j) for j in fetch_jobs(connection, sched.get_job_ids())]
        failed = FailedJobRegistry(name, connection=connection, serializer=JSONSerializer)
        for j in fetch_jobs(connection, failed.get_job_ids()):
            out["failed"].append({**_job_brief(j), "reason": failure_reason(j),
                                  "ended_at": j.ended_at.isoformat() if j.ended_at else None})
    names = set(all_queue_names(connection, base))
    worker_queues = []
    for w in Worker.all(connection=connection, serializer=JSONSerializer):
        worker_queues.append(w.queue_names())
        if not names.intersection(w.queue_names()):
            continue
        out["workers"].append({"name": w.name, "state": str(w.get_state()), "host": w.hostname, "pid": w.pid,
                               "current_job": w.get_current_job_id(), "queues": w.queue_names(),
                               "successful": w.successful_job_count, "failed": w.failed_job_count})
    out["targets_without_worker"] = routing.orphan_targets(connection, base, worker_queues)
    out["skipped"] = routing.skipped(connection, all_queue_names(connection, base), run)
    if run:
        for section in ("queued", "running", "scheduled", "failed"):
            out[section] = [j for j in out[section] if j["run_id"] == run]
    summaries = Ledger(connection=connection).indexed(run)
    for s, series in zip(summaries, series_keys(summaries), strict=True):
        r = out["runs"].setdefault(s["run_id"], {"evaluated": 0, "latest": None, "best": None, "suites": {}})
        # per series too (suite, options, target): τ on gsm8k and on a coding suite, or under two counting
        # rules, are not one scale, a best across them means little
        for tally in (r, r["suites"].setdefault(series, {"evaluated": 0, "latest": None, "best": None})):
            tally["evaluated"] += 1
            if tally["latest"] is None or (s["step"], s["attempt"]) >= (tally["latest"]["step"],
                                                                        tally["latest"]["attempt"]):
                tally["latest"] = s
            if isinstance(s.get("tau"), (int, float)) and (tally["best"] is None or s["tau"] > tally["best"]["tau"]):
                tally["best"] = s
    for run_id, r in out["runs"].items():
        r["eval_lag"] = routing.eval_lag(connection, run_id, r["latest"]["step"] if r["latest"] else None)
    return out


def all_queue_names(connection, base: str = DEFAULT_BASE) -> list[str]:
    """`base`'s priority queues, then its backlog and routed target queues that RQ knows of."""
    known = {q.name for q in Queue.all(connection=connection, serializer=JSONSerializer)}
    extra = [routing.backlog_queue(base)] if routing.backlog_queue(base) in known else []
    return queue_names(base) + extra + routing.routed_queue_names(connection, base)


# --------------------------------------------------------------------------- requeue

def requeue_failed(connection, base: str = DEFAULT_BASE, job_ids: Iterable[str] | None = None,
                   run: str | None = None) -> list[str]:
    """Put failed jobs back on their queues under the same id (RQ's FailedJobRegistry.requeue)."""
    wanted = set(job_ids) if job_ids else None
    done = []
    for name in all_queue_names(connection, base):
        registry = FailedJobRegistry(name, connection=connection, serializer=JSONSerializer)
        for job in fetch_jobs(connection, registry.get_job_ids()):
            if wanted is not None and job.id not in wanted:
                continue
            if run is not None and (job.meta or {}).get("run_id") != run:
                continue
            try:
                registry.requeue(job)
            except InvalidJobOperation:
                continue  # someone else requeued it meanwhile
            done.append(job.id)
    return done


def remembered(connection, run: str) -> list[dict[str, Any]]:
    """The last job payload enqueued for each (step, checkpoint, suite) of `run`."""
    out = []
    for raw in connection.hvals(JOBS_PREFIX + run):
        try:
            out.append(json.loads(raw))
        except ValueError:
            continue
    return sorted(out, key=lambda e: (e["job"]["step"], e["suite_fingerprint"]))


# --------------------------------------------------------------------------- cancel

def cancel(connection, job_id: str) -> str:
    """Cancel a queued job, or stop a running one; release its retention pin. Returns what happened."""
    job = fetch_job(connection, job_id)
    state = job.get_status()
    checkpoint = (job.meta or {}).get("checkpoint")
    if state == JobStatus.STARTED:
        try:
            send_stop_job_command(connection, job_id, serializer=JSONSerializer)
        except InvalidJobOperation as e:
            raise JobError(f"cannot stop {job_id}: {e}") from None
        msg = f"asked worker {job.worker_name} to stop {job_id}"
    elif state in PENDING:
        job.cancel()
        msg = f"canceled {job_id} (was {state.value})"
    elif state == JobStatus.FAILED:
        raise JobError(f"{job_id} is failed; nothing to cancel (`dflash-eval dismiss {job_id}` removes a failure, "
                       "`dflash-eval requeue --failed --job ...` runs it again)")
    else:
        raise JobError(f"{job_id} is {state.value if state else 'gone'}; nothing to cancel")
    if checkpoint:
        unpin_checkpoint(checkpoint, job_id)
    return msg


# --------------------------------------------------------------------------- dismiss

def dismiss_failed(connection, base: str = DEFAULT_BASE, job_ids: Iterable[str] | None = None,
                   run: str | None = None) -> tuple[list[str], list[str]]:
    """Remove failed jobs for good (all of `base`'s, those of `run`, or `job_ids`): out of the failed
    registry, the job deleted, its retention pin released. The ledger is not touched (a failure
    never wrote to it). Returns (dismissed ids, problems: ids that are not failed jobs here)."""
    wanted = None if job_ids is None else list(dict.fromkeys(job_ids))
    found: dict[str, Job] = {}
    for name in all_queue_names(connection, base):
        registry = FailedJobRegistry(name, connection=connection, serializer=JSONSerializer)
        for job in fetch_jobs(connection, registry.get_job_ids()):
            if (wanted is None or job.id in wanted) and (run is None or (job.meta or {}).get("run_id") == run):
                found[job.id] = job
    problems = []
    for job_id in wanted or []:
        if job_id in found:
            continue
        try:
            state = fetch_job(connection, job_id).get_status()
            problems.append(f"{job_id} is {state.value if state else 'gone'}, not failed; nothing to dismiss"
                            + (" (`dflash-eval cancel` stops a queued or running job)" if state in PENDING else ""))
        except JobError as e:
            problems.append(str(e))
    dismissed = []
    for job_id, job in found.items():
        checkpoint = (job.meta or {}).get("checkpoint")
        job.delete(remove_from_queue=True)  # also leaves the failed registry
        if checkpoint:
            unpin_checkpoint(checkpoint, job_id)
        dismissed.append(job_id)
    return dismissed, problems
