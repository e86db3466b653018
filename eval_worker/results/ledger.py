"""The results ledger: one durable JSON record per evaluation attempt.

Layout (docs/design.md)::

    <results_dir>/<run_id>/step-<step:08d>/<key>/attempt-<n>.json
    <results_dir>/<run_id>/step-<step:08d>/<key>/latest.json   (pointer to the newest attempt)

`key` (:func:`record_key`) is the identity of the evaluation: everything that changes the
numbers in it — the checkpoint digest, the suite's fingerprint, the target's identity and
the options that change a result (eval_worker.engine.options). Two checkpoints published at the
same (run, step), or one checkpoint evaluated with other options, get separate directories:
both are recorded, both are shown.

A record is written before anything else hears of the result (sinks, RQ's own result),
atomically (temporary file, fsync, then a hard link that fails if the name exists), so a
record is never half-written and never replaced. A writer that finds the attempt already
recorded gets it back only when it is *its own job's* record (an execution that died after
writing, run again); a record of another job is never claimed: the writer records its
result as the next attempt next to it. The Redis index (``dflash:ledger:<run>``) is a cache
for ``status`` and dedupe; :meth:`Ledger.reindex` rebuilds it from the files.

Record envelope (``dflash-eval-record/1``)::

    {"schema": "dflash-eval-record/1", "run_id", "step", "suite", "suite_fingerprint", "key",
     "attempt", "job_id", "checkpoint_digest", "recorded_at", "job": {...job payload...},
     "worker": {"name", "host", "pid"}, "result": {...EvalResult.to_dict()...}}

Files are 0644 and directories 0755 whatever the umask: the ledger is read by `publish`,
`report` and `status`, which may run as another user than the worker (docs/reliability.md).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import socket
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

from dflash_train.checkpoints.publication import checkpoint_step, step_dir_name, valid_run_id
from dflash_train.common.errors import DFlashError
from dflash_train.common.fsutil import fsync_dir
from eval_worker.engine.options import OptionsError, options_identity
from eval_worker.results.attempts import strip_attempt
from eval_worker.results.series import options_label, options_of, target_identity, target_label

RECORD_SCHEMA = "dflash-eval-record/1"
# Redis keys of this module: the index is a cache of the files (`Ledger.reindex` rebuilds it)
INDEX_PREFIX = "dflash:ledger:"    # hash per run: "<step>:<record key>" -> summary of its newest attempt
RUNS_KEY = "dflash:ledger-runs"    # set of the runs with records
DONE_KEY = "dflash:ledger-jobs"    # hash: base job id -> summary of its newest recorded attempt
# set per (run, step): digests of the checkpoints queued or recorded there. The queue asks it on every
# enqueue ("another checkpoint at this step?"); a scan of the run's hashes was O(run's jobs) per enqueue.
STEP_CKPTS_PREFIX = "dflash:step-ckpts:"  # "<run>:<step>" -> {digest, ...}
STEP_CKPTS_DONE = "dflash:step-ckpts-migrated"  # runs whose older entries have been copied into the sets
_ATTEMPT_RE = re.compile(r"^attempt-(\d+)\.json$")
FILE_MODE, DIR_MODE = 0o644, 0o755  # shared results: readable by the report/publish user, written by the worker


class RecordedJob(Protocol):
    """What the ledger reads of a job: the service's validated job (`JobPayload`), read by attribute;
    `to_json()` is what a record keeps under "job"."""

    @property
    def run_id(self) -> str: ...
    @property
    def step(self) -> int: ...
    @property
    def attempt(self) -> int: ...
    @property
    def suite(self) -> str: ...
    @property
    def checkpoint_digest(self) -> str: ...
    @property
    def target(self) -> str | None: ...
    @property
    def baseline(self) -> str | None: ...
    @property
    def options(self) -> dict[str, Any] | None: ...

    def to_json(self) -> dict[str, Any]: ...


class LedgerError(DFlashError, RuntimeError):
    """A ledger record that cannot be written or read; the message says why."""

    retryable = True  # kept as it was: a results directory can be fixed under a waiting retry


def _utcnow() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")


def _check_name(kind: str, value: str) -> str:
    if not valid_run_id(value):  # the run-id rule; record keys (16 hex) follow it too
        raise LedgerError(f"{kind} {value!r} cannot name a ledger directory")
    return value


def _key_of(record: dict[str, Any], path: Path | str) -> str:
    """A record's key (records written before keys existed: their directory's name)."""
    return record.get("key") or Path(path).parent.name


def tau_of(record: dict[str, Any]) -> float | None:
    """The record's headline τ (macro mean accept length), or None."""
    tau = (record.get("result") or {}).get("tau") or {}
    value = tau.get("macro")
    return float(value) if isinstance(value, (int, float)) else None


