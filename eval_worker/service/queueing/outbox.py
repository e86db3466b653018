"""A durable local outbox for eval jobs, next to the checkpoints.

Every job the training-side hook makes is first written here (one small JSON file per
job, written to a temporary name, fsynced, renamed), then delivered to the queue by a
background thread. A file is removed only after the queue accepted the job (or said it
already has it), so a crash, a Redis outage or the end of training never loses a job;
a delivery repeated after a crash is a no-op thanks to the deterministic job id.

Only a job the queue refuses *because of the job itself* (schema, options, checkpoint gone:
an error that is not `retryable`, dflash_train.common.errors) moves to `rejected/` with the reason.
Every other failure — Redis unreachable, out of memory at `maxmemory`, `MISCONF` (it cannot persist), `BUSY`,
`LOADING`, a cluster redirection, a wrong password, a bug — keeps the job waiting here and
delivery backs off: the job is not at fault, and a later try can succeed.

A job that cannot be written here (the disk is full, read-only, gone) is kept in memory
(`put_or_owe`, at most MAX_OWED) and owed: every delivery first tries to write it again, then
to queue it straight from memory; the hook reports what is owed (`dflash-eval status`) and,
at train end, lists and releases what was never queued.

Layout: `<checkpoint_root>/<run_id>/.eval-outbox/<key>.json`, `.../rejected/<key>.json`
(+ `<key>.reason.txt`); files 0600, directories 0700 (the trainer's private state).
Deliver leftovers by hand with `dflash-eval enqueue --outbox DIR`; after fixing what made
jobs be set aside, `dflash-eval enqueue --outbox DIR --retry-rejected` delivers those too.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_train.common.errors import retryable
from dflash_train.common.fsutil import atomic_write_bytes, fsync_dir
from dflash_train.common.redaction import redact

log = logging.getLogger(__name__)

OUTBOX_DIRNAME = ".eval-outbox"
FILE_MODE, DIR_MODE = 0o600, 0o700  # the trainer's private spool of undelivered jobs
MAX_OWED = 10_000  # jobs kept in memory while the outbox cannot be written (a bound, not an expectation)


def outbox_dir(checkpoint_root: str | os.PathLike, run_id: str) -> Path:
    return Path(checkpoint_root) / run_id / OUTBOX_DIRNAME


def job_key(job: dict[str, Any]) -> str:
    """File name stem for a job: same evaluation -> same file (putting it twice is harmless)."""
    spec = json.dumps({"suite": job.get("suite"), "options": job.get("options"), "baseline": job.get("baseline"),
                       "target": job.get("target")}, sort_keys=True)
    return (f"step-{int(job['step']):08d}-{str(job['checkpoint_digest'])[:12]}-"
            f"{hashlib.sha256(spec.encode()).hexdigest()[:8]}")


def _refused_for_the_job(error: BaseException) -> bool:
    """The queue refused the job for itself (schema, options, suite, checkpoint), so sending it
    unchanged cannot help. Anything else (Redis unreachable, out of memory at maxmemory, MISCONF,
    BUSY, LOADING, a cluster redirection, a wrong password) is a condition of the server."""
    return not retryable(error)


@dataclass
class DeliveryReport:
    delivered: list[str] = field(default_factory=list)   # keys accepted (or already known) by the queue
    rejected: list[str] = field(default_factory=list)    # keys refused for the job itself (moved to rejected/)
    remaining: int = 0                                    # still waiting (queue unreachable or refusing writes)
    error: str | None = None                              # why delivery stopped early
    reasons: dict[str, str] = field(default_factory=dict)  # rejected key -> reason
    owed: list[tuple[dict[str, Any], str]] = field(default_factory=list)  # (job, why) in memory only, not on disk

    @property
    def complete(self) -> bool:
        return self.remaining == 0


class Outbox:
    """Job files in one directory; safe to share between threads of one process."""

    def __init__(self, directory: str | os.PathLike):
        self.dir = Path(directory)
        self._lock = threading.Lock()
        self._owed: dict[str, tuple[dict[str, Any], str]] = {}  # key -> (job, why it is not on disk)
        self._owed_lock = threading.Lock()  # never held across I/O: the training thread takes it

    @property
    def rejected_dir(self) -> Path:
        return self.dir / "rejected"

    def _mkdir(self, directory: Path) -> None:
        if not directory.is_dir():
            directory.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
            os.chmod(directory, DIR_MODE)  # whatever the umask

    def put(self, job: dict[str, Any]) -> Path:
        """Store `job` durably; returns its file."""
        self._mkdir(self.dir)
        path = self.dir / f"{job_key(job)}.json"
        data = json.dumps(job, sort_keys=True, allow_nan=False).encode()
        atomic_write_bytes(path, data, mode=FILE_MODE)
        return path

    def put_or_owe(self, job: dict[str, Any]) -> Path | None:
        """`put`, or, when the job cannot be written (disk full, read-only), keep it in memory as
        owed: each delivery tries to write it again, then to queue it from memory. None if owed."""
        try:
            return self.put(job)
        except OSError as e:
            why = f"{type(e).__name__}: {e}"
            with self._owed_lock:
                if len(self._owed) >= MAX_OWED and job_key(job) not in self._owed:
                    raise
                self._owed[job_key(job)] = (job, why)
            log.warning("eval job for step %s could not be written to %s (%s); kept in memory, written or "
                        "queued as soon as either works", job.get("step"), self.dir, why)
            return None

    def owed(self) -> list[tuple[dict[str, Any], str]]:
        """Jobs held in memory only (job, why the write failed), oldest step first."""
        with self._owed_lock:
            return [self._owed[k] for k in sorted(self._owed)]

    def give_up_owed(self) -> list[tuple[dict[str, Any], str]]:
        """Forget the owed jobs (the process is ending) and return them, so the caller lists them."""
        with self._owed_lock:
            out = [self._owed[k] for k in sorted(self._owed)]
            self._owed.clear()
        return out

    def _write_owed(self) -> None:
        """The disk may have room again: owed jobs become files (durable) first."""
        for job, _ in self.owed():
            try:
                self.put(job)
            except OSError as e:
                with self._owed_lock:
                    if job_key(job) in self._owed:
                        self._owed[job_key(job)] = (job, f"{type(e).__name__}: {e}")
                return
            with self._owed_lock:
                self._owed.pop(job_key(job), None)
            log.info("eval job for step %s, owed in memory, is now written to %s", job.get("step"), self.dir)

    def pending(self) -> list[Path]:
        """Job files waiting, oldest step first."""
        if not self.dir.is_dir():
            return []
        return sorted(p for p in self.dir.glob("*.json") if not p.name.startswith("."))

    def __len__(self) -> int:
        return len(self.pending()) + len(self._owed)

    def holds(self, checkpoint: str | os.PathLike) -> bool:
        """Whether a waiting job, on disk or owed in memory, names this checkpoint (retention must keep it)."""
        want = os.path.realpath(checkpoint)
        for job, _ in self.owed():
            if want in (os.path.realpath(job.get("checkpoint", "")), os.path.realpath(job.get("baseline") or "/-")):
                return True
        for path in self.pending():
            with contextlib.suppress(OSError, ValueError):
                job = json.loads(path.read_text())
                if os.path.realpath(job.get("checkpoint", "")) == want or \
                        os.path.realpath(job.get("baseline") or "/nonexistent") == want:
                    return True
        return False

    def deliver(self, send: Callable[[dict[str, Any]], Any], *,
                is_invalid: Callable[[BaseException], bool] = _refused_for_the_job) -> DeliveryReport:
        """Send every waiting job in order; stop at the first error that is not the job's fault.

        `send(job)` enqueues (any return is success); an exception for which `is_invalid`
        is true (default: not retryable, the queue refused the job itself) sets that job aside with the reason; any
        other keeps it and every later job waiting, and stops this delivery (try again later).
        """
        report = DeliveryReport()
        with self._lock:
            self._write_owed()
            files = self.pending()
            for i, path in enumerate(files):
                try:
                    job = json.loads(path.read_text())
                except FileNotFoundError:
                    continue
                except (OSError, ValueError) as e:
                    self._reject(path, f"unreadable outbox file: {e}")
                    report.rejected.append(path.stem)
                    report.reasons[path.stem] = f"unreadable outbox file: {e}"
                    continue
                try:
                    send(job)
                except Exception as e:  # noqa: BLE001 - classified below
                    if is_invalid(e):
                        self._reject(path, str(e))
                        report.rejected.append(path.stem)
                        report.reasons[path.stem] = str(e)
                        log.error("eval job %s refused by the queue: %s", path.stem, e)
                        continue
                    report.owed = self.owed()
                    report.remaining = len(files) - i + len(report.owed)
                    report.error = f"{type(e).__name__}: {e}"
                    return report
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                fsync_dir(self.dir)
                report.delivered.append(path.stem)
            self._send_owed(send, is_invalid, report)
        return report

    def _send_owed(self, send, is_invalid, report: DeliveryReport) -> None:
        """Queue what is still owed (the disk is still full) straight from memory."""
        for job, why in self.owed():
            key = job_key(job)
            try:
                send(job)
            except Exception as e:  # noqa: BLE001 - classified below
                if is_invalid(e):  # refused for itself: nowhere to set it aside, so said loudly
                    with self._owed_lock:
                        self._owed.pop(key, None)
                    report.rejected.append(key)
                    report.reasons[key] = str(e)
                    log.error("eval job %s (owed in memory, %s) refused by the queue: %s", key, why, e)
                    continue
                report.owed = self.owed()
                report.remaining = len(report.owed)
                report.error = f"{type(e).__name__}: {e}"
                return
            with self._owed_lock:
                self._owed.pop(key, None)
            report.delivered.append(key)
            log.info("eval job for step %s queued from memory (its outbox file could not be written: %s)",
                     job.get("step"), why)
        report.owed = self.owed()

    def _reject(self, path: Path, reason: str) -> None:
        reason = redact(reason)
        reason = reason if len(reason) <= 2000 else reason[:2000] + " ..."
        self._mkdir(self.rejected_dir)
        atomic_write_bytes(self.rejected_dir / f"{path.stem}.reason.txt", (reason + "\n").encode(), mode=FILE_MODE)
        os.replace(path, self.rejected_dir / path.name)
        fsync_dir(self.dir)

    def rejected(self) -> dict[str, str]:
        """Jobs set aside: key -> the reason they were refused."""
        if not self.rejected_dir.is_dir():
            return {}
        out = {}
        for p in sorted(self.rejected_dir.glob("*.json")):
            try:
                out[p.stem] = (self.rejected_dir / f"{p.stem}.reason.txt").read_text().strip()
            except OSError:
                out[p.stem] = "(no reason recorded)"
        return out

    def restore_rejected(self) -> list[str]:
        """Put every set-aside job back in the outbox (after its cause was fixed); returns their keys."""
        restored = []
        with self._lock:
            for key in self.rejected():
                src = self.rejected_dir / f"{key}.json"
                try:
                    os.replace(src, self.dir / src.name)
                except FileNotFoundError:
                    continue
                with contextlib.suppress(FileNotFoundError):
                    (self.rejected_dir / f"{key}.reason.txt").unlink()
                restored.append(key)
            if restored:
                fsync_dir(self.dir)
                fsync_dir(self.rejected_dir)
        return restored


class Deliverer:
    """A daemon thread that empties an outbox, backing off while the queue is unreachable."""

    def __init__(self, outbox: Outbox, send: Callable[[dict[str, Any]], Any], *,
                 is_invalid: Callable[[BaseException], bool] = _refused_for_the_job, min_backoff: float = 1.0,
                 max_backoff: float = 60.0,
                 on_report: Callable[[DeliveryReport], None] | None = None,
                 on_idle: Callable[[], object] | None = None, idle_interval: float | None = None):
        self.outbox, self.send, self.is_invalid = outbox, send, is_invalid
        self.min_backoff, self.max_backoff = min_backoff, max_backoff
        self.on_report = on_report
        self.on_idle, self.idle_interval = on_idle, idle_interval  # periodic housekeeping (pin release)
        self.last_report: DeliveryReport | None = None
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._idle = threading.Condition()
        self._busy = False
        self._thread: threading.Thread | None = None

    def start(self) -> Deliverer:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="eval-outbox-delivery", daemon=True)
            self._thread.start()
        return self

    def kick(self) -> None:
        """Something new is waiting: try now."""
        self._wake.set()

    def _run(self) -> None:
        backoff = self.min_backoff
        while not self._stop.is_set():
            self._wake.wait(timeout=self.idle_interval if not len(self.outbox) else backoff)
            self._wake.clear()
            if self._stop.is_set():
                break
            report = self._deliver_once()
            backoff = self.min_backoff if report.complete else min(backoff * 2, self.max_backoff)
            if self.on_idle is not None and report.complete:
                try:
                    self.on_idle()
                except Exception:  # noqa: BLE001 - housekeeping must not kill delivery
                    log.debug("outbox housekeeping failed", exc_info=True)

    def _deliver_once(self) -> DeliveryReport:
        with self._idle:
            self._busy = True
        try:
            report = self.outbox.deliver(self.send, is_invalid=self.is_invalid)
        except Exception as e:  # noqa: BLE001 - never let the thread die
            log.exception("outbox delivery failed")
            report = DeliveryReport(remaining=len(self.outbox), error=f"{type(e).__name__}: {e}")
        finally:
            with self._idle:
                self._busy = False
                self._idle.notify_all()
        self.last_report = report
        if report.error:
            log.warning("eval queue did not take the jobs (unreachable or refusing writes); %d job(s) kept in %s, "
                        "trying again later: %s", report.remaining, self.outbox.dir, report.error)
        if self.on_report is not None:
            with contextlib.suppress(Exception):
                self.on_report(report)
        return report

    def flush(self, timeout: float) -> DeliveryReport:
        """Deliver what waits, trying until `timeout` seconds have passed (train end)."""
        deadline = time.monotonic() + timeout
        report = DeliveryReport(remaining=len(self.outbox))
        while True:
            with self._idle:  # let a delivery in flight finish first
                self._idle.wait_for(lambda: not self._busy, timeout=max(0.0, deadline - time.monotonic()))
            report = self._deliver_once()
            if report.complete or time.monotonic() >= deadline:
                return report
            time.sleep(min(1.0, max(0.0, deadline - time.monotonic())))

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout)
