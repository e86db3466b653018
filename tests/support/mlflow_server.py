"""A real MLflow tracking server for the MLflow sink tests: `mlflow server` on 127.0.0.1 only, a sqlite
backend store and served artifacts in a temporary directory (the same shape as tests/support/s3_server.py)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.support.s3_server import free_port, wait_http


class MlflowServer:
    def __init__(self, root: Path, port: int | None = None):
        self.port = port or free_port()
        self.uri = f"http://127.0.0.1:{self.port}"
        self.root = root
        root.mkdir(parents=True, exist_ok=True)
        self.log_path = root / "server.log"
        self._log = open(self.log_path, "ab")
        cmd = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(self.port),
               "--workers", "1", "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
               "--serve-artifacts", "--artifacts-destination", str(root / "artifacts")]
        env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        # the first start migrates the sqlite schema (slow on 2 busy cores)
        if not wait_http(self.uri + "/health", self.proc, 180):
            self.stop()
            raise RuntimeError(f"mlflow server did not start: {self.log_path.read_text()[-3000:]}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, 15)  # its gunicorn/uvicorn workers too (own session)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, 9)
                self.proc.wait()
        self._log.close()
