"""Where published checkpoints live: a local directory, or an object store named by a URL.

A checkpoint location is a local path (the default) or a URL: `s3://bucket/prefix/...`
(S3, MinIO, R2, any S3-compatible store) or another fsspec protocol whose library is
installed (`gs://` with gcsfs, `memory://`, ...). This module is the one place that talks
to a store: URL rules (`check_url`, `join`, `within_prefixes`) and a handful of object
operations (`Store`). The checkpoint contract itself (layout, marker, verification, pins,
retention) stays in `publication.py`, which calls this for URLs.

Why fsspec/s3fs rather than boto3: one interface for every protocol (S3 through s3fs, GCS
through gcsfs, the Hub through huggingface_hub's HfFileSystem, local files in tests), with
multipart transfers and retries inside the library; fsspec is already installed (the
datasets/transformers stack depends on it). boto3 would be S3 only and would leave paging,
multipart and the other stores to us.

Credentials and endpoints come from where the libraries look: `AWS_ACCESS_KEY_ID` /
`AWS_SECRET_ACCESS_KEY` / `AWS_SESSION_TOKEN`, `AWS_PROFILE` and `~/.aws/{config,credentials}`,
instance roles, and `AWS_ENDPOINT_URL` (or `AWS_ENDPOINT_URL_S3`, or `endpoint_url` in the
profile) for a non-AWS store. None of them passes through this project's code: a URL with
credentials in it is refused (`check_url`), so no secret can travel in a job, a result or W&B.
"""
from __future__ import annotations

import errno
import functools
import re
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import TypeGuard

from dflash_train.common.errors import DFlashError
from dflash_train.common.redaction import redact  # re-exported: one redaction for every URL in the project

__all__ = ["StoreError", "StoreUnavailable", "Store", "transport_errors", "LOCAL_DISK_ERRNOS", "is_url", "check_url",
           "join", "parent", "name", "within_prefixes", "store_for", "redact", "read_only",
           "preflight"]

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://(.*)$", re.S)
LOCAL_PROTOCOLS = ("file", "local")
READ_ONLY = ("hf",)  # the Hugging Face Hub (dflash_train/checkpoints/hub.py): read, never uploaded to, pinned or pruned


class StoreError(DFlashError, ValueError):
    """A location that is not acceptable (bad URL, unknown protocol, outside the allowed prefixes)."""


class StoreUnavailable(DFlashError, OSError):
    """The store could not be reached or answered with an error: trying again may help."""

    retryable = True


def is_url(location: object) -> TypeGuard[str]:
    """Whether `location` names an object-store location (`proto://...`, not `file://`)."""
    if isinstance(location, Path) or not isinstance(location, str):
        return False
    m = _URL.match(location)
    return m is not None and m.group(1).lower() not in LOCAL_PROTOCOLS


def check_url(url: str) -> str:
    """`url` in canonical form (no trailing '/'), or StoreError saying what is wrong with it.

    Refused: credentials in the URL (they would travel in jobs and results), a query or
    fragment, NUL bytes, empty, '.' or '..' path segments (a prefix check must mean what it
    says), a bucket-less URL.
    """
    if not isinstance(url, str) or "\x00" in url:
        raise StoreError(f"invalid location {url!r}")
    m = _URL.match(url)
    if m is None:
        raise StoreError(f"{url!r} is not a URL (protocol://bucket/path)")
    proto, rest = m.group(1).lower(), m.group(2).rstrip("/")
    if "?" in rest or "#" in rest:
        raise StoreError(f"{redact(url)}: a query or fragment is not allowed in a checkpoint location")
    segments = rest.split("/")
    if "@" in segments[0]:
        raise StoreError(f"{redact(url)}: credentials may not be part of a location; use the store's standard "
                         "configuration (environment, profile, credentials file)")
    if not segments[0] or any(s in ("", ".", "..") for s in segments):
        raise StoreError(f"{redact(url)}: empty, '.' or '..' path segments are not allowed")
    return f"{proto}://{rest}"


def join(base: str, *parts: str) -> str:
    return "/".join([base.rstrip("/"), *(p.strip("/") for p in parts)])


def parent(url: str) -> str:
    return url.rstrip("/").rsplit("/", 1)[0]


def name(url: str) -> str:
    return url.rstrip("/").rsplit("/", 1)[-1]


def within_prefixes(url: str, roots: Iterable[object] | None) -> str | None:
    """The canonical `url` if it lies under one of the URL prefixes in `roots` (whole path
    segments: `s3://b/runs` admits `s3://b/runs/x`, not `s3://b/runs-old/x`), else None."""
    try:
        url = check_url(url)
    except StoreError:
        return None
    for root in roots or ():
        if not is_url(root):
            continue
        try:
            prefix = check_url(root)
        except StoreError:
            continue
        if url == prefix or url.startswith(prefix + "/"):
            return url
    return None


