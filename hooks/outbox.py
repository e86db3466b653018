"""A durable local outbox for eval jobs, next to the checkpoints.

Every job the training-side hook makes is first written here (one small JSON file per
job, written to a temporary name, fsynced, renamed), then delivered to the queue by a
background thread. A file is removed only after the queue accepted the job (or said it
already has it), so a crash, a Redis outage or the end of training never loses a job;
a delivery repeated after a crash is a no-op thanks to the deterministic job id. Jobs
the queue refuses as invalid (checkpoint gone, ...) move to `rejected/` with the reason.

Layout: `<checkpoint_root>/<run_id>/.eval-outbox/<key>.json`, `.../rejected/<key>.json`
(+ `<key>.reason.txt`). Deliver leftovers by hand with `dflash-eval enqueue --outbox DIR`.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from dflash_train.fsutil import atomic_write_bytes, fsync_dir

log = logging.getLogger("hooks.outbox")

OUTBOX_DIRNAME = ".eval-outbox"


def outbox_dir(checkpoint_root: str | os.PathLike, run_id: str) -> Path:
    return Path(checkpoint_root) / run_id / OUTBOX_DIRNAME


def job_key(job: dict[str, Any]) -> str:
    """File name stem for a job: same evaluation -> same file (putting it twice is harmless)."""
    spec = json.dumps({"suite": job.get("suite"), "options": job.get("options"), "baseline": job.get("baseline"),
                       "target": job.get("target")}, sort_keys=True)
    return (f"step-{int(job['step']):08d}-{str(job['checkpoint_digest'])[:12]}-"
            f"{hashlib.sha256(spec.encode()).hexdigest()[:8]}")


@dataclass
class DeliveryReport:
    delivered: list[str] = field(default_factory=list)   # keys accepted (or already known) by the queue
    rejected: list[str] = field(default_factory=list)    # keys refused as invalid (moved to rejected/)
    remaining: int = 0                                    # still waiting (queue unreachable)
    error: str | None = None                              # why delivery stopped early

    @property
    def complete(self) -> bool:
        return self.remaining == 0


class Outbox:
    """Job files in one directory; safe to share between threads of one process."""

    def __init__(self, directory: str | os.PathLike):
        self.dir = Path(directory)
        self._lock = threading.Lock()

    @property
    def rejected_dir(self) -> Path:
        return self.dir / "rejected"

    def put(self, job: dict[str, Any]) -> Path:
        """Store `job` durably; returns its file."""
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / f"{job_key(job)}.json"
        data = json.dumps(job, sort_keys=True, allow_nan=False).encode()
        atomic_write_bytes(path, data, mode=0o600)  # jobs may carry W&B settings: owner only
        return path

    def pending(self) -> list[Path]:
        """Job files waiting, oldest step first."""
        if not self.dir.is_dir():
            return []
        return sorted(p for p in self.dir.glob("*.json") if not p.name.startswith("."))

    def __len__(self) -> int:
        return len(self.pending())

    def holds(self, checkpoint: str | os.PathLike) -> bool:
        """Whether a waiting job names this checkpoint (retention must keep it)."""
        want = os.path.realpath(checkpoint)
        for path in self.pending():
            with contextlib.suppress(OSError, ValueError):
                job = json.loads(path.read_text())
                if os.path.realpath(job.get("checkpoint", "")) == want or \
                        os.path.realpath(job.get("baseline") or "/nonexistent") == want:
                    return True
        return False

    def deliver(self, send: Callable[[dict[str, Any]], Any], *, is_invalid: Callable[[BaseException], bool]
                ) -> DeliveryReport:
        """Send every waiting job in order; stop at the first transport error (try again later).

        `send(job)` enqueues (any return is success); an exception for which `is_invalid`
        is true rejects that job (moved aside with the reason); any other stops delivery.
        """
        report = DeliveryReport()
        with self._lock:
            files = self.pending()
            for i, path in enumerate(files):
                try:
                    job = json.loads(path.read_text())
                except FileNotFoundError:
                    continue
                except (OSError, ValueError) as e:
                    self._reject(path, f"unreadable outbox file: {e}")
                    report.rejected.append(path.stem)
                    continue
                try:
                    send(job)
                except Exception as e:  # noqa: BLE001 - classified below
                    if is_invalid(e):
                        self._reject(path, str(e))
                        report.rejected.append(path.stem)
                        log.error("eval job %s refused by the queue: %s", path.stem, e)
                        continue
                    report.remaining = len(files) - i
                    report.error = f"{type(e).__name__}: {e}"
                    return report
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
                fsync_dir(self.dir)
                report.delivered.append(path.stem)
        return report

    def _reject(self, path: Path, reason: str) -> None:
        self.rejected_dir.mkdir(parents=True, exist_ok=True)
        (self.rejected_dir / f"{path.stem}.reason.txt").write_text(reason + "\n")
        os.replace(path, self.rejected_dir / path.name)
        fsync_dir(self.dir)


class Deliverer:
    """A daemon thread that empties an outbox, backing off while the queue is unreachable."""

    def __init__(self, outbox: Outbox, send: Callable[[dict[str, Any]], Any], *,
                 is_invalid: Callable[[BaseException], bool], min_backoff: float = 1.0, max_backoff: float = 60.0,
                 on_report: Callable[[DeliveryReport], None] | None = None,
                 on_idle: Callable[[], None] | None = None, idle_interval: float | None = None):
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

    def start(self) -> "Deliverer":
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
            self._wake.wait(timeout=self.idle_interval if not self.outbox.pending() else backoff)
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
            log.warning("eval queue unreachable, %d job(s) kept in %s: %s", report.remaining, self.outbox.dir,
                        report.error)
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
