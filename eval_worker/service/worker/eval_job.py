"""The RQ job function: evaluate one checkpoint and record the result once. JSON in, JSON out.

Job processing order (run_eval_job):
  validate payload -> checkpoint inside the roots, COMPLETE.json present, digests match ->
  evaluate (a cached Evaluator) -> write the ledger record (durable, first) -> result sinks
  (W&B; a sink failure is logged, never fails the job) -> return a small JSON summary.
A failure raises an exception whose message is the reason (shown by `status` and `rq info`).
A ledger write that fails (disk full, read-only results) keeps the computed result in the
worker's spool (`<spool_dir>/<job id>.json`) and fails the job with a retryable error that
says so; the retry (RQ's back-off, or `requeue --failed`) writes the spooled result
without evaluating again.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Any

from dflash_train.checkpoints import storage
from dflash_train.checkpoints.publication import CheckpointError, unpin_checkpoint
from dflash_train.common.errors import DFlashError, retryable
from dflash_train.common.fsutil import atomic_write_bytes
from dflash_train.common.progress import format_duration
from eval_worker.engine.options import options_identity
from eval_worker.engine.suite import HF_PREFIX, Suite, load_suite
from eval_worker.results import sinks
from eval_worker.results.ledger import Ledger, read_record, tau_of
from eval_worker.results.sinks import owed
from eval_worker.service.jobs.checkpoints import check_checkpoint, materialize
from eval_worker.service.jobs.confinement import check_suite, check_target
from eval_worker.service.jobs.ids import job_id_for
from eval_worker.service.jobs.schema import JobError, JobPayload, validate_job
from eval_worker.service.queueing import routing
from eval_worker.service.worker import evaluators
from eval_worker.service.worker.evaluators import WorkerSettings

log = logging.getLogger(__name__)

SPOOL_SCHEMA = "dflash-eval-spool/1"


class LedgerWriteFailed(DFlashError, OSError):
    """The evaluation finished but its ledger record could not be written."""

    retryable = True  # the retry only writes the spooled result


def _publish_to_sinks(record: dict[str, Any], job: JobPayload) -> str | None:
    """Tell the result sinks (W&B). Returns their errors as text instead of raising."""
    try:
        env = evaluators.current().settings.env
        assert env is not None, "WorkerSettings fills env"
        outcome = sinks.publish_result(record, job.to_json(), env)  # sinks read JSON, as the ledger keeps it
    except Exception as e:  # noqa: BLE001 - the ledger has the record; `publish` fills the gap later
        log.warning("result sink failed for %s (kept in the ledger; `dflash-eval publish` can retry): %s",
                    record.get("job_id"), e, exc_info=True)
        return f"{type(e).__name__}: {e}"
    bad = [f"{name}: {info.get('error')}" for name, info in outcome.items() if not info["ok"]]
    bad += [f"{name}: published without this record ({record.get('step')}:{record.get('key')})"
            for name, info in outcome.items() if info["ok"] and not owed.holds(info, record)]
    return "; ".join(bad) or None


def run_eval_job(payload: dict[str, Any]) -> dict[str, Any]:
    """RQ job function: evaluate one checkpoint and record the result once. JSON in, JSON out.

    An error that is not `retryable` (dflash_train.common.errors: a bad payload, a checkpoint outside
    the roots, no marker, a digest mismatch, a drafter that does not fit the target, an unknown
    option, ...) fails the job at once, without retries: trying again cannot fix it; once the
    cause is fixed, `dflash-eval requeue --failed` runs it again. Other errors (I/O, out of
    memory, a crashed worker) are retried with back-off.
    """
    from rq import get_current_job

    try:
        return _run(payload, get_current_job())
    except Exception as e:
        _publish_owed(get_current_job(), payload)
        if retryable(e):
            raise
        rq_job = get_current_job()
        if rq_job is not None:
            rq_job.retries_left = 0  # the worker reads this (same object) when it handles the failure
            try:
                rq_job.connection.hset(rq_job.key, "retries_left", 0)
            except Exception:  # noqa: BLE001 - the in-memory value already stops the retry
                pass
        raise


def _publish_owed(rq_job, payload: dict[str, Any]) -> None:
    """A failing job publishes what earlier jobs of its run left to it (their records are in the ledger;
    without this a deferral to a job that then fails left the sinks without them: issue 34 D3)."""
    run_id = payload.get("run_id") if isinstance(payload, dict) else None
    if rq_job is None or not isinstance(run_id, str):
        return
    try:
        path = owed.pending(rq_job.connection, run_id)
        if path is None:
            return
        record = read_record(path)
        error = _publish_to_sinks({**record, "path": str(path)}, validate_job(record["job"]))
    except Exception as e:  # noqa: BLE001 - the job's own failure is what it reports; `publish` fills the gap
        log.warning("job %s failed and could not publish the records of run %s left to it: %s", rq_job.id, run_id, e)
        return
    if error is None:
        owed.settle(rq_job.connection, run_id)
        log.info("job %s failed; published the records of run %s its run's earlier jobs left to it", rq_job.id,
                 run_id)
    else:
        log.warning("job %s failed; publishing the records of run %s left to it failed too (`dflash-eval publish "
                    "--run %s` retries): %s", rq_job.id, run_id, run_id, error)


def _run(payload: dict[str, Any], rq_job) -> dict[str, Any]:
    t0 = time.monotonic()
    job = validate_job(payload)
    s = evaluators.current().settings
    if s.roots is None:
        raise JobError("this worker has no checkpoint roots configured: start it with --checkpoint-root DIR "
                       "or set $DFLASH_CHECKPOINT_ROOTS; refusing to read checkpoints from arbitrary paths")
    connection = rq_job.connection if rq_job is not None else None
    job_id = rq_job.id if rq_job is not None else _local_job_id(job)
    ledger = Ledger(s.results_dir, connection=connection)

    existing = ledger.find_job(job, job_id)
    sink_error, spooled, deferred = None, None, None
    if existing is not None:  # an earlier execution recorded it, then died: do not evaluate twice
        path, record = existing
        created = False
        ledger.index(record, path)
        _drop_spool(s, job_id)
        log.info("job %s already recorded at %s; not evaluating again (the sinks catch up)", job_id, path)
    else:
        spooled = _read_spool(s, job, job_id)
        if spooled is not None:  # evaluated before, only the ledger write failed: write it now
            result, worker_info = spooled["result"], spooled["worker"]
            log.info("job %s: writing the result spooled at %s (not evaluating again)", job_id, _spool_path(s, job_id))
        else:
            result, worker_info = _evaluate(job, s, rq_job)
        try:
            path, record, created = ledger.write(job=job, job_id=job_id, result=result, worker=worker_info,
                                                 queue=_queue_view(connection, job))
        except OSError as e:
            raise _spool(s, job, job_id, result, worker_info, e, rq_job) from e
        _drop_spool(s, job_id)
        if spooled is not None:
            _note(rq_job, spooled_result=None)
    # Every execution that holds a record publishes it, a recorded one too: an execution killed between
    # the ledger and the sinks (or inside a sink) left them behind, and each sink replays the run from
    # the ledger idempotently (each knows the records it has), so this catches them up (issue 34 D1).
    deferred = _next_job_of_run(rq_job, job) if _rebuilds_run(job, s) else None
    if deferred:
        owed.owe(connection, job.run_id, job_id, path, deferred)
        log.info("job %s: result sinks left to %s, queued next for run %s (its publication includes "
                 "this record)", job_id, deferred, job.run_id)
    else:
        sink_error = _publish_to_sinks({**record, "path": str(path)}, job)
        if sink_error is None:
            owed.settle(connection, job.run_id)
    unpin_checkpoint(job.checkpoint, job_id)
    tau = tau_of(record)
    _log_outcome(job_id, job, record, path, time.monotonic() - t0, created)
    return {"job_id": job_id, "run_id": job.run_id, "step": job.step, "attempt": record.get("attempt"),
            "tau": tau, "ledger_path": str(path), "recorded_now": created, "sink_error": sink_error,
            "from_spool": existing is None and spooled is not None, "sinks_deferred_to": deferred,
            "worker_pid": os.getpid(), "target_loads": evaluators.current().target_loads(),
            "seconds": round(time.monotonic() - t0, 3)}


def _log_outcome(job_id: str, job: JobPayload, record: dict[str, Any], path, seconds: float,
                 created: bool) -> None:
    """One line per job in the worker's log: what was measured, how sure, how long it took."""
    result = record.get("result") or {}
    tau = result.get("tau") or {}
    ci = tau.get("ci95") or [None, None]
    base = result.get("baseline") or {}

    def f(x):
        return "?" if not isinstance(x, (int, float)) else f"{x:.3f}"
    extra = f", Δτ vs baseline {f(base.get('delta_tau'))}" if base else ""
    by_t = (result.get("sampling") or {}).get("by_temperature") or {}
    if by_t:  # τ under sampling, one figure per temperature
        extra += "; " + ", ".join(f"τ@t={k} {f((e.get('tau') or {}).get('macro'))}" for k, e in by_t.items())
    errors = [d.get("code") for d in result.get("diagnostics") or [] if d.get("severity") == "error"]
    log.info("job %s: run %s step %s suite %s: τ %s (95%% CI [%s, %s], %s verify steps%s)%s in %s; %s %s",
             job_id, job.run_id, job.step, (result.get("suite") or {}).get("name", job.suite),
             f(tau.get("macro")), f(ci[0]), f(ci[1]), tau.get("num_steps", "?"), extra,
             f"; diagnostics: {', '.join(errors)}" if errors else "", format_duration(seconds),
             "recorded at" if created else "already recorded at", path)


