"""The `Store` interface (dflash_train/checkpoints/storage.py): the same properties checked on every kind
that writes, a local directory (LocalStore), fsspec's memory filesystem and a real S3-compatible
server (moto in a subprocess) through FsspecStore; the Hub's store refuses every write.

Select with `pytest -k object_store`.
"""
from __future__ import annotations

import os
import shutil
import threading
import time
import uuid

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dflash_train.checkpoints import storage
from dflash_train.checkpoints.publication import is_pinned, pin_checkpoint, unpin_checkpoint
from dflash_train.common.fsutil import is_temp_name
from tests.support import waits


@pytest.fixture(params=["local", "memory", "s3"])
def place(request, tmp_path):
    """(store, an empty location in it): the kind chosen by `store_for`, as every caller gets it."""
    if request.param == "local":
        base: str | os.PathLike = tmp_path / "store"
    elif request.param == "memory":
        base = f"memory://bucket-{uuid.uuid4().hex[:12]}/prefix"
    else:
        s3 = request.getfixturevalue("s3_server")
        bucket = f"b-{uuid.uuid4().hex[:12]}"
        s3.make_bucket(bucket)
        base = f"s3://{bucket}/prefix"
    store = storage.store_for(base)
    assert type(store) is (storage.LocalStore if request.param == "local" else storage.FsspecStore)
    yield store, base
    if request.param == "memory":
        store.remove(base, recursive=True)


def test_object_store_interface_store_for_decides_the_kind_once(tmp_path):
    assert type(storage.store_for(tmp_path)) is storage.LocalStore
    assert type(storage.store_for(str(tmp_path / "x"))) is storage.LocalStore
    assert type(storage.store_for("memory://b/x")) is storage.FsspecStore
    assert type(storage.store_for("hf://org/repo")) is storage.HubStore
    assert storage.store_for(tmp_path).local and not storage.store_for("memory://b/x").local
    with pytest.raises(storage.StoreError, match="credentials"):
        storage.store_for("s3://key:secret@bucket/x")
    with pytest.raises(storage.StoreError, match="no storage library"):
        storage.store_for("nosuchproto://b/x")


def test_object_store_interface_round_trips(place, tmp_path):
    store, base = place
    obj = store.join(base, "run", "a.bin")
    assert not store.exists(obj) and store.list_names(base) == []
    with pytest.raises(FileNotFoundError):
        store.read_bytes(obj)
    store.write_bytes(obj, b"first")
    store.write_bytes(obj, b"second, longer")  # a write replaces the object whole
    assert store.read_bytes(obj) == b"second, longer" and store.size(obj) == len(b"second, longer")
    assert store.exists(obj) and store.name(obj) == "a.bin" and store.parent(obj) == store.join(base, "run")
    src = tmp_path / "src.bin"
    src.write_bytes(os.urandom(1 << 20))
    store.put_file(src, store.join(base, "run", "big.bin"))
    store.get_file(store.join(base, "run", "big.bin"), tmp_path / "back.bin")
    assert (tmp_path / "back.bin").read_bytes() == src.read_bytes()
    store.write_bytes(store.join(base, "other"), b"")
    assert store.list_names(base) == ["other", "run"]
    assert store.list_names(store.join(base, "run")) == ["a.bin", "big.bin"]
    assert store.list_names(store.join(base, "absent")) == []
    store.remove(obj)
    store.remove(obj)  # removing what is gone is no error
    assert not store.exists(obj) and store.list_names(store.join(base, "run")) == ["big.bin"]
    store.remove(store.join(base, "run"), recursive=True)
    assert store.list_names(base) == ["other"]


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(objects=st.dictionaries(st.from_regex(r"[a-z0-9][a-z0-9._-]{0,15}", fullmatch=True).filter(
           lambda n: ".." not in n and not is_temp_name(n)), st.binary(max_size=2048), min_size=1, max_size=5))
def test_object_store_interface_holds_what_was_written(place, objects):
    """Any set of names and contents: listed, read back byte for byte, gone after removal."""
    store, base = place
    where = store.join(base, uuid.uuid4().hex[:8])
    for n, data in objects.items():
        store.write_bytes(store.join(where, n), data)
    assert store.list_names(where) == sorted(objects)
    assert {n: store.read_bytes(store.join(where, n)) for n in objects} == objects
    store.remove(where, recursive=True)
    assert store.list_names(where) == [] and not any(store.exists(store.join(where, n)) for n in objects)


