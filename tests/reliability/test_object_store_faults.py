"""The worker's checkpoint cache and the object-store transport under faults (a real moto S3
server over HTTP, behind a loopback fault proxy where the transport is the subject).

Covered: a cache hit whose bytes were replaced (`cache_tamper`), a corrupt entry that must not
stick (`sticky_cache`), a full cache disk (`cache_enospc`: a real small tmpfs), an object listed
by COMPLETE.json but missing from the store (`missing_object`), and connections cut mid-body,
stalled or answered 5xx (`transport_error`, tests/support/fault_proxy.py).

Select with `pytest -k "cache_tamper or sticky_cache or cache_enospc or missing_object or transport_error"`.
"""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import tempfile
import uuid
from pathlib import Path

import pytest

from dflash_train.checkpoints import storage
from dflash_train.checkpoints.publication import (
    MARKER_NAME,
    CheckpointError,
    read_marker,
    sha256_file,
    upload_checkpoint,
)
from dflash_train.common.errors import retryable
from eval_worker.service.worker.checkpoint_cache import CacheDiskFull, CheckpointCache
from tests.support.sidecar_support import publish_random

WEIGHTS = "model.safetensors"


@pytest.fixture
def bucket(s3_server):
    name = f"b-{uuid.uuid4().hex[:12]}"
    s3_server.make_bucket(name)
    return name


def _publish(tmp_path: Path, bucket: str, *steps: int, **kw) -> list[str]:
    return [upload_checkpoint(publish_random(tmp_path / "ck", "run1", s, seed=s, **kw), f"s3://{bucket}/runs/run1")
            for s in steps]


def _intact(entry: Path, manifest: dict) -> bool:
    return all(sha256_file(entry / n) == d for n, d in manifest["files"].items())


def _leftovers(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if ".tmp-" in p.name) if root.is_dir() else []


# --------------------------------------------------------------------------- cache_tamper

def _swap(path: Path, other: Path, how: str) -> None:
    """Put `other`'s bytes at `path`: the ways a file gets replaced on a box."""
    if how == "rewrite":  # in place: same inode, same size
        shutil.copyfile(other, path)
    elif how == "rewrite_keep_mtime":  # in place, mtime put back (cp -p, rsync -t): only ctime tells
        st = path.stat()
        shutil.copyfile(other, path)
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    else:  # "replace": another inode renamed over it
        tmp = path.with_name(".swap")
        shutil.copyfile(other, tmp)
        os.replace(tmp, path)


@pytest.mark.parametrize("how", ["rewrite", "rewrite_keep_mtime", "replace"])
def test_s3_cache_tamper_same_size_weights_are_not_handed_out(tmp_path, bucket, how):
    """A cache entry whose weights were replaced by another checkpoint's valid file of the same
    size is dropped and fetched again: a hit hands out the manifest's bytes or nothing."""
    url1, url6 = _publish(tmp_path, bucket, 1, 6)
    cache = CheckpointCache(tmp_path / "cache")
    with cache.checkout(url6) as (entry6, _):
        pass
    with cache.checkout(url1) as (entry1, manifest1):
        pass
    assert (entry1 / WEIGHTS).stat().st_size == (entry6 / WEIGHTS).stat().st_size  # same size, other bytes
    assert sha256_file(entry1 / WEIGHTS) != sha256_file(entry6 / WEIGHTS)
    _swap(entry1 / WEIGHTS, entry6 / WEIGHTS, how)
    with cache.checkout(url1) as (entry, manifest):
        assert entry == entry1 and manifest == manifest1
        assert _intact(entry, manifest), "the tampered weights were handed out as step 1's"
    assert (cache.downloads, cache.hits, cache.dropped) == (3, 0, 1)


def test_s3_cache_tamper_check_is_cheap_on_an_unchanged_entry(tmp_path, bucket):
    """The stat check vouches for an unchanged entry (no file hashed again on a hit); an entry
    without its stamp (written before there were stamps) is hashed once and then trusted."""
    (url,) = _publish(tmp_path, bucket, 1)
    cache = CheckpointCache(tmp_path / "cache")
    with cache.checkout(url) as (entry, manifest):
        pass
    for _ in range(3):
        with cache.checkout(url):
            pass
    assert (cache.downloads, cache.hits, cache.rehashed) == (1, 3, 0)
    (entry / ".verified.json").unlink()
    for _ in range(2):
        with cache.checkout(url) as (again, _):
            assert _intact(again, manifest)
    assert (cache.downloads, cache.hits, cache.rehashed) == (1, 5, len(manifest["files"]))