PEEK = 20  # queued jobs looked at for a later job of the same run


def _rebuilds_run(job: JobPayload, s: WorkerSettings) -> bool:
    """Whether publishing this job rebuilds its run from the ledger: W&B offline is the only sink
    on (online W&B appends the missing records; a sink that logs the record it is given must get it)."""
    assert s.env is not None, "WorkerSettings fills env"
    if tuple(s.env.sinks) != ("wandb",):
        return False
    try:
        from eval_worker.results.sinks import registry

        return registry.get("wandb").target(job.to_json()["wandb"], s.env).mode == "offline"
    except Exception:  # noqa: BLE001 - when in doubt, publish now
        return False


def _next_job_of_run(rq_job, job: JobPayload) -> str | None:
    """A job of the same run (and W&B settings) among the next ones queued where this one came from.

    Publishing rebuilds the run's sink state from the whole ledger (an offline W&B run: ~0.1 s per
    record, bench/README.md), so a worker catching up on a backlog would pay that once per job,
    quadratic in the run's length; the last job of the run in line publishes every record instead.
    A job that then never runs leaves its records to `dflash-eval publish` (the ledger has them)."""
    if rq_job is None:
        return None
    try:
        from eval_worker.service.queueing.rq_jobs import fetch_jobs, get_queue

        ids = [i for i in get_queue(rq_job.connection, rq_job.origin).get_job_ids(0, PEEK) if i != rq_job.id]
        for other in fetch_jobs(rq_job.connection, ids):
            payload = other.args[0] if other.args else {}  # another job as RQ holds it: JSON data
            if (isinstance(payload, dict) and payload.get("run_id") == job.run_id
                    and payload.get("wandb") == job.to_json()["wandb"]):
                return other.id
    except Exception as e:  # noqa: BLE001 - when in doubt, publish now
        log.debug("could not look for a later job of %s: %s", job.run_id, e)
    return None