def record_key(job: RecordedJob, result: dict[str, Any]) -> str:
    """The identity of an evaluation (16 hex): checkpoint digest, suite fingerprint, target, options, baseline.

    The suite fingerprint is the result's (after `num_prompts`); the target is the one the
    result was computed against (its fingerprint, else its path); the options are those that
    change a recorded number and differ from their default (EvalOptions.identity).
    """
    suite_fp = (result.get("suite") or {}).get("fingerprint")
    if not suite_fp:
        raise LedgerError("result has no suite.fingerprint; cannot place it in the ledger")
    digest = job.checkpoint_digest
    result_digest = (result.get("checkpoint") or {}).get("digest")
    if result_digest and digest and result_digest != digest:
        raise LedgerError(f"the result is of checkpoint {str(result_digest)[:12]}..., the job names "
                          f"{str(digest)[:12]}...: the checkpoint changed during the evaluation")
    target = result.get("target") or {}
    try:
        options = options_identity(job.options)
    except OptionsError as e:
        raise LedgerError(str(e)) from None
    spec = {"checkpoint": digest or result_digest, "suite": suite_fp, "options": options,
            "target": target.get("fingerprint") or target.get("path") or job.target}
    if job.baseline:  # Δτ against it is part of the result; keys without one are unchanged
        spec["baseline"] = job.baseline
    return hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]


def same_job(record: dict[str, Any], job: RecordedJob, job_id: str) -> bool:
    """Whether `record` is the result of this very job: its id, and the request behind the id
    (checkpoint digest, suite, target, result-changing options; a reused id is not enough)."""
    if record.get("job_id") != job_id:
        return False
    theirs = record.get("job") or {}
    try:
        return (theirs.get("checkpoint_digest") == job.checkpoint_digest
                and theirs.get("suite") == job.suite and theirs.get("target") == job.target
                and options_identity(theirs.get("options")) == options_identity(job.options))
    except OptionsError:
        return False


def series_keys(summaries: list[dict[str, Any]]) -> list[str]:
    """What tells each summary's number apart, for views that tally by it (`status`): the suite; then the
    options that change τ when not the defaults; then the target when its run measured more than one
    (by fingerprint: two files under one path are two). The common case is the suite alone."""
    targets: dict[str, set[str]] = {}
    for s in summaries:
        targets.setdefault(s["run_id"], set()).add(str(s.get("target_fingerprint") or ""))
    out = []
    for s in summaries:
        key = str(s.get("suite"))
        if s.get("options"):
            key += f" [{s['options']}]"
        if len(targets[s["run_id"]]) > 1:
            key += f" [target {s.get('target') or '?'}]"
        out.append(key)
    return out


def _mkdirs(path: Path) -> None:
    """`mkdir -p` with DIR_MODE on every directory created (the umask does not narrow it)."""
    missing = []
    p = path
    while not p.is_dir():
        missing.append(p)
        p = p.parent
    for d in reversed(missing):
        try:
            d.mkdir(mode=DIR_MODE)
        except FileExistsError:
            continue
        os.chmod(d, DIR_MODE)


@dataclass(frozen=True)
class LedgerEntry:
    """Where a record lives, and its key (the record directory's name, see `record_key`)."""

    run_id: str
    step: int
    key: str
    attempt: int
    path: Path

    def read(self) -> dict[str, Any]:
        return read_record(self.path)


def read_record(path: str | os.PathLike) -> dict[str, Any]:
    path = Path(path)
    try:
        record = json.loads(path.read_text())
    except FileNotFoundError:
        raise LedgerError(f"ledger record {path} does not exist") from None
    except (OSError, json.JSONDecodeError) as e:
        raise LedgerError(f"ledger record {path} is unreadable: {e}") from None
    if not isinstance(record, dict) or record.get("schema") != RECORD_SCHEMA:
        raise LedgerError(f"{path} is not a {RECORD_SCHEMA} record")
    return record


