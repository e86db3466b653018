"""Two writers of one checkpoint (issue 34, D6 and D7): exactly one publisher of a (run, step) is told
"published", the other is told who published it, and a marker never stands over files it does not list.

Raced for real: two processes per round for a local root (each writes its files, then both place at
once behind a barrier), two threads per round against a real S3 server (moto over HTTP), many rounds each.

Select with `pytest -k "publish_no_replace or upload_conditional"`.
"""
from __future__ import annotations

import json
import os
import threading
import uuid
from pathlib import Path

import pytest

from dflash_train.checkpoints import storage
from dflash_train.checkpoints.publication import (
    MARKER_NAME,
    UPLOAD_LEASE,
    CheckpointError,
    list_checkpoints,
    publish_directory,
    read_manifest,
    sha256_file,
    upload_checkpoint,
    verify_checkpoint,
)
from tests.support import waits
from tests.support.publisher_race import RUN, race_round

ROUNDS = 20


def test_publish_no_replace_two_local_publishers_exactly_one_wins(tmp_path):
    root = tmp_path / "ck"
    for step in range(1, ROUNDS + 1):
        r = race_round(root, step)
        assert r.problems == [], f"step {step}: {r.problems} {r.outcomes}"
    run = root / RUN
    assert [p.name for p in list_checkpoints(run)] == [f"step-{s:08d}" for s in range(1, ROUNDS + 1)]
    assert sorted(p.name for p in run.iterdir()) == [f"step-{s:08d}" for s in range(1, ROUNDS + 1)]  # no temp left


def test_publish_no_replace_the_same_process_twice_and_a_leftover(tmp_path):
    """Two threads of one process (one pid) race as well; a step directory without a marker (a crash between
    the rename and the marker) is replaced, a marked one never."""
    root = tmp_path / "ck"
    leftover = root / "r" / "step-00000007"
    leftover.mkdir(parents=True)
    (leftover / "model.safetensors").write_bytes(b"half")
    barrier, results = threading.Barrier(2), []

    def publish(tag: str) -> None:
        def write(tmp: Path) -> None:
            (tmp / "config.json").write_text(json.dumps({"publisher": tag}))
            (tmp / "model.safetensors").write_bytes(tag.encode() * 1000)
            barrier.wait(timeout=30)
        try:
            results.append((tag, "ok", publish_directory(root, "r", 7, write)))
        except CheckpointError as e:
            results.append((tag, "refused", str(e)))

    threads = [threading.Thread(target=publish, args=(t,)) for t in "AB"]
    for t in threads:
        t.start()
    for t in threads:
        t.join(waits.scaled(30))
    assert sorted(r[1] for r in results) == ["ok", "refused"], results
    winner = next(r for r in results if r[1] == "ok")
    assert json.loads((leftover / "config.json").read_text()) == {"publisher": winner[0]}
    assert verify_checkpoint(leftover)["files"]["model.safetensors"] == sha256_file(leftover / "model.safetensors")


@pytest.fixture
def bucket(s3_server):
    name = f"b-{uuid.uuid4().hex[:12]}"
    s3_server.make_bucket(name)
    return name


def _local(root: Path, step: int, tag: str) -> Path:
    def write(tmp: Path) -> None:
        (tmp / "config.json").write_text(json.dumps({"publisher": tag}))
        (tmp / "model.safetensors").write_bytes(os.urandom(256 << 10))
    return publish_directory(root / tag, "race", step, write)


