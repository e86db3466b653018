"""The eval worker: the RQ job function and a worker process that keeps the target loaded.

Job processing order (run_eval_job):
  validate payload -> checkpoint inside the roots, COMPLETE.json present, digests match ->
  evaluate (a cached Evaluator) -> write the ledger record (durable, first) -> result sinks
  (W&B; a sink failure is logged, never fails the job) -> return a small JSON summary.
A failure raises an exception whose message is the reason (shown by `status` and `rq info`).
A ledger write that fails (disk full, read-only results) keeps the computed result in the
worker's spool (`<spool_dir>/<job id>.json`) and fails the job with a retryable error that
says so; the retry (RQ's back-off, or `requeue --failed`) writes the spooled result
without evaluating again.

Why jobs run in the worker process (EvalWorker, a SimpleWorker with a heartbeat thread)
rather than in RQ's forked work-horse:
- the target may be tens of GB on a GPU. CUDA cannot be used in a child forked after the
  parent initialised it, so a model preloaded before fork is unusable on GPU, and loading
  it inside each work-horse would reload it per job;
- in-memory caches (tokenizer, reference/feature caches, compiled kernels) stay warm.
RQ's SimpleWorker sends no heartbeats while a job runs, so another worker's maintenance
would take a long job for abandoned; the heartbeat thread here renews the worker,
job and execution keys every `job_monitoring_interval` seconds, and the heartbeat TTL is
`interval + heartbeat_grace` (RQ hard-codes +60 s) so a crashed worker's job is
recovered quickly. Timeouts still work (SIGALRM death penalty in the main thread). A
crash of the process takes its job with it: StartedJobRegistry cleanup in a surviving
worker's maintenance then retries it (Retry), and the ledger keeps it recorded once.
SIGTERM: finish the current job, then exit (warm); with `stop_timeout`, or on a second
SIGTERM/SIGINT, the current job is put back at the front of its queue and the worker exits.
"""
from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import logging
import os
import signal
import socket
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Sequence

import redis
from rq.exceptions import DeserializationError
from rq.job import Job, JobStatus
from rq.scheduler import RQScheduler
from rq.utils import now
from rq.worker import SimpleWorker, WorkerStatus

from dflash_train import storage
from dflash_train.errors import DFlashError, retryable
from dflash_train.fsutil import atomic_write_bytes
from dflash_train.progress import format_duration
from dflash_train.publication import unpin_checkpoint
from dflash_train.settings import Settings

from eval_worker.service import jobs as jobs_mod
from eval_worker.results import sinks
from eval_worker.service.jobs import JobError
from eval_worker.engine.suite import HF_PREFIX, load_suite
from eval_worker.results.ledger import Ledger, tau_of
from eval_worker.engine.options import options_identity
from eval_worker.service.queue import JOB_FUNC, get_queue
from eval_worker.service.redis_local import server_unavailable

log = logging.getLogger("eval_worker.service.worker")

QUARANTINE_PREFIX = "dflash:quarantine:"  # job hashes a worker could not load, set aside
SPOOL_SCHEMA = "dflash-eval-spool/1"


class JobInterrupted(Exception):
    """Raised inside a running job when it is stopped (cancel) or handed back (shutdown)."""


class LedgerWriteFailed(DFlashError, OSError):
    """The evaluation finished but its ledger record could not be written."""

    retryable = True  # the retry only writes the spooled result


@dataclass
class WorkerSettings:
    """What a worker process needs besides Redis: the environment's settings (`env`), with the
    command line's choices applied (`from_settings`)."""

    results_dir: Path
    roots: Sequence[Path] | None
    cache_dir: Path | None = None
    target_roots: Sequence[Path] | None = None  # where a job's own `target` may lie (see jobs.check_target)
    suite_roots: Sequence[Path] | None = None   # where a job's suite file may lie (see jobs.check_suite)
    default_target: str | None = None
    device: str | None = None
    max_targets: int = 1
    evaluator_factory: str | None = None  # "module:callable(target, cache_dir=..., device=...)"
    spool_dir: Path | None = None  # computed results whose ledger write failed (default: next to the cache)
    env: Settings | None = None  # sinks and their Redis; None: read where the worker starts (a plain `rq worker`)
    checkpoint_cache_dir: Path | None = None  # local copies of checkpoints pulled from a store
    checkpoint_cache_gb: float = 20.0

    def __post_init__(self) -> None:
        if self.spool_dir is None:
            self.spool_dir = (self.cache_dir or self.results_dir).parent / "spool"
        if self.env is None:
            self.env = Settings.from_env()

    @classmethod
    def from_settings(cls, settings: Settings, **overrides) -> "WorkerSettings":
        """The worker's settings: `settings` (the environment), with `overrides` (flags given) applied."""
        values = dict(results_dir=settings.results_dir, roots=settings.checkpoint_roots,
                      target_roots=settings.target_roots, suite_roots=settings.suite_roots,
                      cache_dir=settings.cache_dir, default_target=settings.target, device=settings.device,
                      evaluator_factory=settings.evaluator_factory, spool_dir=settings.spool_dir, env=settings,
                      checkpoint_cache_dir=settings.checkpoint_cache_dir,
                      checkpoint_cache_gb=settings.checkpoint_cache_gb)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


