"""The results ledger: one durable JSON record per (run, step, suite, attempt).

Layout (docs/design.md)::

    <results_dir>/<run_id>/step-<step:08d>/<suitefp>/attempt-<n>.json
    <results_dir>/<run_id>/step-<step:08d>/<suitefp>/latest.json   (pointer to the newest attempt)

A record is written before anything else hears of the result (sinks, RQ's own result),
atomically (temporary file, fsync, then a hard link that fails if the name exists), so a
record is never half-written and never written twice: a second writer for the same
attempt gets the first writer's record back. The Redis index (``dflash:ledger:<run>``)
is a cache for ``status`` and dedupe; :meth:`Ledger.reindex` rebuilds it from the files.

Record envelope (``dflash-eval-record/1``)::

    {"schema": "dflash-eval-record/1", "run_id", "step", "suite", "suite_fingerprint",
     "attempt", "job_id", "checkpoint_digest", "recorded_at", "job": {...job payload...},
     "worker": {"name", "host", "pid"}, "result": {...EvalResult.to_dict()...}}
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import tempfile
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator

from dflash_train.fsutil import fsync_dir

RECORD_SCHEMA = "dflash-eval-record/1"
RESULTS_ENV = "DFLASH_RESULTS_DIR"
INDEX_PREFIX = "dflash:ledger:"
RUNS_KEY = "dflash:ledger-runs"
DONE_KEY = "dflash:ledger-jobs"   # base job id -> summary of its newest recorded attempt
_ATTEMPT_RE = re.compile(r"^attempt-(\d+)\.json$")
_STEP_RE = re.compile(r"^step-(\d+)$")
_SAFE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class LedgerError(RuntimeError):
    """A ledger record that cannot be written or read; the message says why."""


def default_results_dir() -> Path:
    """`$DFLASH_RESULTS_DIR`, else `$DFLASH_HOME/results`, else `~/.cache/dflash-eval/results`."""
    env = os.environ.get(RESULTS_ENV)
    if env:
        return Path(env).expanduser()
    home = os.environ.get("DFLASH_HOME")
    if home:
        return Path(home).expanduser() / "results"
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(cache) / "dflash-eval" / "results"


def _utcnow() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def _check_name(kind: str, value: str) -> str:
    if not isinstance(value, str) or not _SAFE_RE.match(value) or ".." in value:
        raise LedgerError(f"{kind} {value!r} cannot name a ledger directory")
    return value


def _base_id(job_id: str) -> str:
    return re.sub(r"-r\d+$", "", job_id)


def tau_of(record: dict[str, Any]) -> float | None:
    """The record's headline τ (macro mean accept length), or None."""
    tau = (record.get("result") or {}).get("tau") or {}
    value = tau.get("macro")
    return float(value) if isinstance(value, (int, float)) else None


@dataclass(frozen=True)
class LedgerEntry:
    """Where a record lives, and its key."""

    run_id: str
    step: int
    suite_fingerprint: str
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
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return tmp