def test_s3_cache_tamper_downloads_are_fsynced_before_the_entry_is_renamed(tmp_path, bucket, monkeypatch):
    """A crash right after the rename must not leave an entry whose stamp vouches for bytes that
    never reached the disk: every downloaded file is fsynced before the entry is renamed in
    (a spy on the two calls; the real ones run)."""
    import eval_worker.service.worker.checkpoint_cache as cc
    from dflash_train.common.fsutil import fsync_path as real_fsync

    (url,) = _publish(tmp_path, bucket, 1)
    events = []
    real_rename = os.rename
    monkeypatch.setattr(cc, "fsync_path", lambda p: events.append(("fsync", Path(p).name)) or real_fsync(p),
                        raising=False)
    monkeypatch.setattr(cc.os, "rename", lambda a, b: events.append(("rename", Path(b).name)) or real_rename(a, b))
    cache = CheckpointCache(tmp_path / "cache")
    with cache.checkout(url) as (entry, manifest):
        pass
    renamed = events.index(("rename", entry.name))
    assert {("fsync", n) for n in manifest["files"]} <= set(events[:renamed]), events


# --------------------------------------------------------------------------- sticky_cache

def test_s3_sticky_cache_truncated_entry_is_fetched_again(tmp_path, bucket):
    (url,) = _publish(tmp_path, bucket, 1)
    cache = CheckpointCache(tmp_path / "cache")
    with cache.checkout(url) as (entry, manifest):
        pass
    with open(entry / WEIGHTS, "r+b") as f:
        f.truncate(1000)
    with cache.checkout(url) as (again, _):
        assert _intact(again, manifest)
    assert (cache.downloads, cache.dropped) == (2, 1)


def test_s3_sticky_cache_drop_if_corrupt_needs_the_full_digest(tmp_path, bucket):
    """Bit rot (bytes changed, stat not: here the stamp is rewritten to match, standing for a
    corruption no stat shows): `drop_if_corrupt` hashes, drops the entry, and the next checkout
    downloads it again; an intact entry (a checkpoint that is itself unloadable) is kept."""
    import json

    (url,) = _publish(tmp_path, bucket, 1)
    cache = CheckpointCache(tmp_path / "cache")
    with cache.checkout(url) as (entry, manifest):
        pass
    assert cache.drop_if_corrupt(entry) is None and (entry / MARKER_NAME).exists()  # intact: kept
    assert cache.drop_if_corrupt(tmp_path) is None  # not an entry of this cache
    stamps = json.loads((entry / ".verified.json").read_text())
    with open(entry / WEIGHTS, "r+b") as f:
        f.seek(-3, os.SEEK_END)
        f.write(b"\xff\xfe\xfd")
    st = (entry / WEIGHTS).stat()
    stamps[WEIGHTS].update(mtime_ns=st.st_mtime_ns, ctime_ns=st.st_ctime_ns)
    (entry / ".verified.json").write_text(json.dumps(stamps))
    with cache.checkout(url):  # the stat check cannot see it
        pass
    assert cache.downloads == 1
    assert WEIGHTS in (cache.drop_if_corrupt(entry) or "")
    with cache.checkout(url) as (again, _):
        assert _intact(again, manifest)
    assert cache.downloads == 2


def _job_env(tmp_path, worker_evaluators, prefix: str):
    from eval_worker.service.worker.evaluators import WorkerSettings
    from tests.integration.test_sidecar_worker import _target
    from tests.support.sidecar_support import tiny_target_drafter_config, write_suite

    target = _target()
    cfg, mask = tiny_target_drafter_config(target)
    suites = tmp_path / "suites"
    suites.mkdir()
    suite = write_suite(suites / "s.jsonl", n_prompts=1, max_new_tokens=6)
    settings = WorkerSettings(results_dir=tmp_path / "results", roots=[prefix], suite_roots=[suites],
                              cache_dir=tmp_path / "engine-cache", default_target=str(target),
                              checkpoint_cache_dir=tmp_path / "ckcache")
    worker_evaluators(settings)
    return cfg, mask, suite