def test_upload_conditional_two_uploads_of_one_step_one_wins(tmp_path, bucket):
    run_url = f"s3://{bucket}/runs/race"
    store = storage.store_for(run_url)
    rounds = 8
    for step in range(1, rounds + 1):
        locals_ = {tag: _local(tmp_path, step, tag) for tag in "AB"}
        barrier, results = threading.Barrier(2), {}

        def upload(tag: str, barrier=barrier, results=results, locals_=locals_) -> None:
            barrier.wait(timeout=30)
            try:
                results[tag] = ("ok", upload_checkpoint(locals_[tag], run_url))
            except CheckpointError as e:
                results[tag] = ("refused", str(e))

        threads = [threading.Thread(target=upload, args=(t,)) for t in "AB"]
        for t in threads:
            t.start()
        for t in threads:
            t.join(waits.scaled(60))
        assert sorted(v[0] for v in results.values()) == ["ok", "refused"], f"step {step}: {results}"
        winner = next(t for t, v in results.items() if v[0] == "ok")
        loser_message = results["B" if winner == "A" else "A"][1]
        assert "being uploaded by" in loser_message or "already published by" in loser_message, loser_message
        url = results[winner][1]
        # what the store holds is the winner's checkpoint, whole: its marker, and files matching it
        assert read_manifest(url) == read_manifest(locals_[winner])
        for name, digest in read_manifest(url)["files"].items():
            assert store.read_bytes(f"{url}/{name}") == (locals_[winner] / name).read_bytes(), name
            assert sha256_file(locals_[winner] / name) == digest
        assert UPLOAD_LEASE not in store.list_names(url) and MARKER_NAME in store.list_names(url)
    assert len(list_checkpoints(run_url)) == rounds


def test_upload_conditional_a_dead_uploaders_lease_is_taken_over(tmp_path, bucket):
    """A lease whose uploader died on this host does not block the step forever; a live one does."""
    run_url = f"s3://{bucket}/runs/race"
    store = storage.store_for(run_url)
    local = _local(tmp_path, 5, "A")
    lease = f"{run_url}/step-00000005/{UPLOAD_LEASE}"
    import socket

    held = {"by": "elsewhere pid 1", "host": socket.gethostname(), "pid": os.getpid(), "at": "2026-01-01T00:00:00"}
    store.write_bytes(lease, json.dumps(held).encode())
    with pytest.raises(CheckpointError, match="being uploaded by elsewhere pid 1 since 2026-01-01"):
        upload_checkpoint(local, run_url)
    store.write_bytes(lease, json.dumps({**held, "pid": 999_999_999}).encode())  # no such process
    assert upload_checkpoint(local, run_url) == f"{run_url}/step-00000005"
    assert store.list_names(f"{run_url}/step-00000005") == [MARKER_NAME, "config.json", "model.safetensors"]


def test_upload_conditional_a_late_lease_never_removes_a_published_step(tmp_path, bucket, monkeypatch):
    """The interleaving CI caught once: B looks (no marker yet), A uploads whole and releases its lease, then B
    takes the free lease. B must be refused and A's checkpoint must stand, not be taken for an interrupted upload."""
    from dflash_train.checkpoints import publication

    run_url = f"s3://{bucket}/runs/late"
    local = {tag: _local(tmp_path, 3, tag) for tag in "AB"}
    a_done, b_looked = threading.Event(), threading.Event()
    take_lease = publication._take_lease

    def paused_take_lease(store, dest, digest):
        if threading.current_thread().name == "B":
            b_looked.set()
            assert a_done.wait(waits.scaled(60))
        return take_lease(store, dest, digest)

    monkeypatch.setattr(publication, "_take_lease", paused_take_lease)
    results: dict[str, tuple[str, str]] = {}

    def upload(tag: str) -> None:
        try:
            results[tag] = ("ok", upload_checkpoint(local[tag], run_url))
        except CheckpointError as e:
            results[tag] = ("refused", str(e))

    b = threading.Thread(target=upload, args=("B",), name="B")
    b.start()
    assert b_looked.wait(waits.scaled(60))
    upload("A")
    a_done.set()
    b.join(waits.scaled(60))
    assert results["A"][0] == "ok" and results["B"][0] == "refused", results
    assert "already published by" in results["B"][1]
    url = results["A"][1]
    assert read_manifest(url) == read_manifest(local["A"])
    for name in read_manifest(url)["files"]:
        assert storage.store_for(url).read_bytes(f"{url}/{name}") == (local["A"] / name).read_bytes(), name
