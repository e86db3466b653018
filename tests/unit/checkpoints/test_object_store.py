"""The checkpoint contract on an object store (a real S3-compatible server: moto in a subprocess).

Select with `pytest -k "object_store or s3"`.
"""
import json
import threading
import uuid

import pytest
from hypothesis import given
from hypothesis import strategies as st

from dflash_train.checkpoints import storage
from dflash_train.checkpoints.publication import (
    MARKER_NAME,
    CheckpointError,
    apply_retention,
    cleanup_incomplete,
    is_pinned,
    list_checkpoints,
    pin_checkpoint,
    read_manifest,
    read_marker,
    sha256_file,
    unpin_checkpoint,
    upload_checkpoint,
)
from eval_worker.service.worker.checkpoint_cache import CheckpointCache
from tests.support.sidecar_support import publish_random


@pytest.fixture
def bucket(s3_server):
    name = f"b-{uuid.uuid4().hex[:12]}"
    s3_server.make_bucket(name)
    return name


def _objects(url: str) -> list[str]:
    store = storage.store_for(url)
    return sorted(p.split("/", 1)[1] for p in store.fs.find(url.split("://", 1)[1]))


def test_s3_upload_then_read_list_and_pins(tmp_path, bucket):
    local = publish_random(tmp_path / "ck", "run1", 100)
    url = upload_checkpoint(local, f"s3://{bucket}/runs/run1")
    assert url == f"s3://{bucket}/runs/run1/step-00000100"
    assert read_marker(url) == (local / MARKER_NAME).read_bytes()  # the marker, byte for byte
    assert read_manifest(url) == read_manifest(local)
    assert _objects(f"s3://{bucket}") == [f"runs/run1/step-00000100/{n}"
                                          for n in ("COMPLETE.json", "config.json", "model.safetensors")]
    assert list_checkpoints(f"s3://{bucket}/runs/run1") == [url]
    with pytest.raises(CheckpointError, match="already published"):
        upload_checkpoint(local, f"s3://{bucket}/runs/run1")
    assert not is_pinned(url)
    assert pin_checkpoint(url, "job-1") and is_pinned(url)
    assert not pin_checkpoint(f"s3://{bucket}/runs/run1/step-00000200", "job-1")  # no such checkpoint
    assert unpin_checkpoint(url, "job-1") and not is_pinned(url)
    assert not unpin_checkpoint(url, "job-1")


@pytest.mark.parametrize("files_uploaded", [0, 1, 2])  # 2: both files are up, the marker write fails
def test_s3_interrupted_upload_leaves_no_checkpoint(tmp_path, bucket, monkeypatch, files_uploaded):
    """The marker goes last: an upload cut after any number of files is not a checkpoint to
    any reader, and the next run's cleanup removes it."""
    local = publish_random(tmp_path / "ck", "run1", 100)
    real_put, real_create, calls = storage.FsspecStore.put_file, storage.FsspecStore.create_bytes, []

    def cut(real):
        def write(self, src, url):
            if len(calls) == files_uploaded:  # the connection drops before this write
                raise storage.StoreUnavailable("connection reset (simulated interruption)")
            calls.append(url)
            return real(self, src, url)
        return write

    monkeypatch.setattr(storage.FsspecStore, "put_file", cut(real_put))
    monkeypatch.setattr(storage.FsspecStore, "create_bytes",  # the marker (the upload lease is not cut)
                        lambda self, url, data: cut(real_create)(self, url, data) if url.endswith(MARKER_NAME)
                        else real_create(self, url, data))
    run_url = f"s3://{bucket}/runs/run1"
    with pytest.raises(storage.StoreUnavailable):
        upload_checkpoint(local, run_url)
    monkeypatch.undo()
    step_url = f"{run_url}/step-00000100"
    assert all(not o.endswith(MARKER_NAME) for o in _objects(f"s3://{bucket}"))
    with pytest.raises(CheckpointError, match="no COMPLETE.json"):
        read_manifest(step_url)
    assert list_checkpoints(run_url) == []
    with pytest.raises(CheckpointError, match="no COMPLETE.json"):
        with CheckpointCache(tmp_path / "cache").checkout(step_url):
            pass
    removed = cleanup_incomplete(run_url)
    assert removed == ([step_url] if files_uploaded else [])
    assert _objects(f"s3://{bucket}") == []
    assert upload_checkpoint(local, run_url) == step_url  # and the step can be published again


