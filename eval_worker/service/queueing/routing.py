"""Many runs, several targets, a pool of workers: routing by target, backlog policies, eval lag.

Routing (opt-in: `enqueue --route-by-target`, the hook's `route_by_target=True`): a job that
names a target goes to the queue family of that target's identity, ``<base>@<key>`` (with its
``-high`` / ``-low`` / ``-backlog`` queues), where `key` is :func:`target_key` of the job's target
path (the path as the worker sees it, which jobs already require). A worker started with
``--serve-target PATH`` (repeatable) listens to those targets' queues besides the plain ones, tier
by tier (every ``high`` queue before any ``default`` one: priorities keep working), and within a
tier the queues of the targets it holds loaded first (:func:`affinity_order`), so it only swaps
targets when its own have nothing queued. These are RQ queues and RQ's dequeue; nothing else
brokers the jobs. ``dflash:targets`` maps each key to the target path for `status`.

Backlog policy per run and target (`--backlog`, the job's run; each target's and each suite's jobs
are a stream of their own; the train-end checkpoint is the newest, so no policy ever displaces it):
- ``all``: every checkpoint, first in first out (as before);
- ``newest-first``: when a newer checkpoint of the run is queued, the run's previous newest one
  (if still queued) moves to the front of the family's ``-backlog`` queue, which workers serve
  last: each run's newest checkpoint is next in line (runs in the order they published), and
  older ones are filled in, newest first, when nothing newer waits;
- ``thin:K``: the previous newest is canceled and marked ``skipped`` (its job meta says why)
  unless it was the K-th, 2K-th, ... checkpoint queued for the run; `status` lists skipped jobs
  and ``dflash-eval requeue --run RUN --steps ... [--target T]`` evaluates them after all (then
  they are no longer listed as skipped).
Moves and skips are atomic on Redis (a Lua script takes a job out of its list only if it is
still there: a worker that already took it keeps it).

Eval lag: every enqueue records the checkpoint's step and time in ``dflash:published:<run>``;
the lag of a run is (steps, seconds) between its newest queued checkpoint and its newest
evaluated one (the ledger index), shown by `status` and written into each ledger record at
completion (``queue.eval_lag``), from which the sinks log it.
"""
from __future__ import annotations

import hashlib
import os
import re
import shlex
import time
from collections.abc import Iterable
from typing import Any

from eval_worker.service.jobs.schema import PRIORITIES, JobError, JobPayload
from eval_worker.service.queueing.rq_jobs import fetch_job, fetch_jobs

BACKLOG = "backlog"                      # the fill-in queue of a family: served after `low`
POLICIES_HELP = "all | newest-first | thin:K"
TARGETS_KEY = "dflash:targets"           # hash: target key -> target path (for `status`)
BACKLOG_PREFIX = "dflash:backlog:"       # hash per run and suite: seq, head job id / step / seq / queue
PUBLISHED_PREFIX = "dflash:published:"   # hash per run: "<step>" -> unix time of its first enqueue; "newest"
_SLUG = re.compile(r"[^A-Za-z0-9_.-]+")

# Take job ARGV[1] out of list KEYS[1] only if it is still there; then either push it to the front
# of KEYS[2] (a move: origin ARGV[2], queue registered in KEYS[4]) or leave it out (a skip).
_TAKE = """
if redis.call('lrem', KEYS[1], 1, ARGV[1]) == 0 then return 0 end
if ARGV[2] ~= '' then
  redis.call('lpush', KEYS[2], ARGV[1])
  redis.call('hset', KEYS[3], 'origin', ARGV[2])
  redis.call('sadd', KEYS[4], KEYS[2])
end
return 1
"""


# --------------------------------------------------------------------------- routing

def target_key(target: str) -> str:
    """The routing identity of a target path: its name and a digest of the normalised path."""
    norm = os.path.normpath(os.path.abspath(os.fspath(target)))
    name = _SLUG.sub("-", os.path.basename(norm)).strip("-")[:40] or "target"
    return f"{name}-{hashlib.sha256(norm.encode()).hexdigest()[:8]}"


def routed_base(base: str, target: str | None) -> str:
    """The queue family of a job's target (`base` itself for a job that names none)."""
    return f"{base}@{target_key(target)}" if target else base