def _queue_view(connection, job: JobPayload) -> dict[str, Any] | None:
    """The run's eval lag once this job is recorded (service/queueing/routing.py); None outside a queue."""
    if connection is None:
        return None
    try:
        lag = routing.lag_at_completion(connection, job.run_id, job.step)
    except Exception as e:  # noqa: BLE001 - bookkeeping: never worth failing a computed result
        log.warning("eval lag of %s not recorded: %s", job.run_id, e)
        return None
    return {"eval_lag": lag} if lag else None


def _local_job_id(job: JobPayload) -> str:
    """A job run outside RQ: an id from the request itself (suite spec, options, target), nothing read."""
    spec = json.dumps({"suite": job.suite, "options": options_identity(job.options), "target": job.target},
                      sort_keys=True)
    return job_id_for(job, "local-" + hashlib.sha256(spec.encode()).hexdigest()[:10])


def _evaluate(job: JobPayload, s: WorkerSettings, rq_job) -> tuple[dict[str, Any], dict[str, Any]]:
    """Check the job's files (checkpoint, target, suite: inside their roots), run the engine; (result, worker info)."""
    checked = check_checkpoint(job, s.roots)  # confined and marked: cheap, before anything is loaded or pulled
    target = job.target or s.default_target
    if not target:
        raise JobError("the job names no target and this worker has no default (--target / $DFLASH_TARGET)")
    if job.target:
        # a worker has checkpoint roots: it refuses to start without them
        check_target(target, s.default_target, s.target_roots, s.roots)  # type: ignore[arg-type]
    suite_name = check_suite(job.suite, s.suite_roots, s.roots)
    suite: str | Suite = suite_name
    assert s.env is not None, "WorkerSettings fills env"
    if suite_name.startswith(HF_PREFIX):  # a standard benchmark, from this worker's dataset copies or cache
        suite = load_suite(suite_name, hf_datasets_dir=s.env.hf_datasets_dir)
    # what is not on this machine (an object store, the Hub) is evaluated from the worker's checkpoint cache
    remote = {k: ref.text for k, ref in (("checkpoint", job.checkpoint_ref), ("baseline", job.baseline_ref))
              if ref is not None and not ref.on_this_machine}
    cache = evaluators.current().checkpoint_cache() if remote else None
    for refetched in (False, True):
        used: list[str] = []
        try:
            # the one hashing pass of the job: local files verified in place, a store's on download (cached by manifest)
            with materialize(job, s.roots, cache, checked=None if refetched else checked) as (
                    checkpoint, baseline, verified):
                used = [p for p in (checkpoint, baseline) if p]
                evaluator = evaluators.current().get(target)
                result = evaluator.evaluate(checkpoint, suite, baseline=baseline, train_metrics=job.train_metrics,
                                            options=job.options, verified=verified).to_dict()
            break
        except CheckpointError as e:
            # a cache entry that fails to load is re-hashed: a corrupt one is dropped and fetched once more
            why = [w for w in (cache.drop_if_corrupt(p) for p in used) if w] if cache and not refetched else []
            if not why:
                raise
            log.warning("job %s: the cached copy failed to load (%s: %s); fetching it again",
                        storage.redact(job.checkpoint), "; ".join(why), e)
    # a result names what was asked for (the store URL), not the worker's cache entry
    for key, field in (("checkpoint", "path"), ("baseline", "checkpoint")):
        if key in remote and isinstance(result.get(key), dict):
            result[key] = {**result[key], field: remote[key]}
    worker_info = {"host": socket.gethostname(), "pid": os.getpid(),
                   "name": s.env.worker_id or (rq_job.worker_name if rq_job else None)}
    return result, worker_info


