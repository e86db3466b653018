"""Where published checkpoints live: one `Store` interface, its kind chosen once per location.

A checkpoint location is a local path (the default) or a URL: `s3://bucket/prefix/...` (S3,
MinIO, R2, any S3-compatible store), another fsspec protocol whose library is installed
(`gs://` with gcsfs, `memory://`, ...) or `hf://ORG/REPO@COMMIT` (a drafter on the Hugging Face
Hub, read-only). `store_for(location)` decides which kind serves it, once; the checkpoint
contract (`publication.py`: layout, marker, pins, retention, listing, cleanup) is then written
once against the `Store` operations, for every kind:

- `LocalStore`: files on this machine; every write is atomic (a temporary file, fsynced, renamed
  over the target, the directory fsynced: `common/fsutil.py`) with the modes the store was made
  with, so a reader sees a whole file or none;
- `FsspecStore`: an object store through fsspec (s3fs, gcsfs, ...); an object appears whole when
  its upload completes;
- `HubStore`: the Hub through huggingface_hub's cache (`hub.py`); every write refuses with
  StoreError, and a location's files at its commit stand in for the marker it lacks (`snapshot`).

The URL rules (`check_url`, `join`, `within_prefixes`, ...) live in the kernel
(`dflash_train/common/urls.py`) and are re-exported here, like the errors.

Why fsspec/s3fs rather than boto3: one interface for every protocol (S3 through s3fs, GCS
through gcsfs, local memory in tests), with multipart transfers and retries inside the library;
fsspec is already installed (the datasets/transformers stack depends on it). boto3 would be S3
only and would leave paging, multipart and the other stores to us.

Credentials and endpoints come from where the libraries look: `AWS_ACCESS_KEY_ID` /
`AWS_SECRET_ACCESS_KEY` / `AWS_SESSION_TOKEN`, `AWS_PROFILE` and `~/.aws/{config,credentials}`,
instance roles, and `AWS_ENDPOINT_URL` (or `AWS_ENDPOINT_URL_S3`, or `endpoint_url` in the
profile) for a non-AWS store. None of them passes through this project's code: a URL with
credentials in it is refused (`check_url`), so no secret can travel in a job, a result or W&B.
"""
from __future__ import annotations

import contextlib
import errno
import functools
import os
import shutil
import sys
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_train.common.errors import StoreError, StoreUnavailable
from dflash_train.common.fsutil import atomic_writer, fsync_dir, is_temp_name
from dflash_train.common.redaction import redact  # re-exported: one redaction for every URL in the project
from dflash_train.common.urls import check_url, is_url, join, name, parent, path_of, protocol, within_prefixes

from . import hub

__all__ = ["StoreError", "StoreUnavailable", "Store", "LocalStore", "FsspecStore", "HubStore", "Snapshot",
           "transport_errors", "LOCAL_DISK_ERRNOS", "is_url", "check_url", "join", "parent", "name",
           "within_prefixes", "store_for", "redact", "preflight", "missing_bucket"]

READ_ONLY = ("hf",)  # the Hugging Face Hub: read, never uploaded to, pinned or pruned
Location = str | os.PathLike[str]  # a URL for a store, a path for a LocalStore


@dataclass(frozen=True)
class Snapshot:
    """A location with no COMPLETE.json of its own whose files are fixed at one revision (a Hub
    commit): where they are on this machine, the name a run id is made from, and the fields the
    derived manifest carries besides the files (`publication.read_marker`)."""

    directory: Path
    name: str
    fields: dict[str, Any] = field(default_factory=dict)


class Store(ABC):
    """The operations the checkpoint contract needs, on one kind of place.

    Missing things: `read_bytes`, `get_file` and `size` raise FileNotFoundError; `list_names` gives
    []; `remove` of nothing is no error. A write is atomic: a reader sees the whole object (file) or
    none. A store that cannot be reached raises StoreUnavailable (retryable); a read-only store
    refuses every write with StoreError.
    """

    local = False  # its locations are paths on this machine
    read_only = False

    # --- names (URL arithmetic; LocalStore's are paths)
    def location(self, location: Location) -> str | Path:
        """`location` as this store names it: the URL in canonical form (StoreError if it breaks the rules)."""
        return check_url(os.fspath(location))

    def join(self, location: Location, *parts: str) -> Location:
        return join(os.fspath(location), *parts)

    def name(self, location: Location) -> str:
        return name(os.fspath(location))

    def parent(self, location: Location) -> Location:
        return parent(os.fspath(location))

    # --- objects
    @abstractmethod
    def read_bytes(self, location: Location) -> bytes: ...

    @abstractmethod
    def write_bytes(self, location: Location, data: bytes) -> None: ...

    @abstractmethod
    def create_bytes(self, location: Location, data: bytes) -> bool:
        """Write `data` at `location` only if nothing is there, atomically with that check (two writers:
        exactly one creates it); False when something already was (nothing written)."""

    @abstractmethod
    def put_file(self, local: str | Path, location: Location) -> None: ...

    @abstractmethod
    def get_file(self, location: Location, local: str | Path) -> None: ...

    @abstractmethod
    def exists(self, location: Location) -> bool: ...

    @abstractmethod
    def size(self, location: Location) -> int: ...

    @abstractmethod
    def list_names(self, location: Location) -> list[str]:
        """Names directly under `location` (objects and common prefixes / files and directories); [] when none."""

    @abstractmethod
    def remove(self, location: Location, recursive: bool = False) -> None: ...

    def snapshot(self, location: Location) -> Snapshot | None:
        """The files standing for a checkpoint that has no marker of its own (the Hub); None for stores
        whose checkpoints carry their COMPLETE.json."""
        return None

    def check_writable(self, location: Location) -> None:
        if self.read_only:
            raise StoreError(f"{redact(os.fspath(location))}: this store is read-only here "
                             "(nothing is uploaded, pinned or removed)")