def family_of(queue: str, base: str) -> tuple[str | None, str]:
    """(target key or None, tier) of one of `base`'s queues; tier is a priority or `backlog`."""
    rest = queue[len(base):]
    if rest.startswith("@"):
        body = rest[1:]
        for tier in ("high", "low", BACKLOG):  # keys end in hex digits, never in a tier's name
            if body.endswith(f"-{tier}"):
                return body[:-len(tier) - 1], tier
        return body, "default"
    return None, (rest[1:] if rest.startswith("-") else "default")


def backlog_queue(family: str) -> str:
    return f"{family}-{BACKLOG}"


def family_queue_names(family: str) -> list[str]:
    """A family's queues in the order served: priorities, then the backlog."""
    return [family if p == "default" else f"{family}-{p}" for p in PRIORITIES] + [backlog_queue(family)]


def serving_queue_names(base: str, priorities: Iterable[str], targets: Iterable[str] = ()) -> list[str]:
    """What a worker listens to, tier by tier: the plain family and each served target's."""
    families = [base] + [routed_base(base, t) for t in dict.fromkeys(targets)]
    tiers = [p for p in priorities] + [BACKLOG]
    out = []
    for tier in tiers:
        for fam in families:
            out.append(backlog_queue(fam) if tier == BACKLOG else (fam if tier == "default" else f"{fam}-{tier}"))
    return out


def affinity_order(queues: list, base: str, loaded_keys: set[str], name=lambda q: q.name) -> list:
    """`queues` with, inside each tier, the queues of loaded targets first (stable otherwise)."""
    tiers = [*PRIORITIES, BACKLOG]

    def rank(item):
        i, q = item
        key, tier = family_of(name(q), base) if name(q).startswith(base) else (None, "default")
        return (tiers.index(tier) if tier in tiers else 0, 0 if key in loaded_keys else 1, i)
    return [q for _, q in sorted(enumerate(queues), key=rank)]


def remember_target(connection, target: str | None) -> None:
    if target:
        connection.hset(TARGETS_KEY, target_key(target), target)


# --------------------------------------------------------------------------- backlog policy

def parse_policy(text: str | None) -> tuple[str, int | None]:
    """`all`, `newest-first` or `thin:K` (K >= 2) -> (name, K); JobError otherwise."""
    text = (text or "all").strip()
    if text in ("all", "newest-first"):
        return text, None
    m = re.fullmatch(r"thin:(\d+)", text)
    if m and int(m.group(1)) >= 2:
        return "thin", int(m.group(1))
    raise JobError(f"unknown backlog policy {text!r}: one of {POLICIES_HELP} (K >= 2)")


def _take(connection, queue: str, job_id: str, dest: str | None) -> bool:
    from rq.job import Job
    from rq.queue import Queue

    keys = [Queue.redis_queue_namespace_prefix + queue,
            Queue.redis_queue_namespace_prefix + (dest or queue), Job.key_for(job_id), Queue.redis_queues_keys]
    return bool(connection.eval(_TAKE, len(keys), *keys, job_id, dest or ""))


