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

A hit proves its bytes: each file's size, mtime, ctime, inode and device are kept beside the
entry (`.verified.json`) with the sha256 it had when it was verified; a file whose stat differs
(replaced, rewritten, truncated) is hashed again, and an entry whose bytes are not the
manifest's is dropped and downloaded again (never handed out). A load that fails anyway (a
bit flip no stat shows) is answered by `drop_if_corrupt`: the full digest decides, and a
corrupt entry is dropped so the job's next try fetches it again. A file listed in the manifest
but missing from the store is a CheckpointError naming it (no retry can bring it back).
Downloaded files are fsynced before the entry is renamed into place; the temporary directory
is removed whatever happens.

Entries are evicted least recently used first once the cache holds more than `max_bytes`, and
when a download finds the disk full (ENOSPC): then idle entries go, oldest first, until the
download fits (CacheDiskFull when nothing idle is left). An entry in use (a job evaluating
from it, in this process or another worker sharing the cache) holds a shared `flock` on
`<cache>/.<key>.lock` and is never evicted; downloads take the same lock exclusively, so two
workers fetching the same checkpoint download it once.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import shutil
import stat
import time
from collections.abc import Iterator
from pathlib import Path

from dflash_train.checkpoints import storage
from dflash_train.checkpoints.publication import MARKER_NAME, CheckpointError, parse_manifest, read_marker, sha256_file
from dflash_train.common.errors import DFlashError
from dflash_train.common.fsutil import atomic_write_bytes, fsync_dir, fsync_path, pid_alive

log = logging.getLogger(__name__)

DEFAULT_MAX_BYTES = 20 * 2**30
_USED = ".used"
_STAMP = ".verified.json"  # {file: {sha256, size, mtime_ns, ctime_ns, ino, dev}} when it was last hashed
_ABSENT = "absent"
_DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


class CacheDiskFull(DFlashError, OSError):
    """The cache's disk is full and no idle entry is left to evict: retryable (space may come back)."""

    retryable = True