def _write_tmp(directory: Path, data: bytes) -> str:
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".json", dir=directory)
    try:
        os.fchmod(fd, FILE_MODE)  # mkstemp makes 0600; a record is shared (see the module docstring)
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return tmp


def note_step_checkpoint(pipe, run_id: str, step: int, digest: str) -> None:
    """Remember (in `pipe`) that checkpoint `digest` was queued or recorded at (run, step)."""
    pipe.sadd(f"{STEP_CKPTS_PREFIX}{run_id}:{int(step)}", digest)


def step_checkpoints(connection, run_id: str, step: int, legacy_hashes: tuple[str, ...] = ()) -> set[str]:
    """Digests of every checkpoint queued or recorded at (run, step), one SMEMBERS.

    Entries written before these sets existed are copied in once per run, from the hashes in
    `legacy_hashes` (the ledger index and the queue's per-run job hash), on the first call."""
    if legacy_hashes and not connection.sismember(STEP_CKPTS_DONE, run_id):
        with connection.pipeline() as pipe:
            for key in legacy_hashes:
                for field, raw in connection.hscan_iter(key):
                    with contextlib.suppress(ValueError, KeyError, TypeError, AttributeError):
                        entry = json.loads(raw)
                        digest = entry.get("checkpoint_digest") or entry["job"]["checkpoint_digest"]
                        step_of = int((field.decode() if isinstance(field, bytes) else field).split(":", 1)[0])
                        note_step_checkpoint(pipe, run_id, step_of, digest)
            pipe.sadd(STEP_CKPTS_DONE, run_id)
            pipe.execute()
    members = connection.smembers(f"{STEP_CKPTS_PREFIX}{run_id}:{int(step)}")
    return {m.decode() if isinstance(m, bytes) else m for m in members}


