"""The worker's local copies of checkpoints published in an object store.

A checkpoint in a store is downloaded into `<cache>/<key>/`, where `key` is the sha256 of
its COMPLETE.json bytes (the manifest digest): the same checkpoint evaluated by two jobs
is downloaded once, and a checkpoint republished under the same URL with other weights
gets a new entry. Every file's sha256 is checked against the manifest before the entry
counts: the files land in a temporary directory, are hashed, and only then get the marker
and are renamed into place, so a partial or corrupt download is never evaluated. A
mismatch or a transfer error is retried (`attempts`); a file that keeps hashing wrong is
a corrupt object (CheckpointError, not retryable); a store that keeps failing is
StoreUnavailable (retryable: RQ tries the job again later).

Entries are evicted least recently used first once the cache holds more than `max_bytes`.
An entry in use (a job evaluating from it, in this process or another worker sharing the
cache) holds a shared `flock` on `<cache>/.<key>.lock` and is never evicted; downloads take
the same lock exclusively, so two workers fetching the same checkpoint download it once.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Iterator

from . import storage
from .fsutil import atomic_write_bytes, pid_alive
from .publication import MARKER_NAME, CheckpointError, parse_manifest, read_marker, sha256_file

log = logging.getLogger("dflash_train.checkpoint_cache")

DEFAULT_MAX_BYTES = 20 * 2**30
_USED = ".used"


class CheckpointCache:
    def __init__(self, root: str | Path, max_bytes: int = DEFAULT_MAX_BYTES, attempts: int = 3):
        self.root = Path(root)
        self.max_bytes = int(max_bytes)
        self.attempts = max(1, int(attempts))
        self.downloads = 0  # entries downloaded by this object (tests, logs)
        self.hits = 0

    @staticmethod
    def key(raw_marker: bytes) -> str:
        return hashlib.sha256(raw_marker).hexdigest()

    @contextlib.contextmanager
    def checkout(self, url: str, raw_marker: bytes | None = None) -> Iterator[tuple[Path, dict]]:
        """(local directory, manifest) of the checkpoint at `url`, downloaded and verified if
        not cached yet; the entry cannot be evicted until the block ends.

        `raw_marker`: the COMPLETE.json bytes the caller has already read (and checked
        against its job); the copy is of exactly that publication.
        """
        if raw_marker is None:
            raw_marker = read_marker(url)
        manifest = parse_manifest(raw_marker, url)
        if manifest.get("source"):  # it would point the worker at one of its own paths
            raise CheckpointError(f"{storage.redact(url)}: a checkpoint in a store cannot be an import record "
                                  "(its manifest names a local source directory)")
        key = self.key(raw_marker)
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        entry = self.root / key
        fd = os.open(self.root / f".{key}.lock", os.O_CREAT | os.O_RDWR, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            if self._complete(entry, raw_marker, manifest):
                self.hits += 1
            else:
                t0 = time.monotonic()
                self._download(url, manifest, raw_marker, entry)
                self.downloads += 1
                log.info("downloaded %s (%d files, %.1f MB) in %.1fs", storage.redact(url), len(manifest["files"]),
                         _size(entry) / 1e6, time.monotonic() - t0)
            (entry / _USED).touch()  # last use, for eviction
            fcntl.flock(fd, fcntl.LOCK_SH)  # readers share it; eviction needs it exclusively
            self.evict(keep=key)
            yield entry, manifest
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def _complete(self, entry: Path, raw: bytes, manifest: dict) -> bool:
        """An entry counts when its marker is the same publication and every file is there at its size."""
        try:
            if (entry / MARKER_NAME).read_bytes() != raw:
                return False
        except OSError:
            return False
        return all((entry / n).is_file() for n in manifest["files"])

    def _download(self, url: str, manifest: dict, raw: bytes, entry: Path) -> None:
        store = storage.store_for(url)
        tmp = self.root / f".{entry.name}.tmp-{os.getpid()}"
        problem: Exception | None = None
        for attempt in range(1, self.attempts + 1):
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(mode=0o700)
            try:
                bad = []
                for file_name, want in sorted(manifest["files"].items()):
                    store.get_file(storage.join(url, file_name), tmp / file_name)
                    got = sha256_file(tmp / file_name)
                    if got != want:
                        bad.append(f"{file_name} (manifest {want[:12]}..., downloaded {got[:12]}...)")
                if not bad:
                    atomic_write_bytes(tmp / MARKER_NAME, raw)
                    (tmp / _USED).touch()
                    if entry.exists():  # a leftover that did not pass _complete
                        shutil.rmtree(entry)
                    os.rename(tmp, entry)
                    return
                problem = CheckpointError(f"{storage.redact(url)}: digest mismatch after download: {', '.join(bad)}; "
                                          "the object in the store is modified or corrupt")
            except (storage.StoreUnavailable, OSError) as e:
                problem = e
            log.warning("download %d/%d of %s failed: %s", attempt, self.attempts, storage.redact(url), problem)
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(problem, CheckpointError):
            raise problem
        raise storage.StoreUnavailable(f"{storage.redact(url)}: download failed {self.attempts} times: {problem}") \
            from problem

    def entries(self) -> list[Path]:
        return [p for p in self.root.iterdir() if p.is_dir() and not p.name.startswith(".")] \
            if self.root.is_dir() else []

    def evict(self, keep: str | None = None) -> list[Path]:
        """Remove least recently used entries (not `keep`, none in use) until the cache fits
        in `max_bytes`; also leftovers of dead downloads. Returns the removed entries."""
        for p in self.root.iterdir() if self.root.is_dir() else ():
            pid = p.name.rpartition(".tmp-")[2]
            if p.name.startswith(".") and pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
                shutil.rmtree(p, ignore_errors=True)
        sized = [(p, _size(p)) for p in self.entries()]
        total = sum(s for _, s in sized)
        removed = []
        for p, s in sorted(sized, key=lambda e: _last_used(e[0])):
            if total <= self.max_bytes:
                break
            if p.name == keep:
                continue
            fd = os.open(self.root / f".{p.name}.lock", os.O_CREAT | os.O_RDWR, 0o600)
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # in use
                with contextlib.suppress(FileNotFoundError):
                    (p / MARKER_NAME).unlink()  # invalidate first
                shutil.rmtree(p, ignore_errors=True)
                total -= s
                removed.append(p)
            finally:
                os.close(fd)
        return removed

    def size(self) -> int:
        return sum(_size(p) for p in self.entries())


def _size(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.iterdir() if f.is_file())


def _last_used(directory: Path) -> float:
    try:
        return (directory / _USED).stat().st_mtime
    except OSError:
        return 0.0
