"""One W&B writer per eval run at a time.

W&B's shared mode (several processes writing one run) is known to lose history, and two
offline rebuilds of one run must not interleave, so every writer holds this lock for the
short logging phase. With a Redis URL it is a Redis lock (works across machines); it
expires on its own if the holder dies, and a background thread extends it while the
holder is alive. A lock file in the local W&B directory (``filelock``: an ``flock`` on
Linux) is always taken as well: it serialises writers on one machine, also those that know
no Redis.
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from pathlib import Path

from filelock import FileLock, Timeout

LOCK_PREFIX = "dflash-eval:wandb-lock:"


class LockTimeout(TimeoutError):
    """Another writer held the lock for longer than we were willing to wait."""


@contextlib.contextmanager
def redis_lock(url: str, name: str, *, wait_s: float = 600.0, ttl_s: float = 60.0) -> Iterator[None]:
    from redis.exceptions import RedisError

    from dflash_train.common.redaction import redact_url
    from eval_worker.redis_client import connect

    client = connect(url)
    lock = client.lock(LOCK_PREFIX + name, timeout=ttl_s, blocking_timeout=wait_s, thread_local=False)
    try:
        if not lock.acquire(blocking=True):
            raise LockTimeout(
                f"W&B lock {name!r} on {redact_url(url)} still held by another writer after {wait_s:.0f}s")
        stop = threading.Event()

        def keep_alive() -> None:  # a long rebuild must not outlive the TTL and let a second writer in
            while not stop.wait(ttl_s / 3):
                try:
                    lock.reacquire()
                except RedisError:  # lost (not owned any more) or Redis gone: the writer's own calls will say
                    return

        keeper = threading.Thread(target=keep_alive, name=f"wandb-lock-{name}", daemon=True)
        keeper.start()
        try:
            yield
        finally:
            stop.set()
            keeper.join(timeout=5)
            with contextlib.suppress(Exception):
                lock.release()
    finally:
        client.close()


@contextlib.contextmanager
def file_lock(path: Path, *, wait_s: float = 600.0) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(path, timeout=wait_s, mode=0o644, preserve_lock_file=True, poll_interval=0.1)
    try:
        lock.acquire()
    except Timeout:
        raise LockTimeout(f"W&B lock file {path} still held after {wait_s:.0f}s") from None
    try:
        yield
    finally:
        lock.release()


@contextlib.contextmanager
def writer_lock(name: str, *, redis_url: str | None, lock_dir: Path, wait_s: float = 600.0) -> Iterator[list[str]]:
    """Hold the writer lock for eval run ``name``; yields the kinds taken.

    The file lock is always taken too: a `publish` run by hand without ``REDIS_URL`` must
    still exclude workers writing into the same local W&B directory.
    """
    with contextlib.ExitStack() as stack:
        kinds = []
        if redis_url:
            stack.enter_context(redis_lock(redis_url, name, wait_s=wait_s))
            kinds.append("redis")
        stack.enter_context(file_lock(lock_dir / f".{name}.lock", wait_s=wait_s))
        kinds.append("file")
        yield kinds
