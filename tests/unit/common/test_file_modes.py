"""File modes are deliberate, whatever the umask (docs/reliability.md, "File modes").

Shared outputs (published checkpoints, the ledger) are 0644 files in 0755 directories: an eval
worker or a report may run as another user. Private state (the hook outbox, the worker's result
spool, the embedded Redis data with its AOF and config) is 0600 in 0700 directories. The
ledger, spool and Redis checks live next to their code's tests (test_ledger.py,
test_sidecar_jobfunc.py, test_redis_server.py).
"""
from __future__ import annotations

import contextlib
import os
import stat

import pytest

from eval_worker.service.jobs.builder import make_job
from eval_worker.service.queueing.outbox import Outbox
from tests.support.sidecar_support import publish_random


@contextlib.contextmanager
def _umask(mask: int):
    old = os.umask(mask)
    try:
        yield
    finally:
        os.umask(old)


def _mode(p) -> int:
    return stat.S_IMODE(p.stat().st_mode)


@pytest.mark.parametrize("mask", [0o077, 0o000, 0o022])
def test_file_modes_of_a_published_checkpoint_let_any_worker_read_it(tmp_path, mask):
    """Observed: model.safetensors was 0600 (safetensors' own mode) while config.json was 0644, so a
    worker running as another user could read the config but not the weights."""
    with _umask(mask):
        ck = publish_random(tmp_path / "ck", "run-m", 100)
    assert sorted(p.name for p in ck.iterdir()) == ["COMPLETE.json", "config.json", "model.safetensors"]
    for p in ck.iterdir():
        assert _mode(p) == 0o644, (p.name, oct(_mode(p)))
    assert _mode(ck) == 0o755 and _mode(ck.parent) == 0o755


@pytest.mark.parametrize("mask", [0o000, 0o022])
def test_file_modes_of_the_outbox_are_owner_only(tmp_path, mask):
    ck = publish_random(tmp_path / "ck", "run-m", 100)
    with _umask(mask):
        box = Outbox(tmp_path / "ck" / "run-m" / ".eval-outbox")
        path = box.put(make_job(ck, suite="builtin:coding-v1").to_json())
        box.deliver(lambda job: (_ for _ in ()).throw(ValueError("refused")), is_invalid=lambda e: True)
    assert _mode(box.dir) == 0o700 and _mode(box.rejected_dir) == 0o700
    moved = box.rejected_dir / path.name
    for p in (moved, box.rejected_dir / f"{path.stem}.reason.txt"):
        assert _mode(p) == 0o600, (p.name, oct(_mode(p)))
