"""dflash_train.common.fsutil: atomic writes leave the old content or the new one, and no temporaries."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from dflash_train.common import fsutil


def _names(directory) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


@pytest.mark.parametrize("durable", [True, False])
def test_atomic_write_bytes_replaces_content_and_leaves_no_temporary(tmp_path, durable):
    path = tmp_path / "f.bin"
    fsutil.atomic_write_bytes(path, b"old", durable=durable)
    fsutil.atomic_write_bytes(path, b"new content", durable=durable)
    assert path.read_bytes() == b"new content"
    assert _names(tmp_path) == ["f.bin"]


def test_new_file_gets_umask_permissions_like_open(tmp_path):
    fsutil.atomic_write_bytes(tmp_path / "a", b"x")
    (tmp_path / "b").write_bytes(b"x")
    assert (tmp_path / "a").stat().st_mode == (tmp_path / "b").stat().st_mode


def test_explicit_mode_is_exact_whatever_the_umask(tmp_path):
    old = os.umask(0)  # the widest umask: mode must still win
    try:
        fsutil.atomic_write_bytes(tmp_path / "secret", b"x", mode=0o600)
    finally:
        os.umask(old)
    assert (tmp_path / "secret").stat().st_mode & 0o777 == 0o600


def test_outbox_job_files_are_owner_only(tmp_path):
    from eval_worker.service.queueing.outbox import Outbox

    job = {"run_id": "r", "step": 3, "checkpoint_digest": "a" * 64, "suite": "s"}
    path = Outbox(tmp_path / "box").put(job)
    assert path.stat().st_mode & 0o777 == 0o600
    assert [p.name for p in (tmp_path / "box").iterdir()] == [path.name]  # no temporary left


def test_failed_replace_keeps_old_content_and_removes_temporary(tmp_path, monkeypatch):
    path = tmp_path / "f.json"
    path.write_text("old")
    seen = []

    def failing_replace(src, dst):
        seen.append(os.path.basename(src))
        assert os.path.exists(src)  # the new data was written in full before the rename
        raise OSError("replace refused")

    monkeypatch.setattr(fsutil.os, "replace", failing_replace)
    with pytest.raises(OSError, match="replace refused"):
        fsutil.atomic_write_bytes(path, b"new")
    assert path.read_text() == "old"
    assert _names(tmp_path) == ["f.json"]
    # the temporary was hidden, named after the target, marked .tmp- and ended in our pid
    (tmp,) = seen
    assert tmp.startswith(".f.json.") and ".tmp-" in tmp and tmp.endswith(f".tmp-{os.getpid()}")


def test_failed_write_keeps_old_content_and_removes_temporary(tmp_path):
    path = tmp_path / "state.pt"
    path.write_bytes(b"old")

    with pytest.raises(TypeError):  # the write itself raises
        fsutil.atomic_write_bytes(path, "not bytes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="half-way"):
        with fsutil.atomic_writer(path) as f:
            f.write(b"partial")
            raise ValueError("failed half-way")
    assert path.read_bytes() == b"old"
    assert _names(tmp_path) == ["state.pt"]


def test_atomic_write_text_and_json(tmp_path):
    fsutil.atomic_write_text(tmp_path / "t.txt", "héllo\n")
    assert (tmp_path / "t.txt").read_bytes() == "héllo\n".encode()
    fsutil.atomic_write_json(tmp_path / "d.json", {"b": 1, "a": [1, 2]})
    text = (tmp_path / "d.json").read_text()
    assert text == json.dumps({"a": [1, 2], "b": 1}, indent=2) + "\n"
    fsutil.atomic_write_json(tmp_path / "u.json", {"b": 1, "a": 2}, sort_keys=False, durable=False)
    assert list(json.loads((tmp_path / "u.json").read_text())) == ["b", "a"]
    assert _names(tmp_path) == ["d.json", "t.txt", "u.json"]


def test_fsync_dir_tolerates_errors_fsync_path_does_not(tmp_path):
    fsutil.fsync_dir(tmp_path)
    fsutil.fsync_path(tmp_path)
    fsutil.fsync_dir(tmp_path / "missing")  # refused (here: missing) -> ignored
    with pytest.raises(FileNotFoundError):
        fsutil.fsync_path(tmp_path / "missing")


def test_pid_alive():
    assert fsutil.pid_alive(os.getpid())
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()  # reaped: the pid no longer exists
    assert not fsutil.pid_alive(child.pid)
    assert not fsutil.pid_alive(0) and not fsutil.pid_alive(-1)