# --------------------------------------------------------------------------- per-process state

_settings: WorkerSettings | None = None
_checkpoint_cache = None
_evaluators: "OrderedDict[str, Any]" = OrderedDict()
_loads: dict[str, int] = {}
_lock = threading.Lock()


def configure(settings: WorkerSettings) -> None:
    global _settings, _checkpoint_cache
    _settings, _checkpoint_cache = settings, None


def checkpoint_cache():
    """This process's cache of checkpoints pulled from object stores (dflash_train.checkpoint_cache)."""
    global _checkpoint_cache
    s = settings()
    if _checkpoint_cache is None:
        from dflash_train.checkpoint_cache import CheckpointCache

        root = s.checkpoint_cache_dir or s.env.checkpoint_cache_dir or Path(s.results_dir).parent / "checkpoint-cache"
        _checkpoint_cache = CheckpointCache(root, max_bytes=int(s.checkpoint_cache_gb * 2**30))
    return _checkpoint_cache


def settings() -> WorkerSettings:
    global _settings
    if _settings is None:  # a plain `rq worker` running our jobs: its process is the edge
        _settings = WorkerSettings.from_settings(Settings.from_env())
    return _settings


def target_loads(target: str | None = None) -> int:
    """How many times this process has loaded `target` (or any target)."""
    if target is None:
        return sum(_loads.values())
    return _loads.get(os.path.realpath(target), 0)


def _new_evaluator(target: str, s: WorkerSettings):
    if s.evaluator_factory:
        from importlib import import_module

        module, _, name = s.evaluator_factory.partition(":")
        factory = getattr(import_module(module), name)
    else:
        from eval_worker.engine.acceptance import Evaluator as factory
    kwargs: dict[str, Any] = {"cache_dir": str(s.cache_dir) if s.cache_dir else None}
    if s.device:
        kwargs["device"] = s.device
    return factory(target, **kwargs)


def get_evaluator(target: str):
    """The Evaluator for `target`, loaded once per process and kept (LRU of `max_targets`)."""
    s = settings()
    key = os.path.realpath(target)
    with _lock:
        ev = _evaluators.get(key)
        if ev is not None:
            _evaluators.move_to_end(key)
            return ev
        if not os.path.isdir(key):
            raise JobError(f"target {target} is not a directory on this worker")
        while len(_evaluators) >= max(1, s.max_targets):
            old, _ = _evaluators.popitem(last=False)
            log.info("unloading target %s to make room for %s", old, key)
            gc.collect()
            _empty_device_cache()
        t0 = time.monotonic()
        ev = _new_evaluator(key, s)
        _evaluators[key] = ev
        _loads[key] = _loads.get(key, 0) + 1
        log.info("loaded target %s in %.1fs (load #%d in pid %d)", key, time.monotonic() - t0, _loads[key], os.getpid())
        return ev


def _empty_device_cache() -> None:
    import torch  # loaded already (an evaluator was); not at import: `rq worker` imports this module

    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# --------------------------------------------------------------------------- the job

def _publish_to_sinks(record: dict[str, Any], job: dict[str, Any]) -> str | None:
    """Tell the result sinks (W&B). Returns their errors as text instead of raising."""
    try:
        outcome = sinks.publish_result(record, job, settings().env)
    except Exception as e:  # noqa: BLE001 - the ledger has the record; `publish` fills the gap later
        log.warning("result sink failed for %s (kept in the ledger; `dflash-eval publish` can retry): %s",
                    record.get("job_id"), e, exc_info=True)
        return f"{type(e).__name__}: {e}"
    bad = [f"{name}: {info.get('error')}" for name, info in outcome.items() if not info["ok"]]
    return "; ".join(bad) or None