def apply_backlog(connection, job: JobPayload, job_id: str, queue: str, policy: str | None,
                  family: str) -> str | None:
    """After `job_id` was queued on `queue`: apply the run's policy to its previous newest job.
    Returns a note on what was done to it (None: nothing)."""
    name, k = parse_policy(policy)
    if name == "all" or job.requested_by == "requeue":
        return None
    # one stream per (run, suite, target): a checkpoint's jobs on two suites or two targets never
    # displace each other, so no policy holds back any target's newest checkpoint
    stream = job.suite + "\0" + (target_key(job.target) if job.target else "")
    key = BACKLOG_PREFIX + job.run_id + ":" + hashlib.sha256(stream.encode()).hexdigest()[:12]
    seq = int(connection.hincrby(key, "seq", 1))
    prev = connection.hgetall(key)
    prev = {(a.decode() if isinstance(a, bytes) else a): (b.decode() if isinstance(b, bytes) else b)
            for a, b in prev.items()}
    if prev.get("head") and int(prev.get("head_step", -1)) > job.step:
        # an older checkpoint queued late: under newest-first it waits with the other older ones
        if name == "newest-first" and _take(connection, queue, job_id, backlog_queue(family)):
            return f"older than step {prev['head_step']}: waits in {backlog_queue(family)}"
        return None
    connection.hset(key, mapping={"head": job_id, "head_step": job.step, "head_seq": seq,
                                  "head_queue": queue, "head_family": family})
    if not prev.get("head"):
        return None
    # head and head_queue are written together, so a head has its queue
    old_id, old_queue, old_family = prev["head"], prev.get("head_queue"), prev.get("head_family") or family
    assert old_queue is not None, prev
    if name == "newest-first":
        if _take(connection, old_queue, old_id, backlog_queue(old_family)):
            return f"{old_id} moved to {backlog_queue(old_family)} (filled in when idle)"
        return None
    assert k is not None, policy  # thin:K, the one policy left, carries its K
    if int(prev.get("head_seq", 0)) % k == 0:
        return None
    if _take(connection, old_queue, old_id, None):
        _mark_skipped(connection, old_id, f"thin:{k} keeps every {_ordinal(k)} checkpoint and the newest; this one "
                                          "is neither (a newer one is queued)")
        return f"{old_id} skipped (thin:{k}; `{requeue_command(job.run_id, [prev.get('head_step')], job.target)}` "\
               "evaluates it)"
    return None


def _ordinal(k: int) -> str:
    suffix = "th" if k % 100 in (11, 12, 13) else {1: "st", 2: "nd", 3: "rd"}.get(k % 10, "th")
    return f"{k}{suffix}"


def _mark_skipped(connection, job_id: str, reason: str) -> None:
    from rq.job import JobStatus
    from rq.registry import CanceledJobRegistry
    from rq.serializers import JSONSerializer

    from dflash_train.checkpoints.publication import unpin_checkpoint

    job = fetch_job(connection, job_id)
    job.meta["skipped"] = reason
    # RQ knows no "skipped": the job is canceled, and its description (what rq-dashboard and `rq info`
    # show beside "Canceled") names the skip
    job.description = f"SKIPPED by the backlog policy ({reason}): {job.description}"
    with connection.pipeline() as pipe:
        job.save_meta()
        pipe.hset(job.key, "description", job.description)
        job.set_status(JobStatus.CANCELED, pipeline=pipe)
        CanceledJobRegistry(job.origin, connection=connection, serializer=JSONSerializer).add(job, pipeline=pipe)
        pipe.execute()
    if job.meta.get("checkpoint"):
        unpin_checkpoint(job.meta["checkpoint"], job_id)  # as a cancel does: retention may take it


def requeue_command(run_id: str, steps: Iterable[Any], target: str | None) -> str:
    """The `requeue` command line that evaluates skipped `steps` of a run: on their own target only
    (without `--target`, a run on two targets would evaluate the step again on both)."""
    cmd = f"dflash-eval requeue --run {shlex.quote(run_id)} --steps {','.join(str(s) for s in steps)}"
    return cmd + (f" --target {shlex.quote(target)}" if target else "")  # quoted: pasted into a shell


def note_requeued(connection, job_id: str, new_id: str) -> None:
    """A skipped job evaluated after all (`requeue`): it stays canceled to RQ, but is no longer listed
    as skipped, and its description says by which job it was evaluated."""
    job = fetch_job(connection, job_id)
    if not (job.meta or {}).get("skipped"):
        return
    job.meta["requeued_as"] = new_id
    job.save_meta()
    connection.hset(job.key, "description", f"{job.description} [requeued as {new_id}]")


def skipped(connection, queues: Iterable[str], run: str | None = None) -> list[dict[str, Any]]:
    """Jobs a thin policy skipped (canceled with a `skipped` reason) and not requeued since, with run,
    step, target and reason."""
    from rq.registry import CanceledJobRegistry
    from rq.serializers import JSONSerializer

    out = []
    for q in queues:
        reg = CanceledJobRegistry(q, connection=connection, serializer=JSONSerializer)
        for j in fetch_jobs(connection, reg.get_job_ids()):
            meta = j.meta or {}
            if meta.get("skipped") and not meta.get("requeued_as") and (run is None or meta.get("run_id") == run):
                payload = j.args[0] if j.args and isinstance(j.args[0], dict) else {}
                out.append({"job_id": j.id, "run_id": meta.get("run_id"), "step": meta.get("step"),
                            "target": payload.get("target"), "reason": meta["skipped"], "origin": j.origin})
    return sorted(out, key=lambda s: (str(s["run_id"]), str(s["target"] or ""), s["step"] or 0))