class LocalStore(Store):
    """Files on this machine. Writes go through a fsynced temporary file renamed into place (the
    directory fsynced after), with `file_mode`; missing directories are made with `dir_mode` (both
    exact, whatever the umask; None: the usual permissions). Temporaries of writes in flight are not
    listed."""

    local = True

    def __init__(self, *, file_mode: int | None = None, dir_mode: int | None = None):
        self.file_mode, self.dir_mode = file_mode, dir_mode

    def location(self, location: Location) -> Path:
        return Path(location)

    def join(self, location: Location, *parts: str) -> Path:
        return Path(location).joinpath(*parts)

    def name(self, location: Location) -> str:
        return Path(location).name

    def parent(self, location: Location) -> Path:
        return Path(location).parent

    def read_bytes(self, location: Location) -> bytes:
        return Path(location).read_bytes()

    def _make_parents(self, path: Path) -> None:
        for d in [p for p in reversed(path.parents) if not p.is_dir()]:
            try:
                d.mkdir()
            except FileExistsError:
                continue  # another writer made it: its mode is that writer's
            if self.dir_mode is not None:
                os.chmod(d, self.dir_mode)

    def write_bytes(self, location: Location, data: bytes) -> None:
        path = Path(location)
        self._make_parents(path)
        with atomic_writer(path, mode=self.file_mode) as f:
            f.write(data)

    def create_bytes(self, location: Location, data: bytes) -> bool:
        """A fsynced temporary file hard-linked to the target: link(2) never replaces (EEXIST)."""
        path = Path(location)
        self._make_parents(path)
        tmp = path.with_name(f".{path.name}.{os.urandom(4).hex()}.tmp-{os.getpid()}")
        try:
            with open(tmp, "xb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            if self.file_mode is not None:
                os.chmod(tmp, self.file_mode)
            try:
                os.link(tmp, path)
            except FileExistsError:
                return False
        finally:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()
        fsync_dir(path.parent)
        return True

    def put_file(self, local: str | Path, location: Location) -> None:
        path = Path(location)
        self._make_parents(path)
        with open(local, "rb") as src, atomic_writer(path, mode=self.file_mode) as dst:
            shutil.copyfileobj(src, dst, 1 << 22)

    def get_file(self, location: Location, local: str | Path) -> None:
        shutil.copyfile(location, local)

    def exists(self, location: Location) -> bool:
        return os.path.exists(location)

    def size(self, location: Location) -> int:
        return os.path.getsize(location)

    def list_names(self, location: Location) -> list[str]:
        try:
            names = os.listdir(location)
        except (FileNotFoundError, NotADirectoryError):
            return []
        return sorted(n for n in names if not is_temp_name(n))

    def remove(self, location: Location, recursive: bool = False) -> None:
        path = Path(location)
        if recursive and path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)  # best effort: what stays is found by the next cleanup
        else:
            try:
                path.unlink()
            except FileNotFoundError:
                return
        fsync_dir(path.parent)


# Local-disk conditions, not the store's: a caller frees space or reports the disk (checkpoint_cache).
LOCAL_DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)

# The transport errors of the libraries behind fsspec that are not OSError/TimeoutError (aiohttp's
# ClientPayloadError on a connection cut mid-body, botocore's, requests'), by module: looked up in
# sys.modules, so nothing is imported for them (a library that raised one is loaded).
_LIBRARY_ERRORS = (("aiohttp", "ClientError"), ("botocore.exceptions", "BotoCoreError"),
                   ("botocore.exceptions", "ClientError"), ("requests", "RequestException"),
                   ("urllib3.exceptions", "HTTPError"), ("http.client", "HTTPException"),
                   ("huggingface_hub.errors", "HfHubHTTPError"))