class Ledger:
    """Read and write records under `root` (`Settings.results_dir` by default, chosen by the
    caller); optionally index them in Redis (`connection`). Without a root only the index is
    available (the queue's dedupe and `status`)."""

    def __init__(self, root: str | os.PathLike | None = None, connection=None):
        self._root = Path(root).expanduser() if root is not None else None
        self.connection = connection

    @property
    def root(self) -> Path:
        if self._root is None:
            raise LedgerError("no results directory given: this ledger only reads the Redis index")
        return self._root

    # ---- paths ---------------------------------------------------------------------
    def step_dir(self, run_id: str, step: int) -> Path:
        return self.root / _check_name("run_id", run_id) / step_dir_name(step)

    def record_dir(self, run_id: str, step: int, key: str) -> Path:
        return self.step_dir(run_id, step) / _check_name("record key", key)

    def record_path(self, run_id: str, step: int, key: str, attempt: int) -> Path:
        return self.record_dir(run_id, step, key) / f"attempt-{int(attempt)}.json"

    @staticmethod
    def root_of(record_path: str | os.PathLike) -> Path:
        """The results root a record file lies under (the inverse of `record_path`)."""
        return Path(record_path).resolve().parents[3]

    # ---- writing -------------------------------------------------------------------
    def write(self, *, job: RecordedJob, job_id: str, result: dict[str, Any],
              worker: dict[str, Any] | None = None,
              queue: dict[str, Any] | None = None) -> tuple[Path, dict[str, Any], bool]:
        """Record `result` of `job`; return (path, record, created).

        `created` is False when this job's attempt was already recorded by an earlier
        execution of the same job (that record wins and is returned unchanged), which makes
        re-running an abandoned job harmless. A record of *another* job under the same
        key and attempt is left alone: this one becomes the next attempt.
        """
        suite_fp = (result.get("suite") or {}).get("fingerprint")
        key = record_key(job, result)
        run_id, step, attempt = job.run_id, job.step, job.attempt
        record_dir = self.record_dir(run_id, step, key)
        record = {
            "schema": RECORD_SCHEMA, "run_id": run_id, "step": step, "suite": job.suite,
            "suite_fingerprint": suite_fp, "key": key, "attempt": attempt, "job_id": job_id,
            "checkpoint_digest": job.checkpoint_digest, "recorded_at": _utcnow(), "job": job.to_json(),
            "worker": worker or {"host": socket.gethostname(), "pid": os.getpid()}, "result": result,
        }
        if queue:  # the queue's view when it was recorded (eval lag: service/queueing/routing.py)
            record["queue"] = queue
        _mkdirs(record_dir)
        while True:
            path = record_dir / f"attempt-{attempt}.json"
            record["attempt"] = attempt
            data = (json.dumps(record, indent=1, sort_keys=True, allow_nan=False) + "\n").encode()
            tmp = _write_tmp(record_dir, data)
            try:
                os.link(tmp, path)  # atomic, and refuses to replace an existing record
                created = True
            except FileExistsError:
                created = False
            finally:
                os.unlink(tmp)
            if created:
                break
            own = self._record_of(record_dir, job, job_id)
            if own is not None:  # an earlier execution of this very job recorded it
                path, record = own
                break
            # another job's record (or an unreadable file): never claimed, never replaced
            attempt = max(self._attempts(record_dir) + [attempt]) + 1
        fsync_dir(record_dir)
        self._update_latest(record_dir)
        self.index(record, path)
        return path, record, created

    @staticmethod
    def _attempts(record_dir: Path) -> list[int]:
        return [int(m.group(1)) for p in record_dir.iterdir() if (m := _ATTEMPT_RE.match(p.name))]

    def _record_of(self, record_dir: Path, job: RecordedJob, job_id: str) -> tuple[Path, dict[str, Any]] | None:
        for n in sorted(self._attempts(record_dir)):
            path = record_dir / f"attempt-{n}.json"
            with contextlib.suppress(LedgerError):
                record = read_record(path)
                if same_job(record, job, job_id):
                    return path, record
        return None

    def _update_latest(self, record_dir: Path) -> None:
        """Point latest.json at the highest attempt present (atomic replace; idempotent)."""
        attempts = sorted((int(m.group(1)), p.name) for p in record_dir.iterdir()
                          if (m := _ATTEMPT_RE.match(p.name)))
        if not attempts:
            return
        n, name = attempts[-1]
        data = json.dumps({"attempt": n, "path": name, "updated_at": _utcnow()}, sort_keys=True).encode()
        tmp = _write_tmp(record_dir, data)
        os.replace(tmp, record_dir / "latest.json")

    # ---- Redis index ---------------------------------------------------------------
    @staticmethod
    def summary(record: dict[str, Any], path: Path | str) -> dict[str, Any]:
        result = record.get("result") or {}
        tau = result.get("tau") or {}
        return {"run_id": record["run_id"], "step": record["step"], "suite": record.get("suite"),
                "suite_fingerprint": record["suite_fingerprint"], "key": _key_of(record, path),
                "attempt": record["attempt"],
                "job_id": record.get("job_id"), "checkpoint_digest": record.get("checkpoint_digest"),
                "tau": tau.get("macro"), "tau_ci95": tau.get("ci95"), "recorded_at": record.get("recorded_at"),
                "path": str(path), "target": target_label(result), "target_fingerprint": target_identity(result),
                "options": options_label(options_of(record))}

    def index(self, record: dict[str, Any], path: Path | str) -> None:
        """Add a record to the Redis index (newest attempt per step and record key wins)."""
        if self.connection is None:
            return
        key = INDEX_PREFIX + record["run_id"]
        field = f"{int(record['step'])}:{_key_of(record, path)}"
        summary = self.summary(record, path)
        current = self.connection.hget(key, field)
        if current is not None:
            with contextlib.suppress(ValueError, KeyError, TypeError):
                if int(json.loads(current)["attempt"]) > int(summary["attempt"]):
                    return
        with self.connection.pipeline() as pipe:
            pipe.hset(key, field, json.dumps(summary, sort_keys=True))
            if record.get("job_id"):
                pipe.hset(DONE_KEY, strip_attempt(record["job_id"]), json.dumps(summary, sort_keys=True))
            pipe.sadd(RUNS_KEY, record["run_id"])
            if record.get("checkpoint_digest"):
                note_step_checkpoint(pipe, record["run_id"], record["step"], record["checkpoint_digest"])
            pipe.execute()

    def indexed(self, run_id: str | None = None) -> list[dict[str, Any]]:
        """Summaries from the Redis index (all runs, or one), sorted by run and step."""
        if self.connection is None:
            raise LedgerError("no Redis connection: use records() to read the files")
        runs = [run_id] if run_id else sorted(x.decode() if isinstance(x, bytes) else x
                                              for x in self.connection.smembers(RUNS_KEY))
        out = []
        for run in runs:
            for raw in self.connection.hvals(INDEX_PREFIX + run):
                with contextlib.suppress(ValueError):
                    out.append(json.loads(raw))
        return sorted(out, key=lambda s: (s["run_id"], s["step"], s.get("key") or s["suite_fingerprint"]))

    def lookup(self, run_id: str, step: int, key: str) -> dict[str, Any] | None:
        """The indexed summary for (run, step, record key), or None."""
        if self.connection is None:
            return None
        raw = self.connection.hget(INDEX_PREFIX + run_id, f"{int(step)}:{key}")
        return json.loads(raw) if raw is not None else None

    def at_step(self, run_id: str, step: int) -> list[dict[str, Any]]:
        """Indexed summaries of every evaluation recorded at (run, step) (any checkpoint, suite, options)."""
        if self.connection is None:
            return []
        out = []
        for _, raw in self.connection.hscan_iter(INDEX_PREFIX + run_id, match=f"{int(step)}:*"):
            with contextlib.suppress(ValueError):
                out.append(json.loads(raw))
        return out

    def lookup_job(self, base_job_id: str) -> dict[str, Any] | None:
        """The indexed summary of the newest recorded attempt of a job (by base id), or None."""
        if self.connection is None:
            return None
        raw = self.connection.hget(DONE_KEY, base_job_id)
        return json.loads(raw) if raw is not None else None

    def reindex(self) -> int:
        """Rebuild the Redis index from the files; return the number of records indexed."""
        n = 0
        for entry in self.entries(all_attempts=True):
            with contextlib.suppress(LedgerError):
                self.index(entry.read(), entry.path)
                n += 1
        return n

    # ---- reading -------------------------------------------------------------------
    def runs(self) -> list[str]:
        if not self.root.is_dir():
            return []
        return sorted(p.name for p in self.root.iterdir() if p.is_dir() and valid_run_id(p.name))

    def entries(self, run_id: str | None = None, *, key: str | None = None,
                all_attempts: bool = False) -> list[LedgerEntry]:
        """Records on disk, sorted by (run, step, key, attempt); newest attempt only by default."""
        out: list[LedgerEntry] = []
        for run in ([run_id] if run_id else self.runs()):
            run_dir = self.root / _check_name("run_id", run)
            if not run_dir.is_dir():
                continue
            for step_dir in run_dir.iterdir():
                step = checkpoint_step(step_dir)
                if step is None or not step_dir.is_dir():
                    continue
                for suite_dir in step_dir.iterdir():
                    if not suite_dir.is_dir() or (key and suite_dir.name != key):
                        continue
                    attempts = sorted(int(a.group(1)) for p in suite_dir.iterdir()
                                      if (a := _ATTEMPT_RE.match(p.name)))
                    for n in (attempts if all_attempts else attempts[-1:]):
                        out.append(LedgerEntry(run, step, suite_dir.name, n,
                                               suite_dir / f"attempt-{n}.json"))
        return sorted(out, key=lambda e: (e.run_id, e.step, e.key, e.attempt))

    def records(self, run_id: str | None = None, **kw) -> Iterator[dict[str, Any]]:
        """The records themselves (see :meth:`entries` for the filters)."""
        for entry in self.entries(run_id, **kw):
            yield entry.read()

    def find_job(self, job: RecordedJob, job_id: str) -> tuple[Path, dict[str, Any]] | None:
        """An existing record of exactly this job (see `same_job`), or None."""
        step_dir = self.step_dir(job.run_id, job.step)
        if not step_dir.is_dir():
            return None
        for path in sorted(step_dir.glob("*/attempt-*.json")):
            with contextlib.suppress(LedgerError):
                record = read_record(path)
                if same_job(record, job, job_id):
                    return path, record
        return None

    def latest(self, run_id: str, key: str | None = None) -> dict[str, Any] | None:
        """The record of the highest step of a run (newest attempt)."""
        entries = self.entries(run_id, key=key)
        return max(entries, key=lambda e: (e.step, e.attempt)).read() if entries else None

    def best(self, run_id: str, key: str | None = None) -> dict[str, Any] | None:
        """The record with the highest τ in a run (ties: the earliest step)."""
        best, best_key = None, None
        for record in self.records(run_id, key=key):
            tau = tau_of(record)
            if tau is None:
                continue
            rank = (tau, -record["step"])
            if best_key is None or rank > best_key:
                best, best_key = record, rank
        return best