# --------------------------------------------------------------------------- eval lag

def note_published(connection, run_id: str, step: int, at: float | None = None) -> None:
    """Record that checkpoint `step` of the run was queued (its first enqueue's time is kept)."""
    at = time.time() if at is None else at
    key = PUBLISHED_PREFIX + run_id
    connection.hsetnx(key, str(int(step)), f"{at:.3f}")
    # the newest step: a Lua max, so two enqueues racing never lower it
    connection.eval("local c = tonumber(redis.call('hget', KEYS[1], 'newest') or '-1') "
                    "if tonumber(ARGV[1]) > c then redis.call('hset', KEYS[1], 'newest', ARGV[1]) end return 1",
                    1, key, int(step))


def eval_lag(connection, run_id: str, evaluated_step: int | None) -> dict[str, Any] | None:
    """Steps and seconds between the run's newest queued checkpoint and `evaluated_step` (its newest
    evaluated one), or None when nothing was queued through this Redis."""
    key = PUBLISHED_PREFIX + run_id
    raw_newest = connection.hget(key, "newest")
    if raw_newest is None:
        return None
    newest = int(raw_newest)
    out: dict[str, Any] = {"newest_published_step": newest, "newest_evaluated_step": evaluated_step, "lag_steps": None,
           "lag_s": None}
    t_new = connection.hget(key, str(newest))
    if evaluated_step is None:
        return out
    out["lag_steps"] = max(0, newest - int(evaluated_step))
    t_ev = connection.hget(key, str(int(evaluated_step)))
    if t_new is not None and t_ev is not None:
        out["lag_s"] = round(max(0.0, float(t_new) - float(t_ev)), 3)
    return out


def lag_at_completion(connection, run_id: str, step: int) -> dict[str, Any] | None:
    """The run's eval lag once `step` is recorded: its newest evaluated step becomes max(step, the
    newest evaluated so far), kept in the run's published hash (one round trip, not a ledger read)."""
    newest = connection.eval("local c = tonumber(redis.call('hget', KEYS[1], 'evaluated') or '-1') "
                             "if tonumber(ARGV[1]) > c then redis.call('hset', KEYS[1], 'evaluated', ARGV[1]) "
                             "return tonumber(ARGV[1]) end return c", 1, PUBLISHED_PREFIX + run_id, int(step))
    return eval_lag(connection, run_id, int(newest))


def orphan_targets(connection, base: str, worker_queues: Iterable[Iterable[str]]) -> list[dict[str, Any]]:
    """Routed target families with queued jobs that no registered worker listens to."""
    from rq.queue import Queue

    served = {q for qs in worker_queues for q in qs}
    paths = {(k.decode() if isinstance(k, bytes) else k): (v.decode() if isinstance(v, bytes) else v)
             for k, v in connection.hgetall(TARGETS_KEY).items()}
    families: dict[str, dict[str, Any]] = {}
    for q in Queue.all(connection=connection):
        if not q.name.startswith(base + "@"):
            continue
        key, _ = family_of(q.name, base)
        assert key is not None, q.name  # a queue named base@<key>
        fam = families.setdefault(key, {"target_key": key, "target": paths.get(key), "queued": 0, "queues": [],
                                        "served": False})
        fam["queued"] += q.count
        fam["queues"].append(q.name)
        fam["served"] |= q.name in served
    return [f for f in families.values() if f["queued"] and not f["served"]]


def routed_queue_names(connection, base: str) -> list[str]:
    """Every routed queue of `base` that Redis knows of (RQ's queue set)."""
    from rq.queue import Queue

    return sorted(q.name for q in Queue.all(connection=connection) if q.name.startswith(base + "@"))
