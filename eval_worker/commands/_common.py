"""Options and helpers shared by the queue commands (worker, enqueue, requeue, status, cancel).

Redis URL: `--redis-url` > `$REDIS_URL` (`args.settings`) > the embedded local redis-server
(eval_worker.service.redis_local.resolve_redis_url). Passwords are never printed (redact_url).
"""
from __future__ import annotations

import argparse
import json
import sys


def add_redis_args(parser: argparse.ArgumentParser, *, queue: bool = True) -> None:
    parser.add_argument("--redis-url", default=None,
                        help="Redis URL (redis://[:password@]host:port/db, rediss://...); default $REDIS_URL, "
                             "else a local redis-server started on demand")
    if queue:
        parser.add_argument("--queue", default="dflash-eval",
                            help="queue base name; priorities use BASE-high, BASE, BASE-low (default: %(default)s)")


def connect_from_args(args: argparse.Namespace):
    """(connection, redacted url) for the command's Redis; raises RedisLocalError with a clear message."""
    from eval_worker.service.redis_local import connect, redact_url, resolve_redis_url

    url = resolve_redis_url(args.redis_url, args.settings)
    return connect(url), redact_url(url)


def fail(message: str, code: int = 2) -> int:
    print(f"error: {message}", file=sys.stderr)
    return code


def print_json(obj) -> None:
    print(json.dumps(obj, indent=2, sort_keys=True, default=str))