def test_s3_sticky_cache_job_recovers_from_a_corrupt_entry(tmp_path, bucket, worker_evaluators, caplog):
    """The job function, real engine: a truncated entry used to fail every job of that
    checkpoint ("weights file is corrupt or truncated", not retried); now the next job fetches
    the intact copy and is recorded. A corruption only the load sees (stat unchanged) is
    re-hashed, dropped and fetched once more within the same job."""
    import json

    from eval_worker.service.jobs.builder import make_job
    from eval_worker.service.worker import evaluators
    from eval_worker.service.worker.eval_job import run_eval_job

    prefix = f"s3://{bucket}/runs"
    cfg, mask, suite = _job_env(tmp_path, worker_evaluators, prefix)
    (url,) = _publish(tmp_path, bucket, 1, target_config=cfg, mask_token_id=mask)
    job = make_job(url, suite=str(suite), roots=[prefix])
    first = run_eval_job(job.to_json())  # the RQ job function: JSON in
    assert first["recorded_now"]
    cache = evaluators.current().checkpoint_cache()
    (entry,) = cache.entries()
    with open(entry / WEIGHTS, "r+b") as f:
        f.truncate(200)
    second = run_eval_job({**job.to_json(), "attempt": 1})
    assert second["recorded_now"] and second["ledger_path"] != first["ledger_path"]
    assert cache.downloads == 2
    # stat-preserving damage: the load fails, the full digest finds it, one more fetch, recorded
    stamps = json.loads((entry / ".verified.json").read_text())
    with open(entry / WEIGHTS, "r+b") as f:
        f.write(b"\xff" * 8)  # the safetensors header length: unloadable
    st = (entry / WEIGHTS).stat()
    stamps[WEIGHTS].update(mtime_ns=st.st_mtime_ns, ctime_ns=st.st_ctime_ns)
    (entry / ".verified.json").write_text(json.dumps(stamps))
    with caplog.at_level(logging.WARNING):
        third = run_eval_job({**job.to_json(), "attempt": 2})
    assert third["recorded_now"] and cache.downloads == 3
    assert "failed to load" in caplog.text and WEIGHTS in caplog.text
    records = [json.loads(Path(r["ledger_path"]).read_text()) for r in (first, second, third)]
    assert {r["result"]["checkpoint"]["digest"] for r in records} == {job.checkpoint_digest}
    assert len({r["result"]["tau"]["macro"] for r in records}) == 1  # the same weights, the same τ


# --------------------------------------------------------------------------- cache_enospc

def _can_mount() -> str | None:
    from tests.support.soak import can_mount

    return can_mount()


@contextlib.contextmanager
def _small_fs(size: str):
    why = _can_mount()
    if why:
        pytest.skip(f"a full cache disk needs a real small filesystem: {why}")
    d = Path(tempfile.mkdtemp(prefix="ckcache-fs-"))
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(d)], check=True, timeout=30)
    try:
        yield d
    finally:
        subprocess.run(["umount", "-l", str(d)], check=False, timeout=30)
        with contextlib.suppress(OSError):
            d.rmdir()


def _fill(directory: Path, leave: int) -> Path:
    """Fill the filesystem of `directory` until about `leave` bytes are free."""
    ballast = directory / "ballast"
    with open(ballast, "wb") as f:
        free = shutil.disk_usage(directory).free
        if free > leave:
            f.write(b"\0" * (free - leave))
    return ballast


