"""Durable, atomic file writes and a process liveness probe, shared by trainer, worker and hooks.

Checkpoint markers, training state, the eval outbox, the results ledger, caches and
reports all need the same few steps (write a temporary file in the target's directory,
fsync it, rename it over the target, fsync the directory) and the same "is the writer of
this leftover still running?" check. They live here once instead of in every module.

Temporary files are named `.<name>.<random>.tmp-<pid>`: hidden, so listings that skip
dot-files ignore them; containing `.tmp-` like every other temporary in the project; and
ending in the writer's pid like the publication directories (`.step-*.tmp-<pid>`), so a
cleaner can tell a dead writer's leftover (see `pid_alive`). The random part keeps two
threads of one process that write the same file from sharing a temporary.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO

import psutil

__all__ = ["atomic_write_bytes", "atomic_write_json", "atomic_write_text", "atomic_writer",
           "fsync_dir", "fsync_path", "is_temp_name", "pid_alive"]


def fsync_path(path: str | os.PathLike) -> None:
    """fsync a file or directory by name; errors propagate."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(path: str | os.PathLike) -> None:
    """fsync a directory (makes renames and unlinks in it durable); best effort.

    Some filesystems refuse to fsync a directory, so OSError is ignored.
    """
    with contextlib.suppress(OSError):
        fsync_path(path)


def _temp_name(path: Path) -> Path:
    return path.with_name(f".{path.name}.{os.urandom(4).hex()}.tmp-{os.getpid()}")


_TEMP = re.compile(r"^\..+\.[0-9a-f]{8}\.tmp-\d+$")


def is_temp_name(name: str) -> bool:
    """Whether `name` is one of `atomic_writer`'s temporaries (a write in flight, or a dead writer's leftover)."""
    return bool(_TEMP.match(name))


@contextlib.contextmanager
def atomic_writer(path: str | os.PathLike, *, durable: bool = True, mode: int | None = None) -> Iterator[BinaryIO]:
    """Write `path` through a binary file that replaces it only once the block succeeds.

    Readers see the old content or the new one, never a mix. With `durable`, the data is
    fsynced before the rename and the directory after it. If the block (or anything
    after it) fails, the temporary file is removed and `path` is left as it was.
    The file gets the usual permissions (0o666 less the umask), like `open(path, "w")`,
    or exactly `mode` when given (set before any byte is written).
    """
    path = Path(path)
    tmp = _temp_name(path)
    try:
        with open(tmp, "xb") as f:
            if mode is not None:
                os.fchmod(f.fileno(), mode)
            yield f
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if durable:
        fsync_dir(path.parent)


def atomic_write_bytes(path: str | os.PathLike, data: bytes, *, durable: bool = True,
                       mode: int | None = None) -> None:
    """Atomically replace `path` with `data` (see `atomic_writer`)."""
    with atomic_writer(path, durable=durable, mode=mode) as f:
        f.write(data)


def atomic_write_text(path: str | os.PathLike, text: str, *, encoding: str = "utf-8",
                      durable: bool = True, mode: int | None = None) -> None:
    """Atomically replace `path` with `text` (see `atomic_writer`)."""
    atomic_write_bytes(path, text.encode(encoding), durable=durable, mode=mode)


def atomic_write_json(path: str | os.PathLike, obj: Any, *, indent: int | None = 2, sort_keys: bool = True,
                      durable: bool = True, mode: int | None = None) -> None:
    """Atomically replace `path` with `obj` as JSON plus a final newline (see `atomic_writer`)."""
    atomic_write_text(path, json.dumps(obj, indent=indent, sort_keys=sort_keys) + "\n", durable=durable, mode=mode)


def pid_alive(pid: int) -> bool:
    """Whether a process `pid` exists (it may belong to another user; zombies count as alive)."""
    return pid > 0 and psutil.pid_exists(pid)