def _strip(url: str) -> str:
    """The path part fsspec wants for `url` (no protocol)."""
    m = _URL.match(url)
    assert m is not None, "called with a checked URL"
    return m.group(2).rstrip("/")


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


class Store:
    """The object operations the checkpoint contract needs, on one fsspec filesystem.

    Every transport error of the libraries is turned into StoreUnavailable (retryable), except
    a missing object (FileNotFoundError) and a full or read-only local disk (OSError with
    ENOSPC/EDQUOT/EROFS, raised as is: the store is not at fault). Listings are never cached
    (another process writes the marker).
    """

    def __init__(self, fs):
        self.fs = fs

    def _call(self, what: str, url: str, fn, *args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except FileNotFoundError:
            raise
        except OSError as e:
            if e.errno in LOCAL_DISK_ERRNOS:
                raise
            raise StoreUnavailable(f"{what} {redact(url)} failed: {type(e).__name__}: {e}") from e
        except transport_errors() as e:
            raise StoreUnavailable(f"{what} {redact(url)} failed: {type(e).__name__}: {e}") from e

    def read_bytes(self, url: str) -> bytes:
        return self._call("reading", url, self.fs.cat_file, _strip(url))

    def write_bytes(self, url: str, data: bytes) -> None:
        self._call("writing", url, self.fs.pipe_file, _strip(url), data)

    def put_file(self, local: str | Path, url: str) -> None:
        self._call("uploading to", url, self.fs.put_file, str(local), _strip(url))

    def get_file(self, url: str, local: str | Path) -> None:
        self._call("downloading", url, self.fs.get_file, _strip(url), str(local))

    def exists(self, url: str) -> bool:
        return bool(self._call("checking", url, self.fs.exists, _strip(url)))

    def size(self, url: str) -> int:
        return int(self._call("checking", url, self.fs.size, _strip(url)))

    def list_names(self, url: str) -> list[str]:
        """Names directly under `url` (objects and common prefixes); [] when there are none."""
        try:
            entries = self._call("listing", url, self.fs.ls, _strip(url), detail=False)
        except FileNotFoundError:
            return []
        here = _strip(url)
        return sorted({e.rstrip("/").rsplit("/", 1)[-1] for e in entries if e.rstrip("/") != here})

    def remove(self, url: str, recursive: bool = False) -> None:
        try:
            self._call("removing", url, self.fs.rm, _strip(url), recursive=recursive)
        except FileNotFoundError:
            pass
        self.fs.invalidate_cache()


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


def store_for(url: str) -> Store:
    """The Store that serves `url`'s protocol (one filesystem per protocol and process);
    `hf://` is served by dflash_train.checkpoints.hub (read-only, through huggingface_hub's cache)."""
    protocol = check_url(url).split("://", 1)[0]
    if protocol == "hf":
        from .hub import HubStore

        return HubStore()  # type: ignore[return-value]
    return Store(_filesystem(protocol))


def read_only(url: object) -> bool:
    return is_url(url) and str(url).split("://", 1)[0].lower() in READ_ONLY


BUCKET_PROTOCOLS = ("s3", "s3a", "gs", "gcs", "abfs", "az")  # the URL's first segment is a bucket/container


def preflight(url: str, *, write: bool = True) -> None:
    """Check a store prefix before a long run relies on it: its bucket exists and, with `write`, an
    object can be written under the prefix and deleted. StoreError (the bucket is missing) or
    StoreUnavailable (unreachable, no permission), each one sentence that says what to do;
    read-only stores (the Hub) are not probed."""
    import os
    import secrets
    import socket

    url = check_url(url)
    if read_only(url):
        return
    protocol, path = url.split("://", 1)
    store = store_for(url)
    if protocol.lower() in BUCKET_PROTOCOLS:
        bucket = path.split("/", 1)[0]
        try:
            found = store.exists(f"{protocol}://{bucket}")
        except StoreUnavailable as e:
            raise StoreUnavailable(f"cannot reach the store for {redact(url)}: {e.__cause__ or e}") from None
        if not found:
            # the endpoint the client resolved (AWS_ENDPOINT_URL, a profile, or AWS itself)
            endpoint = getattr(getattr(getattr(store.fs, "s3", None), "meta", None), "endpoint_url", None) or "AWS"
            raise StoreError(f"bucket {bucket!r} does not exist (endpoint {endpoint}): create it first "
                             f"(`aws s3 mb s3://{bucket}`, `mc mb ALIAS/{bucket}`) or fix the URL {redact(url)}")
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