def test_object_store_interface_a_reader_never_sees_a_partial_object(place):
    """Writers replace one object with whole versions (each byte the version's number) while readers
    read it and list its prefix: every read is one whole version, every listing names the object alone."""
    store, base = place
    obj = store.join(base, "marker")
    size = 1 << 20
    store.write_bytes(obj, bytes([0]) * size)
    seen, bad, done = set(), [], threading.Event()

    def read():
        while not done.is_set():
            data = store.read_bytes(obj)
            if len(data) != size or len(set(data)) != 1:
                bad.append(f"{len(data)} bytes, {len(set(data))} distinct values")
            if data:
                seen.add(data[0])
            names = store.list_names(base)
            if names != ["marker"]:
                bad.append(f"listing {names}")

    readers = [threading.Thread(target=read) for _ in range(2)]
    for t in readers:
        t.start()
    try:
        for version in range(1, 13):
            store.write_bytes(obj, bytes([version]) * size)
            if version % 4 == 0:  # the readers keep up: they read between the writes, not only after them
                give_up = time.monotonic() + waits.scaled(30)
                while version not in seen and time.monotonic() < give_up:
                    time.sleep(0.001)
    finally:
        done.set()
        for t in readers:
            t.join()
    assert bad == []
    assert {4, 8, 12} <= seen


def test_object_store_interface_local_write_that_fails_leaves_nothing(tmp_path, monkeypatch):
    """A local write cut half-way: the old object stays whole, no temporary is left or listed."""
    store = storage.store_for(tmp_path)
    obj = tmp_path / "d" / "obj"
    store.write_bytes(obj, b"old")
    src = tmp_path / "src"
    src.write_bytes(b"x" * 10_000)

    def half(fsrc, fdst, length=0):
        fdst.write(fsrc.read(5_000))
        raise OSError(28, "No space left on device (simulated)")

    monkeypatch.setattr(shutil, "copyfileobj", half)
    with pytest.raises(OSError, match="No space"):
        store.put_file(src, obj)
    assert obj.read_bytes() == b"old" and sorted(os.listdir(obj.parent)) == ["obj"]


def test_object_store_interface_local_modes_and_hidden_temporaries(tmp_path):
    """A LocalStore made with modes writes exactly them whatever the umask, directories on the way
    included; a write in flight (fsutil's temporary) is not listed."""
    store = storage.store_for(tmp_path, file_mode=0o644, dir_mode=0o755)
    old = os.umask(0o077)
    try:
        store.write_bytes(tmp_path / "a" / "b" / "obj", b"x")
        store.put_file(tmp_path / "a" / "b" / "obj", tmp_path / "a" / "c" / "copy")
    finally:
        os.umask(old)
    assert [oct(os.stat(p).st_mode & 0o777) for p in (tmp_path / "a", tmp_path / "a" / "b", tmp_path / "a" / "c")] \
        == ["0o755"] * 3
    assert {oct(os.stat(p).st_mode & 0o777) for p in (tmp_path / "a" / "b" / "obj", tmp_path / "a" / "c" / "copy")} \
        == {"0o644"}
    (tmp_path / "a" / "b" / f".obj.0123abcd.tmp-{os.getpid()}").write_bytes(b"in flight")
    assert store.list_names(tmp_path / "a" / "b") == ["obj"]


def test_object_store_interface_hub_refuses_writes_clearly(tmp_path):
    """The Hub is read-only here: every write says so (before any network access), and the contract's
    writers (pins) leave it alone."""
    store = storage.store_for("hf://org/drafter@0123456789abcdef0123456789abcdef01234567")
    assert store.read_only and not store.local
    src = tmp_path / "f"
    src.write_bytes(b"x")
    url = "hf://org/drafter@0123456789abcdef0123456789abcdef01234567/COMPLETE.json"
    for write in (lambda: store.write_bytes(url, b"{}"), lambda: store.put_file(src, url),
                  lambda: store.remove(url), lambda: store.remove("hf://org/drafter", recursive=True)):
        with pytest.raises(storage.StoreError, match=r"hf://org/drafter.*read-only here \(nothing is uploaded, "
                                                     r"pinned or removed\)"):
            write()
    hub_ck = "hf://org/drafter@0123456789abcdef0123456789abcdef01234567"
    assert pin_checkpoint(hub_ck, "job-1") is False and unpin_checkpoint(hub_ck, "job-1") is False
    assert is_pinned(hub_ck) is False


def test_object_store_interface_pins_are_written_once_for_every_kind(place):
    """Pins through the contract on each kind: only a marked checkpoint is pinned, unpinning twice is no error."""
    store, base = place
    ck = store.join(base, "run", "step-00000001")
    assert pin_checkpoint(ck, "job-1") is False  # no marker: nothing to protect
    store.write_bytes(store.join(ck, "COMPLETE.json"), b"{}")
    assert pin_checkpoint(ck, "job-1") and is_pinned(ck)
    assert store.list_names(store.join(ck, ".pins")) == ["job-1"]
    assert unpin_checkpoint(ck, "job-1") and not is_pinned(ck)
    assert unpin_checkpoint(ck, "job-1") is False