# --------------------------------------------------------------------------- the spool

def _spool_path(s: WorkerSettings, job_id: str) -> Path:
    assert s.spool_dir is not None, "WorkerSettings fills spool_dir"
    return Path(s.spool_dir) / f"{job_id}.json"


def _spool(s: WorkerSettings, job: JobPayload, job_id: str, result: dict[str, Any],
           worker_info: dict[str, Any], error: OSError, rq_job) -> LedgerWriteFailed:
    """Keep a computed result whose ledger write failed; the error to fail the job with."""
    path = _spool_path(s, job_id)
    entry = {"schema": SPOOL_SCHEMA, "job_id": job_id, "job": job.to_json(), "results_dir": str(s.results_dir),
             "worker": worker_info, "error": f"{type(error).__name__}: {error}", "result": result}
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        atomic_write_bytes(path, json.dumps(entry, sort_keys=True, allow_nan=False).encode(), mode=0o600)
    except (OSError, ValueError) as e2:
        log.error("job %s: ledger write failed (%s) and the result could not be spooled either (%s)", job_id, error, e2)
        return LedgerWriteFailed(f"ledger write failed ({error}); the result could not be kept in the spool "
                                 f"({e2}): a retry evaluates again")
    _note(rq_job, spooled_result=str(path))
    log.error("job %s: ledger write failed (%s); result kept in %s, a retry only writes it", job_id, error, path)
    return LedgerWriteFailed(f"ledger write failed ({error}); the computed result is kept in {path}: "
                             "a retry only writes it (no re-evaluation)")


def _read_spool(s: WorkerSettings, job: JobPayload, job_id: str) -> dict[str, Any] | None:
    """The spooled result of exactly this job for this ledger, or None."""
    path = _spool_path(s, job_id)
    try:
        entry = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        log.warning("ignoring unreadable spool file %s: %s", path, e)
        return None
    ok = (isinstance(entry, dict) and entry.get("schema") == SPOOL_SCHEMA and entry.get("job_id") == job_id
          and entry.get("results_dir") == str(s.results_dir) and isinstance(entry.get("result"), dict)
          and (entry.get("job") or {}).get("checkpoint_digest") == job.checkpoint_digest)
    return entry if ok else None


def _drop_spool(s: WorkerSettings, job_id: str) -> None:
    try:
        _spool_path(s, job_id).unlink()
    except FileNotFoundError:
        pass
    except OSError as e:
        log.warning("could not remove spool file of %s: %s", job_id, e)


def _note(rq_job, **meta) -> None:
    """Record facts about the job in its RQ meta (shown by `status`); best effort."""
    if rq_job is None:
        return
    try:
        rq_job.meta.update(meta)
        rq_job.save_meta()
    except Exception as e:  # noqa: BLE001 - Redis hiccup: the job's own error still says it
        log.debug("could not save meta of %s: %s", rq_job.id, e)

