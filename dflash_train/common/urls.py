"""The syntax of checkpoint locations: a local path, or a URL naming an object store (`s3://bucket/prefix`).

Rules only, no I/O: which strings are URLs (`is_url`), their canonical form and what is refused
(`check_url`), path arithmetic on them (`join`, `parent`, `name`), and prefix confinement
(`within_prefixes`). The kernel holds them because the settings parse root lists with them;
the stores that act on a location are `dflash_train/checkpoints/storage.py`.
"""
from __future__ import annotations

import os
import re
from collections.abc import Iterable
from pathlib import Path
from typing import TypeGuard

from .errors import StoreError
from .redaction import redact

__all__ = ["LOCAL_PROTOCOLS", "check_url", "is_url", "join", "name", "parent", "parse_root", "path_of", "protocol",
           "within_prefixes"]

_URL = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://(.*)$", re.S)
LOCAL_PROTOCOLS = ("file", "local")


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


def parse_root(text: str) -> Path | str:
    """One root of a root list as confinement compares it: a URL prefix in canonical form (str), else a
    directory, user expanded, symlinks resolved (Path). A URL is stripped of blanks; a path is taken as is (a
    directory may end in a space)."""
    url = text.strip()
    return check_url(url) if is_url(url) else Path(os.path.realpath(os.path.expanduser(text)))


def protocol(url: str) -> str:
    """The protocol of a checked URL, lower case (`s3`, `gs`, `hf`, ...)."""
    return url.split("://", 1)[0].lower()


def path_of(url: str) -> str:
    """The path part of a checked URL (no protocol, no trailing '/'): what fsspec wants."""
    m = _URL.match(url)
    assert m is not None, "called with a checked URL"
    return m.group(2).rstrip("/")


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