def run_eval_job(payload: dict[str, Any]) -> dict[str, Any]:
    """RQ job function: evaluate one checkpoint and record the result once. JSON in, JSON out.

    An error that is not `retryable` (dflash_train.errors: a bad payload, a checkpoint outside
    the roots, no marker, a digest mismatch, a drafter that does not fit the target, an unknown
    option, ...) fails the job at once, without retries: trying again cannot fix it; once the
    cause is fixed, `dflash-eval requeue --failed` runs it again. Other errors (I/O, out of
    memory, a crashed worker) are retried with back-off.
    """
    from rq import get_current_job

    try:
        return _run(payload, get_current_job())
    except Exception as e:
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


def _run(payload: dict[str, Any], rq_job) -> dict[str, Any]:
    t0 = time.monotonic()
    job = jobs_mod.validate_job(payload)
    s = settings()
    if s.roots is None:
        raise JobError("this worker has no checkpoint roots configured: start it with --checkpoint-root DIR "
                       "or set $DFLASH_CHECKPOINT_ROOTS; refusing to read checkpoints from arbitrary paths")
    connection = rq_job.connection if rq_job is not None else None
    job_id = rq_job.id if rq_job is not None else _local_job_id(job)
    ledger = Ledger(s.results_dir, connection=connection)

    existing = ledger.find_job(job, job_id)
    sink_error, spooled = None, None
    if existing is not None:  # an earlier execution recorded it, then died: do not evaluate twice
        path, record = existing
        created = False
        ledger.index(record, path)
        _drop_spool(s, job_id)
        log.info("job %s already recorded at %s; not evaluating again", job_id, path)
    else:
        spooled = _read_spool(s, job, job_id)
        if spooled is not None:  # evaluated before, only the ledger write failed: write it now
            result, worker_info = spooled["result"], spooled["worker"]
            log.info("job %s: writing the result spooled at %s (not evaluating again)", job_id, _spool_path(s, job_id))
        else:
            result, worker_info = _evaluate(job, s, rq_job)
        try:
            path, record, created = ledger.write(job=job, job_id=job_id, result=result, worker=worker_info)
        except OSError as e:
            raise _spool(s, job, job_id, result, worker_info, e, rq_job) from e
        _drop_spool(s, job_id)
        if spooled is not None:
            _note(rq_job, spooled_result=None)
        if created:
            sink_error = _publish_to_sinks({**record, "path": str(path)}, job)
    unpin_checkpoint(job["checkpoint"], job_id)
    tau = tau_of(record)
    _log_outcome(job_id, job, record, path, time.monotonic() - t0, created)
    return {"job_id": job_id, "run_id": job["run_id"], "step": job["step"], "attempt": record.get("attempt"),
            "tau": tau, "ledger_path": str(path), "recorded_now": created, "sink_error": sink_error,
            "from_spool": existing is None and spooled is not None,
            "worker_pid": os.getpid(), "target_loads": target_loads(), "seconds": round(time.monotonic() - t0, 3)}


def _log_outcome(job_id: str, job: dict[str, Any], record: dict[str, Any], path, seconds: float,
                 created: bool) -> None:
    """One line per job in the worker's log: what was measured, how sure, how long it took."""
    result = record.get("result") or {}
    tau = result.get("tau") or {}
    ci = tau.get("ci95") or [None, None]
    base = result.get("baseline") or {}

    def f(x):
        return "?" if not isinstance(x, (int, float)) else f"{x:.3f}"
    extra = f", Δτ vs baseline {f(base.get('delta_tau'))}" if base else ""
    errors = [d.get("code") for d in result.get("diagnostics") or [] if d.get("severity") == "error"]
    log.info("job %s: run %s step %s suite %s: τ %s (95%% CI [%s, %s], %s verify steps%s)%s in %s; %s %s",
             job_id, job["run_id"], job["step"], (result.get("suite") or {}).get("name", job["suite"]),
             f(tau.get("macro")), f(ci[0]), f(ci[1]), tau.get("num_steps", "?"), extra,
             f"; diagnostics: {', '.join(errors)}" if errors else "", format_duration(seconds),
             "recorded at" if created else "already recorded at", path)