class Ledger:
    """Read and write records under `root`; optionally index them in Redis (`connection`)."""

    def __init__(self, root: str | os.PathLike | None = None, connection=None):
        self.root = Path(root).expanduser() if root is not None else default_results_dir()
        self.connection = connection

    # ---- paths ---------------------------------------------------------------------
    def step_dir(self, run_id: str, step: int) -> Path:
        return self.root / _check_name("run_id", run_id) / f"step-{int(step):08d}"

    def record_dir(self, run_id: str, step: int, suite_fp: str) -> Path:
        return self.step_dir(run_id, step) / _check_name("suite fingerprint", suite_fp)

    def record_path(self, run_id: str, step: int, suite_fp: str, attempt: int) -> Path:
        return self.record_dir(run_id, step, suite_fp) / f"attempt-{int(attempt)}.json"

    @staticmethod
    def root_of(record_path: str | os.PathLike) -> Path:
        """The results root a record file lies under (the inverse of `record_path`)."""
        return Path(record_path).resolve().parents[3]

    # ---- writing -------------------------------------------------------------------
    def write(self, *, job: dict[str, Any], job_id: str, result: dict[str, Any],
              worker: dict[str, Any] | None = None) -> tuple[Path, dict[str, Any], bool]:
        """Record `result` of `job`; return (path, record, created).

        `created` is False when this attempt was already recorded (the first record wins and
        is returned unchanged), which makes re-running an abandoned job harmless.
        """
        suite_info = result.get("suite") or {}
        suite_fp = suite_info.get("fingerprint")
        if not suite_fp:
            raise LedgerError("result has no suite.fingerprint; cannot place it in the ledger")
        run_id, step, attempt = job["run_id"], int(job["step"]), int(job.get("attempt") or 0)
        path = self.record_path(run_id, step, suite_fp, attempt)
        record = {
            "schema": RECORD_SCHEMA, "run_id": run_id, "step": step, "suite": job.get("suite"),
            "suite_fingerprint": suite_fp, "attempt": attempt, "job_id": job_id,
            "checkpoint_digest": job.get("checkpoint_digest"), "recorded_at": _utcnow(), "job": job,
            "worker": worker or {"host": socket.gethostname(), "pid": os.getpid()}, "result": result,
        }
        data = (json.dumps(record, indent=1, sort_keys=True, allow_nan=False) + "\n").encode()
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = _write_tmp(path.parent, data)
        created = True
        try:
            os.link(tmp, path)  # atomic, and refuses to replace an existing record
        except FileExistsError:
            created = False
        finally:
            os.unlink(tmp)
        fsync_dir(path.parent)
        if not created:
            record = read_record(path)
        self._update_latest(path.parent)
        self.index(record, path)
        return path, record, created

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
                "suite_fingerprint": record["suite_fingerprint"], "attempt": record["attempt"],
                "job_id": record.get("job_id"), "checkpoint_digest": record.get("checkpoint_digest"),
                "tau": tau.get("macro"), "tau_ci95": tau.get("ci95"), "recorded_at": record.get("recorded_at"),
                "path": str(path)}

    def index(self, record: dict[str, Any], path: Path | str) -> None:
        """Add a record to the Redis index (newest attempt per step/suite wins)."""
        if self.connection is None:
            return
        key = INDEX_PREFIX + record["run_id"]
        field = f"{int(record['step'])}:{record['suite_fingerprint']}"
        summary = self.summary(record, path)
        current = self.connection.hget(key, field)
        if current is not None:
            with contextlib.suppress(ValueError, KeyError, TypeError):
                if int(json.loads(current)["attempt"]) > int(summary["attempt"]):
                    return
        with self.connection.pipeline() as pipe:
            pipe.hset(key, field, json.dumps(summary, sort_keys=True))
            if record.get("job_id"):
                pipe.hset(DONE_KEY, _base_id(record["job_id"]), json.dumps(summary, sort_keys=True))
            pipe.sadd(RUNS_KEY, record["run_id"])
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
        return sorted(out, key=lambda s: (s["run_id"], s["step"], s["suite_fingerprint"]))

    def lookup(self, run_id: str, step: int, suite_fp: str) -> dict[str, Any] | None:
        """The indexed summary for (run, step, suite), or None."""
        if self.connection is None:
            return None
        raw = self.connection.hget(INDEX_PREFIX + run_id, f"{int(step)}:{suite_fp}")
        return json.loads(raw) if raw is not None else None

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
        return sorted(p.name for p in self.root.iterdir() if p.is_dir() and _SAFE_RE.match(p.name))

    def entries(self, run_id: str | None = None, *, suite_fp: str | None = None,
                all_attempts: bool = False) -> list[LedgerEntry]:
        """Records on disk, sorted by (run, step, suite, attempt); newest attempt only by default."""
        out: list[LedgerEntry] = []
        for run in ([run_id] if run_id else self.runs()):
            run_dir = self.root / _check_name("run_id", run)
            if not run_dir.is_dir():
                continue
            for step_dir in run_dir.iterdir():
                m = _STEP_RE.match(step_dir.name)
                if not m or not step_dir.is_dir():
                    continue
                for suite_dir in step_dir.iterdir():
                    if not suite_dir.is_dir() or (suite_fp and suite_dir.name != suite_fp):
                        continue
                    attempts = sorted(int(a.group(1)) for p in suite_dir.iterdir()
                                      if (a := _ATTEMPT_RE.match(p.name)))
                    for n in (attempts if all_attempts else attempts[-1:]):
                        out.append(LedgerEntry(run, int(m.group(1)), suite_dir.name, n,
                                               suite_dir / f"attempt-{n}.json"))
        return sorted(out, key=lambda e: (e.run_id, e.step, e.suite_fingerprint, e.attempt))

    def records(self, run_id: str | None = None, **kw) -> Iterator[dict[str, Any]]:
        """The records themselves (see :meth:`entries` for the filters)."""
        for entry in self.entries(run_id, **kw):
            yield entry.read()

    def find_job(self, job: dict[str, Any], job_id: str) -> tuple[Path, dict[str, Any]] | None:
        """An existing record of exactly this job attempt (any suite dir), or None."""
        step_dir = self.step_dir(job["run_id"], job["step"])
        if not step_dir.is_dir():
            return None
        name = f"attempt-{int(job.get('attempt') or 0)}.json"
        for path in sorted(step_dir.glob(f"*/{name}")):
            with contextlib.suppress(LedgerError):
                record = read_record(path)
                if record.get("job_id") == job_id and record.get("checkpoint_digest") == job["checkpoint_digest"]:
                    return path, record
        return None

    def latest(self, run_id: str, suite_fp: str | None = None) -> dict[str, Any] | None:
        """The record of the highest step of a run (newest attempt)."""
        entries = self.entries(run_id, suite_fp=suite_fp)
        return max(entries, key=lambda e: (e.step, e.attempt)).read() if entries else None

    def best(self, run_id: str, suite_fp: str | None = None) -> dict[str, Any] | None:
        """The record with the highest τ in a run (ties: the earliest step)."""
        best, best_key = None, None
        for record in self.records(run_id, suite_fp=suite_fp):
            tau = tau_of(record)
            if tau is None:
                continue
            key = (tau, -record["step"])
            if best_key is None or key > best_key:
                best, best_key = record, key
        return best