class CheckpointCache:
    def __init__(self, root: str | Path, max_bytes: int = DEFAULT_MAX_BYTES, attempts: int = 3):
        self.root = Path(root)
        self.max_bytes = int(max_bytes)
        self.attempts = max(1, int(attempts))
        self.downloads = 0  # entries downloaded by this object (tests, logs)
        self.hits = 0
        self.dropped = 0  # entries found not to hold the manifest's bytes, dropped
        self.rehashed = 0  # files hashed again on a hit (their stat changed since they were verified)
        self.evicted_for_space = 0  # entries evicted because a download found the disk full

    @staticmethod
    def key(raw_marker: bytes) -> str:
        return hashlib.sha256(raw_marker).hexdigest()

    @contextlib.contextmanager
    def checkout(self, url: str, raw_marker: bytes | None = None) -> Iterator[tuple[Path, dict]]:
        """(local directory, manifest) of the checkpoint at `url`, downloaded and verified if
        not cached yet (or if the cached bytes are not the manifest's); the entry cannot be
        evicted until the block ends.

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
            why = self._check(entry, raw_marker, manifest)
            if why is None:
                self.hits += 1
            else:
                if why != _ABSENT:
                    self.dropped += 1
                    log.warning("cache entry %s of %s does not hold the published bytes (%s): dropped, "
                                "downloading it again", key[:12], storage.redact(url), why)
                    _remove(entry)
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

    def _check(self, entry: Path, raw: bytes, manifest: dict) -> str | None:
        """None when `entry` holds exactly the publication `raw` (marker and every file's
        bytes), else why not (`_ABSENT` when there is no entry). Files whose stat is the one
        recorded when they were verified are trusted; any other is hashed again."""
        try:
            if (entry / MARKER_NAME).read_bytes() != raw:
                return "its marker is another publication's"
        except FileNotFoundError:
            return _ABSENT if not entry.exists() else "no marker"
        except OSError as e:
            return f"marker unreadable ({e})"
        stamps, changed = _read_stamps(entry), False
        for name, want in sorted(manifest["files"].items()):
            path = entry / name
            try:
                before = os.stat(path)
            except OSError:
                return f"{name} is missing"
            if not stat.S_ISREG(before.st_mode):
                return f"{name} is not a regular file"
            if stamps.get(name) == _stamp(want, before):
                continue
            # changed since it was verified (or never stamped): the full digest decides
            self.rehashed += 1
            got = sha256_file(path)
            if got != want:
                return f"{name}: sha256 {got[:12]}... where the manifest says {want[:12]}..."
            if os.stat(path) == before:  # not changing under the hash: the stamp may vouch for it
                stamps[name], changed = _stamp(want, before), True
        if changed:
            with contextlib.suppress(OSError):  # a full disk: the next hit hashes again
                atomic_write_bytes(entry / _STAMP, json.dumps(stamps, sort_keys=True).encode(), durable=False)
        return None

    def drop_if_corrupt(self, entry: str | Path) -> str | None:
        """After a load from `entry` failed: hash every file against the entry's manifest; if
        one differs, invalidate the entry (its next checkout downloads it again) and say why;
        None when `entry` is not this cache's or its bytes are the manifest's (the fault is in
        the checkpoint itself, and a download would bring the same bytes)."""
        entry = Path(entry)
        if entry.parent.resolve() != self.root.resolve():
            return None
        try:
            raw = (entry / MARKER_NAME).read_bytes()
            manifest = parse_manifest(raw, str(entry))
        except (OSError, CheckpointError):
            return None
        problem = None
        for name, want in sorted(manifest["files"].items()):
            try:
                got = sha256_file(entry / name)
            except OSError as e:
                problem = f"{name} unreadable ({e})"
                break
            if got != want:
                problem = f"{name}: sha256 {got[:12]}... where the manifest says {want[:12]}..."
                break
        if problem is not None:
            self.dropped += 1
            for n in (MARKER_NAME, _STAMP):  # invalidate: the marker no longer matches any job's
                with contextlib.suppress(FileNotFoundError):
                    (entry / n).unlink()
            log.warning("cache entry %s failed to load and does not hold the published bytes (%s): dropped",
                        entry.name[:12], problem)
        return problem

    def _download(self, url: str, manifest: dict, raw: bytes, entry: Path) -> None:
        store = storage.store_for(url)
        tmp = self.root / f".{entry.name}.tmp-{os.getpid()}"
        problem: Exception | None = None
        attempt = 0
        try:
            while attempt < self.attempts:
                attempt += 1
                shutil.rmtree(tmp, ignore_errors=True)
                try:
                    tmp.mkdir(mode=0o700)
                    bad, stamps = [], {}
                    for file_name, want in sorted(manifest["files"].items()):
                        path = tmp / file_name
                        try:
                            store.get_file(store.join(url, file_name), path)
                        except FileNotFoundError:  # listed by the marker, gone from the store: no retry helps
                            raise CheckpointError(
                                f"{storage.redact(url)}: {file_name}, listed in its {MARKER_NAME}, is missing from "
                                "the store (removed after publication?); the checkpoint cannot be evaluated") from None
                        fsync_path(path)  # on disk before the entry is renamed into place
                        st = os.stat(path)
                        got = sha256_file(path)
                        if got != want:
                            bad.append(f"{file_name} (manifest {want[:12]}..., downloaded {got[:12]}...)")
                        stamps[file_name] = _stamp(want, st)
                    if not bad:
                        atomic_write_bytes(tmp / _STAMP, json.dumps(stamps, sort_keys=True).encode())
                        atomic_write_bytes(tmp / MARKER_NAME, raw)
                        (tmp / _USED).touch()
                        fsync_dir(tmp)
                        if entry.exists():  # a leftover that did not pass _check
                            _remove(entry)
                        os.rename(tmp, entry)
                        fsync_dir(self.root)
                        return
                    problem = CheckpointError(f"{storage.redact(url)}: digest mismatch after download: "
                                              f"{', '.join(bad)}; the object in the store is modified or corrupt")
                except OSError as e:  # StoreUnavailable included
                    if e.errno not in _DISK_FULL:
                        problem = e
                    else:
                        shutil.rmtree(tmp, ignore_errors=True)  # the partial copy's space first
                        freed = self._evict_one(keep=entry.name)
                        if freed is None:
                            raise CacheDiskFull(e.errno, f"checkpoint cache {self.root}: the disk is full "
                                                f"({_free(self.root)} bytes free) and no idle entry is left to "
                                                f"evict; downloading {storage.redact(url)}: {e}") from e
                        self.evicted_for_space += 1
                        log.warning("checkpoint cache disk full while downloading %s: evicted idle entry %s "
                                    "(least recently used), trying again", storage.redact(url), freed.name[:12])
                        attempt -= 1  # room was made: this try does not count
                        continue
                log.warning("download %d/%d of %s failed: %s", attempt, self.attempts, storage.redact(url), problem)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)  # whatever escaped: no partial copy stays behind
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
        self._remove_dead_leftovers()
        sized = [(p, _size(p)) for p in self.entries()]
        total = sum(s for _, s in sized)
        removed = []
        for p, s in sorted(sized, key=lambda e: _last_used(e[0])):
            if total <= self.max_bytes:
                break
            if p.name != keep and self._remove_idle(p):
                total -= s
                removed.append(p)
        return removed

    def _evict_one(self, keep: str | None) -> Path | None:
        """The disk is full: remove the least recently used idle entry (not `keep`); which, or None."""
        self._remove_dead_leftovers()
        for p in sorted(self.entries(), key=_last_used):
            if p.name != keep and self._remove_idle(p):
                return p
        return None

    def _remove_dead_leftovers(self) -> None:
        for p in self.root.iterdir() if self.root.is_dir() else ():
            pid = p.name.rpartition(".tmp-")[2]
            if p.name.startswith(".") and pid.isdigit() and int(pid) != os.getpid() and not pid_alive(int(pid)):
                shutil.rmtree(p, ignore_errors=True)

    def _remove_idle(self, entry: Path) -> bool:
        """Remove `entry` unless a job holds it; whether it was removed."""
        fd = os.open(self.root / f".{entry.name}.lock", os.O_CREAT | os.O_RDWR, 0o600)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return False  # in use
            _remove(entry)
            return True
        finally:
            os.close(fd)

    def size(self) -> int:
        return sum(_size(p) for p in self.entries())


def _remove(entry: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        (entry / MARKER_NAME).unlink()  # invalidate first
    shutil.rmtree(entry, ignore_errors=True)


def _stamp(sha256: str, st: os.stat_result) -> dict:
    return {"sha256": sha256, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "ctime_ns": st.st_ctime_ns,
            "ino": st.st_ino, "dev": st.st_dev}


def _read_stamps(entry: Path) -> dict:
    try:
        stamps = json.loads((entry / _STAMP).read_bytes())
    except (OSError, ValueError):
        return {}  # none (an entry from before stamps, a lost write): every file is hashed
    return stamps if isinstance(stamps, dict) else {}


def _free(directory: Path) -> int:
    try:
        return shutil.disk_usage(directory).free
    except OSError:
        return -1


def _size(directory: Path) -> int:
    return sum(f.stat().st_size for f in directory.iterdir() if f.is_file())


def _last_used(directory: Path) -> float:
    try:
        return (directory / _USED).stat().st_mtime
    except OSError:
        return 0.0