def test_s3_cache_downloads_once_verifies_and_survives_restart(tmp_path, bucket):
    local = publish_random(tmp_path / "ck", "run1", 100)
    url = upload_checkpoint(local, f"s3://{bucket}/runs/run1")
    cache = CheckpointCache(tmp_path / "cache")
    with cache.checkout(url) as (first, manifest):
        assert manifest == read_manifest(local)
        for n, digest in manifest["files"].items():
            assert sha256_file(first / n) == digest
    with cache.checkout(url) as (second, _):
        assert second == first
    assert (cache.downloads, cache.hits) == (1, 1)
    again = CheckpointCache(tmp_path / "cache")  # another worker process on the same cache
    with again.checkout(url) as (third, _):
        assert third == first
    assert (again.downloads, again.hits) == (0, 1)
    assert first.name == CheckpointCache.key(read_marker(url))


def test_s3_corrupted_object_is_detected_by_digest(tmp_path, bucket):
    local = publish_random(tmp_path / "ck", "run1", 100)
    url = upload_checkpoint(local, f"s3://{bucket}/runs/run1")
    store = storage.store_for(url)
    data = bytearray(store.read_bytes(f"{url}/model.safetensors"))
    data[-3] ^= 0xFF
    store.write_bytes(f"{url}/model.safetensors", bytes(data))
    cache = CheckpointCache(tmp_path / "cache", attempts=2)
    with pytest.raises(CheckpointError, match="digest mismatch after download: model.safetensors"):
        with cache.checkout(url):
            pass
    assert cache.entries() == [] and not any(p.name.startswith(".") and p.is_dir()
                                             for p in (tmp_path / "cache").iterdir())


def test_s3_download_corrupted_in_transit_is_retried(tmp_path, bucket, monkeypatch):
    local = publish_random(tmp_path / "ck", "run1", 100)
    url = upload_checkpoint(local, f"s3://{bucket}/runs/run1")
    real_get, seen = storage.FsspecStore.get_file, []

    def get_file(self, src, dest):
        real_get(self, src, dest)
        seen.append(src)
        if len(seen) == 1:  # the first file of the first attempt arrives damaged
            with open(dest, "r+b") as f:
                f.write(b"\0\0\0\0")

    monkeypatch.setattr(storage.FsspecStore, "get_file", get_file)
    cache = CheckpointCache(tmp_path / "cache")
    with cache.checkout(url) as (entry, manifest):
        assert all(sha256_file(entry / n) == d for n, d in manifest["files"].items())
    assert len(seen) == 2 * len(manifest["files"])  # the whole copy was fetched again


def test_s3_cache_evicts_by_size_but_not_entries_in_use(tmp_path, bucket):
    urls = [upload_checkpoint(publish_random(tmp_path / "ck", "run1", step, seed=step), f"s3://{bucket}/runs/run1")
            for step in (1, 2, 3)]
    one = sum(f.stat().st_size for f in (tmp_path / "ck" / "run1" / "step-00000001").iterdir() if f.is_file())
    cache = CheckpointCache(tmp_path / "cache", max_bytes=int(one * 1.5))  # room for one entry
    with cache.checkout(urls[0]) as (e0, _):
        with cache.checkout(urls[1]) as (e1, _):  # over budget, but e0 is in use: kept
            assert e0.exists() and e1.exists()
        assert e1.exists()
    with cache.checkout(urls[2]) as (e2, _):  # now the least recently used go
        assert e2.exists() and not e0.exists() and not e1.exists()
    assert cache.size() <= cache.max_bytes
    with cache.checkout(urls[0]):
        pass
    assert cache.downloads == 4  # the evicted one came back by downloading again


