"""A real S3-compatible HTTP server for the object-store tests: moto's server mode in a subprocess.

`moto_server` answers the S3 REST API over HTTP on a free port; the code under test reaches
it exactly as it would reach MinIO or AWS: s3fs/botocore with `AWS_ENDPOINT_URL` and
credentials from the environment (nothing is patched in-process).
"""
from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

CREDENTIALS = {"AWS_ACCESS_KEY_ID": "dflash-test-key", "AWS_SECRET_ACCESS_KEY": "dflash-test-secret",
               "AWS_DEFAULT_REGION": "us-east-1"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, proc: subprocess.Popen, timeout: float) -> bool:
    """Until `url` answers (True), the server process exits or `timeout` passes (False)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(url, timeout=2).read()
            return True
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                return False
            time.sleep(0.2)


class S3Server:
    """`python -m moto.server` on 127.0.0.1:<free port>, its log in `log_path`."""

    def __init__(self, log_path: Path):
        self.port = free_port()
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(self.port)],
                                     stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True)
        from tests.support import waits

        if not wait_http(self.endpoint + "/moto-api/", self.proc, waits.scaled(60)):
            self.stop()
            raise RuntimeError(f"moto server did not start: {log_path.read_text()[-2000:]}")

    def env(self) -> dict[str, str]:
        """What a client process needs: the endpoint and (fake) credentials, the standard variables."""
        return {**CREDENTIALS, "AWS_ENDPOINT_URL": self.endpoint}

    def make_bucket(self, bucket: str) -> None:
        from dflash_train.checkpoints import storage

        storage.store_for(f"s3://{bucket}").fs.mkdir(bucket)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