def _local_job_id(job: dict[str, Any]) -> str:
    """A job run outside RQ: an id from the request itself (suite spec, options, target), nothing read."""
    spec = json.dumps({"suite": job["suite"], "options": options_identity(job["options"]), "target": job["target"]},
                      sort_keys=True)
    return jobs_mod.job_id_for(job, "local-" + hashlib.sha256(spec.encode()).hexdigest()[:10])


def _evaluate(job: dict[str, Any], s: WorkerSettings, rq_job) -> tuple[dict[str, Any], dict[str, Any]]:
    """Check the job's files (checkpoint, target, suite: inside their roots), run the engine; (result, worker info)."""
    jobs_mod.check_checkpoint(job, s.roots)  # confined and marked: cheap, before anything is loaded or pulled
    target = job["target"] or s.default_target
    if not target:
        raise JobError("the job names no target and this worker has no default (--target / $DFLASH_TARGET)")
    if job["target"]:
        jobs_mod.check_target(target, s.default_target, s.target_roots, s.roots)
    suite = jobs_mod.check_suite(job["suite"], s.suite_roots, s.roots)
    if suite.startswith(HF_PREFIX):  # a standard benchmark, from this worker's dataset copies or cache
        suite = load_suite(suite, hf_datasets_dir=s.env.hf_datasets_dir)
    remote = any(storage.is_url(job.get(k)) for k in ("checkpoint", "baseline"))
    # the one hashing pass of the job: local files verified in place, a store's on download (cached by manifest)
    with jobs_mod.materialize(job, s.roots, checkpoint_cache() if remote else None) as (checkpoint, baseline, verified):
        evaluator = get_evaluator(target)
        result = evaluator.evaluate(checkpoint, suite, baseline=baseline, train_metrics=job["train_metrics"],
                                    options=job["options"], verified=verified).to_dict()
    # a result names what was asked for (the store URL), not the worker's cache entry
    if storage.is_url(job["checkpoint"]) and isinstance(result.get("checkpoint"), dict):
        result["checkpoint"] = {**result["checkpoint"], "path": job["checkpoint"]}
    if storage.is_url(job.get("baseline")) and isinstance(result.get("baseline"), dict):
        result["baseline"] = {**result["baseline"], "checkpoint": job["baseline"]}
    worker_info = {"host": socket.gethostname(), "pid": os.getpid(),
                   "name": s.env.worker_id or (rq_job.worker_name if rq_job else None)}
    return result, worker_info


# --------------------------------------------------------------------------- the spool

def _spool_path(s: WorkerSettings, job_id: str) -> Path:
    return Path(s.spool_dir) / f"{job_id}.json"


def _spool(s: WorkerSettings, job: dict[str, Any], job_id: str, result: dict[str, Any],
           worker_info: dict[str, Any], error: OSError, rq_job) -> LedgerWriteFailed:
    """Keep a computed result whose ledger write failed; the error to fail the job with."""
    path = _spool_path(s, job_id)
    entry = {"schema": SPOOL_SCHEMA, "job_id": job_id, "job": job, "results_dir": str(s.results_dir),
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


def _read_spool(s: WorkerSettings, job: dict[str, Any], job_id: str) -> dict[str, Any] | None:
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
          and (entry.get("job") or {}).get("checkpoint_digest") == job["checkpoint_digest"])
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


# --------------------------------------------------------------------------- the one job we run


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
        elif self.func_name != JOB_FUNC or self.instance is not None:
            reason = f"names the function {self.func_name!r}"
        elif len(self.args or ()) != 1 or self.kwargs:
            reason = "does not carry exactly one payload argument"
        if reason:
            self.retries_left = 0  # refused for good
            raise JobError(f"refusing job {self.id}: it {reason}; this worker only runs {JOB_FUNC}(payload)")
        return run_eval_job


@contextlib.contextmanager
def _ride_out(log, what: str):
    """Skip `what` when Redis is unavailable (redis_local.server_unavailable); other errors propagate."""
    try:
        yield
    except redis.exceptions.RedisError as e:
        if not server_unavailable(e):
            raise
        log.warning("%s skipped, Redis unavailable: %s", what, e)


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
        with _ride_out(self.log, f"Scheduler {self.name}: heartbeat"):  # like the worker: ride out an outage
            super().heartbeat()

    def enqueue_scheduled_jobs(self):
        with _ride_out(self.log, f"Scheduler {self.name}: moving scheduled jobs"):
            super().enqueue_scheduled_jobs()


