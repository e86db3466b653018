"""Options and helpers shared by the commands (worker, enqueue, requeue, status, cancel; run and enqueue
share the sampling flags).

Redis URL: `--redis-url` > `$REDIS_URL` (`args.settings`) > the embedded local redis-server
(eval_worker.service.local_redis.server.resolve_redis_url). Passwords are never printed (redact_url).
"""
from __future__ import annotations

import argparse
import json
import re
import sys


def add_redis_args(parser: argparse.ArgumentParser, *, queue: bool = True) -> None:
    parser.add_argument("--redis-url", default=None,
                        help="Redis URL (redis://[:password@]host:port/db, rediss://...); default $REDIS_URL, "
                             "else a local redis-server started on demand")
    if queue:
        parser.add_argument("--queue", default="dflash-eval",
                            help="queue base name; priorities use BASE-high, BASE, BASE-low (default: %(default)s)")


def no_redis_to_read(args: argparse.Namespace) -> str | None:
    """Why a read-only command has no Redis to read (no URL given, no local redis-server running: it
    would only show an empty queue, so it starts none), or None when there is one."""
    if args.redis_url or args.settings.redis_url:
        return None
    from eval_worker.service.local_redis.server import LocalRedis

    local = LocalRedis(args.settings.redis_dir, password=args.settings.redis_password,
                       binary=args.settings.redis_server)
    if local.attach():
        return None
    return (f"no Redis: REDIS_URL is not set and no local redis-server runs in {local.data_dir} (`dflash-eval "
            "worker`, `enqueue` and the trainer's hook start one); nothing is queued")


def connect_from_args(args: argparse.Namespace, *, start: bool = True):
    """(connection, redacted url) for the command's Redis; raises RedisAccessError with a clear message.
    `start=False`: never start the local redis-server (a read-only command)."""
    from dflash_train.common.redaction import redact_url
    from eval_worker.redis_client import connect
    from eval_worker.service.local_redis.server import resolve_redis_url

    # the notice goes first, on stderr: stdout may be JSON that a script reads
    url = resolve_redis_url(args.redis_url, args.settings, start=start,
                            notice=lambda text: print(f"note: {text}", file=sys.stderr))
    conn = connect(url)
    try:
        from eval_worker.service.queueing.queue import server_risks

        for risk in server_risks(conn):  # a server that can drop accepted jobs: said by every command
            print(f"warning: {risk}", file=sys.stderr)
    except Exception:  # noqa: BLE001 - unreachable now: the command itself says so
        pass
    return conn, redact_url(url)


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def printable(text) -> str:
    """`text` with every control character escaped (`\\x1b`): names read from files (suites, prompts, runs)
    never drive the terminal (issue 34 D9)."""
    return _CONTROL.sub(lambda m: repr(m.group(0))[1:-1], str(text))


def fail(message: str, code: int = 2) -> int:
    print(f"error: {message}", file=sys.stderr)
    return code


def print_json(obj) -> None:
    print(json.dumps(obj, indent=2, sort_keys=True, default=str))


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    """τ under sampling (docs/design.md "Sampling"); each flag is the eval option of the same name."""
    g = parser.add_argument_group("sampling", "τ at temperature > 0 besides greedy τ (eval options temperatures, "
                                              "top_p, top_k, num_samples, seed)")
    g.add_argument("--temperature", type=float, action="append", default=None, metavar="T", dest="temperatures",
                   help="also measure τ when the target samples at temperature T > 0 (repeatable: "
                        "--temperature 0.6 --temperature 1.0)")
    g.add_argument("--top-p", type=float, default=None,
                   help="nucleus cut of the sampled target (0 < p <= 1; default 1)")
    g.add_argument("--top-k", type=int, default=None, help="top-k cut of the sampled target (default 0: off)")
    g.add_argument("--num-samples", type=int, default=None, metavar="K",
                   help="sampled references per prompt and temperature (default 1); τ and its interval "
                        "average over prompts and samples")
    g.add_argument("--seed", type=int, default=None,
                   help="keys the sampled references' draws and the bootstrap (default 0)")


def sampling_options(args: argparse.Namespace) -> dict:
    """The eval options the sampling flags set (only those given)."""
    names = {"temperatures": "temperatures", "top_p": "top_p", "top_k": "top_k", "num_samples": "num_samples",
             "seed": "seed"}
    return {opt: getattr(args, attr) for attr, opt in names.items() if getattr(args, attr, None) is not None}
