"""The processes the demo starts — a private Redis and eval worker(s) — and their guaranteed teardown.

Everything started here is stopped by :meth:`DemoStack.close` (also on errors and Ctrl-C):
workers get SIGTERM (RQ's warm shutdown), then SIGKILL to their whole process group
(RQ's scheduler and W&B's service run as their children); the Redis server is the demo's
own (its own data directory), never one the user already runs.
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class DemoStack:
    workdir: Path
    redis_url: str | None = None  # external Redis: used as is, never stopped
    workers: list[subprocess.Popen] = field(default_factory=list)
    _redis = None
    _logs: list = field(default_factory=list)

    def start_redis(self) -> str:
        if self.redis_url:
            from eval_worker.redis_client import connect

            connect(self.redis_url).close()  # fail now, with a clear message, if unreachable
            return self.redis_url
        from eval_worker.service.local_redis.server import LocalRedis

        self._redis = LocalRedis(self.workdir / "redis").start()
        self.redis_url = self._redis.url
        return self.redis_url

    def start_worker(self, name: str, *, target: Path, checkpoint_root: Path, results: Path, cache: Path,
                     env: dict[str, str]) -> subprocess.Popen:
        log_path = self.workdir / "logs" / f"{name}.log"
        log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(log_path, "ab")
        self._logs.append(log)
        assert self.redis_url is not None, "Redis is started before the workers"
        cmd = [sys.executable, "-m", "eval_worker.cli", "worker", "--redis-url", self.redis_url, "--name", name,
               "--target", str(target), "--checkpoint-root", str(checkpoint_root), "--results-dir", str(results),
               "--cache-dir", str(cache), "--log-level", "INFO",
               "--stop-timeout", "5"]  # on SIGTERM mid-job: hand the job back after 5 s, then exit
        # Own session: closing can signal the worker's whole process group (scheduler, W&B children).
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env},
                                start_new_session=True)
        proc.log_path = log_path  # type: ignore[attr-defined]
        self.workers.append(proc)
        return proc

    def check_workers(self) -> None:
        for w in self.workers:
            if w.poll() is not None:
                raise RuntimeError(f"eval worker exited with code {w.returncode}; last lines of "
                                   f"{w.log_path}:\n{tail(w.log_path)}")  # type: ignore[attr-defined]

    def stop_workers(self, grace_s: float = 20.0) -> None:
        for w in self.workers:
            if w.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(w.pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for w in self.workers:
            try:
                w.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
            # whatever is left in the group (the worker, or a child it left behind) goes now
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(w.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                w.wait(timeout=10)
        self.workers.clear()
        for log in self._logs:
            log.close()
        self._logs.clear()

    def close(self) -> None:
        try:
            self.stop_workers()
        finally:
            if self._redis is not None:
                self._redis.stop()
                self._redis = None


def tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"