# --------------------------------------------------------------------------- the worker

class EvalWorker(SimpleWorker):
    """SimpleWorker + heartbeat thread + in-process stop/requeue (see the module docstring)."""

    def __init__(self, *args, heartbeat_grace: int = 60, stop_timeout: float | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.heartbeat_grace = int(heartbeat_grace)
        self.stop_timeout = stop_timeout
        self._current = None            # the rq Job running in this process
        self._requeue_job_id = None     # job to hand back to the queue instead of failing it
        self._stop_timer: threading.Timer | None = None

    # ---- the scheduler -----------------------------------------------------------------
    def _start_scheduler(self, burst=False, logging_level="INFO", date_format=None, log_format=None):
        # RQ's Worker._start_scheduler with EvalScheduler in place of RQScheduler
        kwargs = {k: v for k, v in (("date_format", date_format), ("log_format", log_format)) if v is not None}
        self.scheduler = EvalScheduler(self.queues, connection=self.connection, serializer=self.serializer,
                                       logging_level=logging_level if logging_level is not None else self.log.level,
                                       **kwargs)
        self.scheduler.acquire_locks()
        if self.scheduler.acquired_locks:
            if burst:
                try:
                    self.scheduler.register_birth()
                    self.scheduler.enqueue_scheduled_jobs()
                finally:
                    self.scheduler.release_locks()
                    self.scheduler.register_death()
            else:
                self.scheduler.start()

    # ---- heartbeats ------------------------------------------------------------------
    def get_heartbeat_ttl(self, job, working_time: float = 0.0) -> int:
        if job.timeout and job.timeout > 0:
            remaining = max(job.timeout - working_time, 1)
            return int(min(remaining, self.job_monitoring_interval)) + self.heartbeat_grace
        return int(self.job_monitoring_interval) + self.heartbeat_grace

    def maintain_heartbeats(self, job, execution):
        # like RQ's, with our grace instead of its fixed +60 s for the worker key
        with self.connection.pipeline() as pipe:
            self.heartbeat(int(self.job_monitoring_interval) + self.heartbeat_grace, pipeline=pipe)
            working = (now() - job.started_at).total_seconds() if job.started_at else 0.0
            ttl = self.get_heartbeat_ttl(job, working_time=working)
            execution.heartbeat(job.started_job_registry, ttl, pipeline=pipe)
            job.heartbeat(now(), ttl, pipeline=pipe, xx=True)
            pipe.execute()

    @property
    def dequeue_timeout(self) -> int:
        # wake up for maintenance (abandoned-job recovery) even when idle
        return max(1, min(self.worker_ttl - 15, int(self.maintenance_interval)))

    def _beat(self, job, execution, stop: threading.Event) -> None:
        while not stop.wait(self.job_monitoring_interval):
            try:
                self.maintain_heartbeats(job, execution)
            except Exception as e:  # noqa: BLE001 - Redis hiccup: try again next interval
                self.log.warning("Worker %s: heartbeat for %s failed: %s", self.name, job.id, e)

    def execute_job(self, job, queue):
        execution = None
        try:
            execution = self.prepare_execution(job)
            stop = threading.Event()
            beat = threading.Thread(target=self._beat, args=(job, execution, stop), name="rq-heartbeat", daemon=True)
            self._current = job
            old = signal.signal(signal.SIGUSR1, self._interrupt_handler)
            beat.start()
            try:
                self.perform_job(job, queue, execution)
            finally:
                self._current = None
                stop.set()
                beat.join()
                signal.signal(signal.SIGUSR1, old)
                if self._stop_timer is not None:
                    self._stop_timer.cancel()
                    self._stop_timer = None
            self.set_state(WorkerStatus.IDLE)
        except redis.exceptions.RedisError as e:
            if not server_unavailable(e):
                raise
            self._after_redis_outage(job, queue, execution, e)

    # ---- unreadable jobs -----------------------------------------------------------------
    def dequeue_job_and_maintain_ttl(self, timeout, max_idle_time=None):
        # RQ's work loop quits when a dequeued job hash cannot even be loaded (a bad status or
        # date field): set such a job aside under dflash:quarantine:<id> and take the next one.
        # Likewise a server that is there but refuses writes (out of memory, MISCONF, BUSY: RQ
        # retries only unreachable ones): wait until it takes writes again.
        while True:
            try:
                return super().dequeue_job_and_maintain_ttl(timeout, max_idle_time)
            except Exception as e:  # noqa: BLE001 - re-raised unless it is one dequeued job's fault
                if isinstance(e, redis.exceptions.RedisError) and server_unavailable(e):
                    self.log.warning("Worker %s: Redis refuses writes (%s); waiting", self.name, e)
                    if not self._wait_for_redis():
                        raise
                    continue
                job_id = getattr(e, "job_id", None)
                if job_id is None:
                    raise
                self._quarantine(job_id, f"{type(e).__name__}: {e}")

    def _quarantine(self, job_id: str, reason: str) -> None:
        key, dest = self.job_class.key_for(job_id), QUARANTINE_PREFIX + job_id
        try:
            with self.connection.pipeline() as pipe:
                pipe.hset(key, "dflash_quarantined", reason)
                pipe.rename(key, dest)
                pipe.execute()
        except redis.exceptions.ResponseError:
            pass  # the hash is gone already
        self.log.error("Worker %s: job %s is unreadable (%s); set aside as %s, not run", self.name, job_id,
                       reason, dest)

    # ---- Redis outages -------------------------------------------------------------------
    # RQ's work loop quits on any Redis error outside its dequeue call. An eval worker keeps
    # an expensive target loaded, so it rides the outage out instead: the bookkeeping calls
    # below skip a beat, and a job caught by the outage is put back once Redis answers (its
    # result, if already recorded, stays in the ledger and is not evaluated again). An outage
    # is anything `redis_local.server_unavailable` names: unreachable, or there but refusing
    # writes (out of memory at maxmemory, MISCONF, BUSY, LOADING, a read-only replica).
    def _wait_for_redis(self) -> bool:
        delay, last_log = 0.5, 0.0
        while not self._stop_requested:
            try:  # a write, not a PING: a server out of memory or unable to persist answers PING
                self.connection.set(f"dflash:probe:{self.name}", 1, ex=60)
                return True
            except redis.exceptions.RedisError as e:
                if not server_unavailable(e):
                    raise
                if time.monotonic() - last_log > 30:
                    self.log.warning("Worker %s: Redis unavailable (%s); waiting for it", self.name, e)
                    last_log = time.monotonic()
            time.sleep(delay)
            delay = min(delay * 2, 5.0)  # try every 5 s at most: back soon after Redis returns
        return False

    def _after_redis_outage(self, job, queue, execution, error) -> None:
        self.log.warning("Worker %s: Redis unreachable while running job %s (%s)", self.name, job.id, error)
        if not self._wait_for_redis():
            return  # stopping: the job's heartbeat lapses and another worker's maintenance retries it
        try:
            job.refresh()
            state = job.get_status(refresh=False)
            ours = state == JobStatus.STARTED and job.worker_name in (None, self.name)
            popped = state == JobStatus.QUEUED and self.connection.lpos(queue.key, job.id) is None
            if ours or popped:
                with self.connection.pipeline() as pipe:
                    self.cleanup_execution(job, pipeline=pipe, execution=execution)
                    job.set_status(JobStatus.QUEUED, pipeline=pipe)
                    queue._enqueue_job(job, pipeline=pipe, at_front=True)
                    pipe.execute()
                self.log.warning("Worker %s: Redis is back; job %s put back at the front of %s",
                                 self.name, job.id, queue.name)
            else:
                self.log.info("Worker %s: Redis is back; job %s is %s, left as it is", self.name, job.id,
                              state.value if state else "gone")
            self.set_state(WorkerStatus.IDLE)
        except redis.exceptions.RedisError as e:
            if not server_unavailable(e):
                raise
            # down again: the heartbeat-lapse recovery covers the job
            self.log.warning("Worker %s: Redis lost again while handing back %s: %s", self.name, job.id, e)
        except Exception as e:  # noqa: BLE001 - the job hash is gone (Redis lost its data): nothing to hand back
            self.log.warning("Worker %s: could not hand back job %s after the outage: %s", self.name, job.id, e)

    def heartbeat(self, timeout=None, pipeline=None):
        if pipeline is not None:
            return super().heartbeat(timeout, pipeline=pipeline)
        with _ride_out(self.log, f"Worker {self.name}: heartbeat"):
            super().heartbeat(timeout)

    def set_state(self, state, pipeline=None):
        if pipeline is not None:
            return super().set_state(state, pipeline=pipeline)
        self._state = state  # kept here even when Redis cannot hear of it
        with _ride_out(self.log, f"Worker {self.name}: saving state {state}"):
            super().set_state(state)

    def check_for_suspension(self, burst: bool):
        with _ride_out(self.log, f"Worker {self.name}: suspension check"):
            super().check_for_suspension(burst)

    def run_maintenance_tasks(self):
        with _ride_out(self.log, f"Worker {self.name}: maintenance"):
            super().run_maintenance_tasks()

    # ---- stopping ----------------------------------------------------------------------
    def _interrupt_handler(self, signum, frame):
        if self._current is not None:
            reason = ("handed back to the queue (worker shutting down)" if self._requeue_job_id == self._current.id
                      else "stopped by user (dflash-eval cancel)")
            raise JobInterrupted(f"job {self._current.id} {reason}")

    def _interrupt_main(self) -> None:
        signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR1)

    def kill_horse(self, sig=None):
        """`stop-job` command (from the pubsub thread): interrupt the in-process job."""
        if self._current is not None:
            self.log.info("Worker %s: stopping job %s on request", self.name, self._current.id)
            self._interrupt_main()

    def request_stop(self, signum, frame):
        super().request_stop(signum, frame)  # warm: finish the job (raises StopRequested when idle)
        if self._current is not None and self.stop_timeout is not None:
            self._stop_timer = threading.Timer(self.stop_timeout, self._hand_back_current)
            self._stop_timer.daemon = True
            self._stop_timer.start()
            self.log.info("Worker %s: job %s has %.0fs to finish before it is handed back",
                          self.name, self._current.id, self.stop_timeout)

    def _hand_back_current(self) -> None:
        job = self._current
        if job is not None:
            self._requeue_job_id = job.id
            self._interrupt_main()

    def request_force_stop(self, signum, frame):
        if self._shutdown_requested_date and (now() - self._shutdown_requested_date) < timedelta(seconds=1):
            return
        if self._current is not None:
            self._requeue_job_id = self._current.id
            self._stop_requested = True
            raise JobInterrupted(f"job {self._current.id} handed back to the queue (worker cold shutdown)")
        raise SystemExit()

    def handle_job_failure(self, job, queue, started_job_registry=None, exc_string="", execution=None):
        if self._requeue_job_id is not None and self._requeue_job_id == job.id:
            self._requeue_job_id = None
            with self.connection.pipeline() as pipe:
                self.cleanup_execution(job, pipeline=pipe, execution=execution)
                job.set_status(JobStatus.QUEUED, pipeline=pipe)
                queue._enqueue_job(job, pipeline=pipe, at_front=True)
                pipe.execute()
            self.log.warning("Worker %s: job %s put back at the front of %s", self.name, job.id, queue.name)
            return
        super().handle_job_failure(job, queue, started_job_registry=started_job_registry,
                                   exc_string=exc_string, execution=execution)