def transport_errors() -> tuple[type[BaseException], ...]:
    """Every exception class that means "the store or the way to it failed": retryable."""
    found: list[type[BaseException]] = [OSError, ValueError, RuntimeError, TimeoutError]
    for module, attr in _LIBRARY_ERRORS:
        cls = getattr(sys.modules.get(module), attr, None)
        if isinstance(cls, type) and issubclass(cls, BaseException):
            found.append(cls)
    return tuple(found)


class FsspecStore(Store):
    """An object store through one fsspec filesystem (s3fs, gcsfs, memory, ...).

    Every transport error of the libraries is turned into StoreUnavailable (retryable), except
    a missing object (FileNotFoundError) and a full or read-only local disk (OSError with
    ENOSPC/EDQUOT/EROFS, raised as is: the store is not at fault). Listings are never cached
    (another process writes the marker).
    """

    def __init__(self, fs):
        self.fs = fs

    def _call(self, what: str, url: Location, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except FileNotFoundError:
            raise
        except OSError as e:
            if e.errno in LOCAL_DISK_ERRNOS:
                raise
            raise StoreUnavailable(f"{what} {redact(os.fspath(url))} failed: {type(e).__name__}: {e}") from e
        except transport_errors() as e:
            raise StoreUnavailable(f"{what} {redact(os.fspath(url))} failed: {type(e).__name__}: {e}") from e

    def read_bytes(self, url: Location) -> bytes:
        return self._call("reading", url, self.fs.cat_file, path_of(os.fspath(url)))

    def write_bytes(self, url: Location, data: bytes) -> None:
        self._call("writing", url, self.fs.pipe_file, path_of(os.fspath(url)), data)

    def create_bytes(self, url: Location, data: bytes) -> bool:
        """fsspec's exclusive write (`mode="create"`: S3 `If-None-Match: *`, which AWS S3, MinIO and moto
        honour); the store's refusal (412) is FileExistsError. A library without that mode is refused with
        StoreError: an unconditional write would let two writers both believe they created the object."""
        def create() -> bool:
            try:
                self.fs.pipe_file(path_of(os.fspath(url)), data, mode="create")
            except FileExistsError:
                return False
            return True

        try:
            return bool(self._call("creating", url, create))
        except TypeError as e:  # a library that knows no `mode`
            raise StoreError(f"{redact(os.fspath(url))}: this storage library cannot create an object only if it "
                             f"is absent ({e}); upgrade it (s3fs >= 2024.12)") from None

    def put_file(self, local: str | Path, url: Location) -> None:
        self._call("uploading to", url, self.fs.put_file, str(local), path_of(os.fspath(url)))

    def get_file(self, url: Location, local: str | Path) -> None:
        self._call("downloading", url, self.fs.get_file, path_of(os.fspath(url)), str(local))

    def exists(self, url: Location) -> bool:
        return bool(self._call("checking", url, self.fs.exists, path_of(os.fspath(url))))

    def size(self, url: Location) -> int:
        return int(self._call("checking", url, self.fs.size, path_of(os.fspath(url))))

    def list_names(self, url: Location) -> list[str]:
        """Names directly under `url` (objects and common prefixes); [] when there are none."""
        try:
            entries = self._call("listing", url, self.fs.ls, path_of(os.fspath(url)), detail=False)
        except FileNotFoundError:
            return []
        here = path_of(os.fspath(url))
        return sorted({e.rstrip("/").rsplit("/", 1)[-1] for e in entries if e.rstrip("/") != here})

    def remove(self, url: Location, recursive: bool = False) -> None:
        try:
            self._call("removing", url, self.fs.rm, path_of(os.fspath(url)), recursive=recursive)
        except FileNotFoundError:
            pass
        self.fs.invalidate_cache()


class HubStore(Store):
    """Drafters on the Hugging Face Hub, `hf://ORG/REPO@COMMIT/FILE`, read through huggingface_hub's
    cache (`hub.py`). Read-only: every write refuses with StoreError."""

    read_only = True

    def _file(self, url: Location) -> Path:
        repo_id, revision, path = hub.parse(os.fspath(url))
        if not path or "/" in path:
            raise FileNotFoundError(url)
        f = hub.snapshot(repo_id, revision) / path
        if not f.is_file():
            raise FileNotFoundError(url)
        return f

    def read_bytes(self, location: Location) -> bytes:
        return self._file(location).read_bytes()

    def get_file(self, location: Location, local: str | Path) -> None:
        shutil.copyfile(self._file(location), local)

    def exists(self, location: Location) -> bool:
        try:
            self._file(location)
        except FileNotFoundError:
            return False
        return True

    def size(self, location: Location) -> int:
        return self._file(location).stat().st_size

    def list_names(self, location: Location) -> list[str]:
        repo_id, revision, path = hub.parse(os.fspath(location))
        return [] if path else sorted(p.name for p in hub.snapshot(repo_id, revision).iterdir())

    def write_bytes(self, location: Location, data: bytes) -> None:
        self.check_writable(location)

    def create_bytes(self, location: Location, data: bytes) -> bool:
        self.check_writable(location)
        return False

    def put_file(self, local: str | Path, location: Location) -> None:
        self.check_writable(location)

    def remove(self, location: Location, recursive: bool = False) -> None:
        self.check_writable(location)

    def snapshot(self, location: Location) -> Snapshot:
        """The drafter's files at the location's commit (CheckpointError unless it names one)."""
        repo_id, revision = hub.pinned(os.fspath(location))
        return Snapshot(hub.snapshot(repo_id, revision), f"{repo_id.replace('/', '--')}-{revision[:8]}",
                        {"hub": {"repo": repo_id, "revision": revision}})


@functools.lru_cache(maxsize=16)
def _filesystem(protocol: str):
    import fsspec

    try:
        cls = fsspec.get_filesystem_class(protocol)
    except (ImportError, ValueError) as e:
        raise StoreError(f"no storage library for {protocol}:// ({e}); for s3:// install s3fs") from None
    options = {"skip_instance_cache": True}
    if protocol in ("s3", "s3a", "gs", "gcs", "abfs", "az"):
        options["use_listings_cache"] = False  # the marker appears from another process
    return cls(**options)


def store_for(location: Location, *, file_mode: int | None = None, dir_mode: int | None = None) -> Store:
    """The Store that serves `location`: a LocalStore (with `file_mode` / `dir_mode` for what it writes) for
    a path, the read-only HubStore for `hf://`, an FsspecStore (one filesystem per protocol and process) for
    any other URL. StoreError for a URL that breaks the rules or whose protocol has no library here."""
    if isinstance(location, Path) or not is_url(location):  # a Path is never a URL
        return LocalStore(file_mode=file_mode, dir_mode=dir_mode)
    proto = protocol(check_url(location))
    if proto in READ_ONLY:
        return HubStore()
    return FsspecStore(_filesystem(proto))


BUCKET_PROTOCOLS = ("s3", "s3a", "gs", "gcs", "abfs", "az")  # the URL's first segment is a bucket/container


def missing_bucket(url: Location) -> str | None:
    """The sentence to say when the bucket (container) of `url` does not exist, naming it and the endpoint;
    None when it exists or the protocol has no buckets. StoreUnavailable when the store cannot be reached.
    One wording for the trainer's preflight and every reader that finds no marker (`publication.read_marker`)."""
    if not is_url(url):
        return None  # a local path has no bucket
    url = check_url(url)
    proto = protocol(url)
    if proto not in BUCKET_PROTOCOLS:
        return None
    store = store_for(url)
    bucket = path_of(url).split("/", 1)[0]
    if store.exists(f"{proto}://{bucket}"):
        return None
    # the endpoint the client resolved (AWS_ENDPOINT_URL, a profile, or AWS itself)
    client = getattr(getattr(store, "fs", None), "s3", None)
    endpoint = getattr(getattr(client, "meta", None), "endpoint_url", None) or "AWS"
    return (f"bucket {bucket!r} does not exist (endpoint {endpoint}): create it first "
            f"(`aws s3 mb s3://{bucket}`, `mc mb ALIAS/{bucket}`) or fix the URL {redact(url)}")


def preflight(url: str, *, write: bool = True) -> None:
    """Check a store prefix before a long run relies on it: its bucket exists and, with `write`, an
    object can be written under the prefix and deleted. StoreError (the bucket is missing) or
    StoreUnavailable (unreachable, no permission), each one sentence that says what to do;
    read-only stores (the Hub) are not probed."""
    import secrets
    import socket

    url = check_url(url)
    store = store_for(url)
    if store.read_only:
        return
    try:
        problem = missing_bucket(url)
    except StoreUnavailable as e:
        raise StoreUnavailable(f"cannot reach the store for {redact(url)}: {e.__cause__ or e}") from None
    if problem:
        raise StoreError(problem)
    if not write:
        return
    probe = join(url, f".dflash-preflight-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}")
    try:
        store.write_bytes(probe, b"dflash-eval preflight: safe to delete\n")
        store.remove(probe)
    except (StoreUnavailable, FileNotFoundError, PermissionError) as e:
        raise StoreUnavailable(f"cannot write and delete a probe object under {redact(url)} "
                               f"({type(e.__cause__ or e).__name__}: {e.__cause__ or e}): check the credentials' "
                               "permissions (put and delete) on that prefix") from None