def test_s3_cache_enospc_evicts_idle_entries_lru_first(tmp_path, bucket):
    """A real 512 kB tmpfs holding 4 idle entries and ballast: the next download hits ENOSPC;
    the least recently used idle entry is evicted and the download succeeds (it used to fail
    3 times and then the job). `max_bytes` is far away: only the disk is full."""
    urls = _publish(tmp_path, bucket, 1, 2, 3, 4, 5)
    one = sum(f.stat().st_size for f in (tmp_path / "ck" / "run1" / "step-00000001").iterdir())
    with _small_fs("512k") as fs:
        cache = CheckpointCache(fs / "cache", max_bytes=2**40)
        entries = []
        for url in urls[:4]:
            with cache.checkout(url) as (e, _):
                entries.append(e)
        with cache.checkout(urls[1]):  # entry 2 used again: entry 1 is now the least recently used
            pass
        _fill(fs, leave=one // 3)
        with cache.checkout(urls[4]) as (e5, manifest):
            assert _intact(e5, manifest)
        assert cache.evicted_for_space >= 1
        assert not entries[0].exists() and entries[1].exists()  # LRU first
        assert _leftovers(fs / "cache") == []


def test_s3_cache_enospc_with_every_entry_in_use_is_a_clear_retryable_error(tmp_path, bucket):
    urls = _publish(tmp_path, bucket, 1, 2)
    one = sum(f.stat().st_size for f in (tmp_path / "ck" / "run1" / "step-00000001").iterdir())
    with _small_fs("256k") as fs:
        cache = CheckpointCache(fs / "cache", max_bytes=2**40)
        with cache.checkout(urls[0]) as (held, _):
            ballast = _fill(fs, leave=one // 3)
            with pytest.raises(CacheDiskFull, match="disk is full .* no idle entry is left to evict") as e:
                with cache.checkout(urls[1]):
                    pass
            assert retryable(e.value) and held.exists()
            assert _leftovers(fs / "cache") == []
        ballast.unlink()  # space is back: the same request succeeds
        with cache.checkout(urls[1]) as (entry, manifest):
            assert _intact(entry, manifest)


# --------------------------------------------------------------------------- missing_object

@pytest.mark.parametrize("missing", ["config.json", WEIGHTS])
def test_s3_missing_object_is_a_permanent_error_naming_the_file(tmp_path, bucket, missing):
    (url,) = _publish(tmp_path, bucket, 1)
    storage.store_for(url).remove(f"{url}/{missing}")
    cache = CheckpointCache(tmp_path / "cache", attempts=3)
    gets = []
    real = storage.FsspecStore.get_file

    def counting(self, src, dest):  # a spy only: the real download runs
        gets.append(src)
        return real(self, src, dest)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(storage.FsspecStore, "get_file", counting)
        with pytest.raises(CheckpointError, match=f"{missing}, listed in its COMPLETE.json, is missing") as e:
            with cache.checkout(url):
                pass
    assert not retryable(e.value)
    assert gets.count(f"{url}/{missing}") == 1  # not downloaded 3 times
    assert cache.entries() == [] and _leftovers(tmp_path / "cache") == []


def test_s3_missing_object_fails_the_job_once_with_the_name(tmp_path, bucket, worker_evaluators):
    from eval_worker.service.jobs.builder import make_job
    from eval_worker.service.jobs.schema import JobError
    from eval_worker.service.worker.eval_job import run_eval_job

    prefix = f"s3://{bucket}/runs"
    cfg, mask, suite = _job_env(tmp_path, worker_evaluators, prefix)
    (url,) = _publish(tmp_path, bucket, 1, target_config=cfg, mask_token_id=mask)
    job = make_job(url, suite=str(suite), roots=[prefix])
    storage.store_for(url).remove(f"{url}/config.json")
    with pytest.raises(JobError, match="config.json, listed in its COMPLETE.json, is missing from the store") as e:
        run_eval_job(job.to_json())
    assert not retryable(e.value)


# --------------------------------------------------------------------------- transport_error

@pytest.fixture
def proxy(s3_server, monkeypatch):
    """The store reached through a FaultProxy, with short client timeouts and few retries
    (fsspec's configuration, as an operator would set it with FSSPEC_S3_* variables)."""
    import fsspec.config
    import s3fs

    from tests.support.fault_proxy import FaultProxy

    with FaultProxy(s3_server.port) as p:
        monkeypatch.setenv("AWS_ENDPOINT_URL", p.endpoint)
        monkeypatch.setitem(fsspec.config.conf, "s3", {
            "config_kwargs": {"connect_timeout": 2, "read_timeout": 2,
                              "retries": {"max_attempts": 2, "mode": "standard"}}})
        monkeypatch.setattr(s3fs.S3FileSystem, "retries", 2)  # s3fs's own retries (a class setting, default 5)
        storage._filesystem.cache_clear()
        try:
            yield p
        finally:
            storage._filesystem.cache_clear()


# the stall waits out a read timeout (~13 s): CI's slow pass
@pytest.mark.parametrize("fault", ["cut", pytest.param("stall", marks=pytest.mark.slow), "5xx"])
def test_s3_transport_error_is_store_unavailable_and_leaves_nothing(tmp_path, bucket, proxy, fault):
    """Each transport fault, on the real client stack: the store's error is StoreUnavailable
    (retryable), the cache uses its own attempts, no temporary directory stays behind, and the
    same checkout succeeds once the store answers again."""
    (url,) = _publish(tmp_path, bucket, 1)
    raw = read_marker(url)
    proxy.fault = fault
    with pytest.raises(storage.StoreUnavailable) as e:
        storage.store_for(url).get_file(f"{url}/{WEIGHTS}", tmp_path / "direct")
    assert retryable(e.value)
    # the reason names what happened: the cut, the timeout, or the 503 answer's message
    assert {"cut": "ClientPayloadError", "stall": "Timeout", "5xx": "fault proxy"}[fault] in str(e.value), e.value
    cache = CheckpointCache(tmp_path / "cache", attempts=2)
    with pytest.raises(storage.StoreUnavailable, match="download failed 2 times"):
        with cache.checkout(url, raw):
            pass
    assert proxy.counts[fault] >= 3  # the direct call and both of the cache's attempts met the fault
    assert _leftovers(tmp_path / "cache") == [] and cache.entries() == []
    proxy.fault = "pass"
    with cache.checkout(url, raw) as (entry, manifest):
        assert _intact(entry, manifest)


def test_s3_transport_error_mapping_covers_the_library_errors():
    """The classes the store libraries raise on a broken transport are all mapped."""
    import aiohttp
    import botocore.exceptions

    errors = storage.transport_errors()
    for cls in (aiohttp.ClientPayloadError, aiohttp.ServerDisconnectedError, aiohttp.ClientConnectionError,
                botocore.exceptions.ReadTimeoutError, botocore.exceptions.ConnectionClosedError,
                botocore.exceptions.ClientError, TimeoutError, ConnectionResetError):
        assert issubclass(cls, errors), cls