def worker_name() -> str:
    return f"dflash-{socket.gethostname().split('.')[0]}-{os.getpid()}"


def serve(connection, queue_names: list[str], settings_: WorkerSettings, *, burst: bool = False,
          preload: bool = True, name: str | None = None, maintenance_interval: int = 60,
          job_monitoring_interval: int = 10, heartbeat_grace: int = 60, worker_ttl: int = 420,
          stop_timeout: float | None = None, with_scheduler: bool = True, max_jobs: int | None = None,
          logging_level: str = "INFO") -> bool:
    """Run a worker until stopped (or, with `burst`, until the queues are empty)."""
    from rq.serializers import JSONSerializer

    configure(settings_)
    if preload and settings_.default_target:
        get_evaluator(settings_.default_target)  # before serving: the first job finds it warm
    worker = EvalWorker([get_queue(connection, n) for n in queue_names], connection=connection,
                        serializer=JSONSerializer, job_class=EvalJob, name=name or worker_name(),
                        maintenance_interval=maintenance_interval, job_monitoring_interval=job_monitoring_interval,
                        worker_ttl=worker_ttl, heartbeat_grace=heartbeat_grace, stop_timeout=stop_timeout)
    return worker.work(burst=burst, with_scheduler=with_scheduler, logging_level=logging_level, max_jobs=max_jobs)