def test_s3_two_workers_sharing_a_cache_download_once(tmp_path, bucket):
    url = upload_checkpoint(publish_random(tmp_path / "ck", "run1", 7), f"s3://{bucket}/runs/run1")
    caches = [CheckpointCache(tmp_path / "cache") for _ in range(3)]
    errors = []

    def run(c):
        try:
            with c.checkout(url):
                pass
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=run, args=(c,)) for c in caches]
    [t.start() for t in threads]
    [t.join(60) for t in threads]
    assert not errors and sum(c.downloads for c in caches) == 1


def test_s3_retention_and_pins_work_on_the_store(tmp_path, bucket):
    run_url = f"s3://{bucket}/runs/run1"
    urls = [upload_checkpoint(publish_random(tmp_path / "ck", "run1", s), run_url) for s in (1, 2, 3, 4)]
    assert pin_checkpoint(urls[0], "job-a")
    assert apply_retention(run_url, keep_last=2, protect=lambda p: p == urls[1]) == []
    removed = apply_retention(run_url, keep_last=2)
    assert removed == [urls[1]]
    assert list_checkpoints(run_url) == [urls[0], urls[2], urls[3]]
    assert not any(o.startswith("runs/run1/step-00000002") for o in _objects(f"s3://{bucket}"))
    unpin_checkpoint(urls[0], "job-a")
    assert apply_retention(run_url, keep_last=2) == [urls[0]]


def test_s3_manifest_with_a_path_in_files_is_refused(tmp_path, bucket):
    """A remote manifest names the files the worker writes into its cache: only plain names."""
    local = publish_random(tmp_path / "ck", "run1", 1)
    url = upload_checkpoint(local, f"s3://{bucket}/runs/run1")
    m = json.loads(read_marker(url))
    m["files"]["../../escape"] = "0" * 64
    storage.store_for(url).write_bytes(f"{url}/{MARKER_NAME}", json.dumps(m).encode())
    with pytest.raises(CheckpointError, match="plain file names"):
        read_manifest(url)


# ------------------------------------------------------------------ URL rules (no server)

def test_object_store_url_rules():
    assert storage.is_url("s3://b/x") and storage.is_url("hf://org/repo") and not storage.is_url("/a/b")
    assert not storage.is_url("file:///a/b") and not storage.is_url("relative/path")
    assert storage.check_url("s3://b/runs/") == "s3://b/runs"
    for bad, why in [("s3://key:secret@b/x", "credentials"), ("s3://b/../x", "segments"), ("s3://b//x", "segments"),
                     ("s3://b/x?versionId=1", "query"), ("s3:///x", "segments"), ("s3://b/\x00", "invalid")]:
        with pytest.raises(storage.StoreError, match=why):
            storage.check_url(bad)
    assert "secret" not in storage.redact("s3://key:secret@b/x")
    with pytest.raises(storage.StoreError, match="no storage library"):
        storage.store_for("nosuchproto://b/x")


_seg = st.text(alphabet="abcxyz0-._", min_size=1, max_size=6).filter(lambda s: s not in (".", ".."))


@given(root=st.lists(_seg, min_size=1, max_size=3), rest=st.lists(_seg, min_size=0, max_size=3),
       other=st.lists(_seg, min_size=1, max_size=4))
def test_object_store_prefix_confinement_is_by_whole_segments(root, rest, other):
    prefix = "s3://" + "/".join(root)
    inside = "/".join([prefix] + rest)
    assert storage.within_prefixes(inside, [prefix]) == inside
    assert storage.within_prefixes(inside, [prefix.replace("s3://", "gs://")]) is None  # protocol counts
    candidate = "s3://" + "/".join(other)
    expected = other[:len(root)] == root
    assert (storage.within_prefixes(candidate, [prefix]) is not None) == expected
    assert storage.within_prefixes(prefix + "-old/x", [prefix]) is None
    assert storage.within_prefixes(prefix + "/../escape", [prefix]) is None
