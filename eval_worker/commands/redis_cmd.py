"""`dflash-eval redis status|stop [--force]`: the embedded redis-server that commands start when
`REDIS_URL` is unset (it runs detached, so it outlives them; eval_worker.service.local_redis.server).

`stop` refuses while a worker it serves is alive (its jobs would stall on a server that is gone);
`--force` stops it anyway. A server named by `REDIS_URL` / `--redis-url` is never touched here.
"""
from __future__ import annotations

import argparse
import socket
import sys
import time

from ._common import fail, print_json

HELP = "show or stop the local redis-server that commands start when REDIS_URL is unset"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("action", choices=("status", "stop"),
                        help="status: is it running, where, which workers it serves; stop: end it")
    parser.add_argument("--force", action="store_true",
                        help="stop it even while a worker it serves is running (the worker loses its queue)")
    parser.add_argument("--json", action="store_true", help="status as JSON")


def _serving_workers(local) -> list[dict]:
    """Workers registered on the server whose process is alive (a local server serves this host only)."""
    from rq.serializers import JSONSerializer
    from rq.worker import Worker

    from dflash_train.common.fsutil import pid_alive
    from eval_worker.redis_client import connect

    conn = connect(local.url)
    try:
        here = socket.gethostname()
        return [{"name": w.name, "pid": w.pid, "host": w.hostname, "queues": w.queue_names()}
                for w in Worker.all(connection=conn, serializer=JSONSerializer)
                if w.hostname != here or (w.pid and pid_alive(int(w.pid)))]
    finally:
        conn.close()


def main(args: argparse.Namespace) -> int:
    from dflash_train.common.redaction import redact_url
    from eval_worker.redis_client import RedisAccessError
    from eval_worker.service.local_redis.server import LocalRedis

    settings = args.settings
    local = LocalRedis(settings.redis_dir, password=settings.redis_password, binary=settings.redis_server)
    if settings.redis_url:
        print(f"note: REDIS_URL is set ({redact_url(settings.redis_url)}): commands use that server, not the "
              f"local one this command manages", file=sys.stderr)
    try:
        running = local.attach()
    except RedisAccessError as e:
        return fail(str(e))
    if not running:
        if args.json and args.action == "status":
            print_json({"running": False, "data_dir": str(local.data_dir)})
        else:
            print(f"no local redis-server running (data dir {local.data_dir})")
        return 0
    workers = _serving_workers(local)
    if args.action == "status":
        state = local._read_state() or {}
        info = {"running": True, "pid": local.pid, "url": redact_url(local.url), "data_dir": str(local.data_dir),
                "started_at": state.get("started_at"), "workers": workers}
        if args.json:
            print_json(info)
            return 0
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(state["started_at"])) \
            if state.get("started_at") else "?"
        print(f"local redis-server running: pid {local.pid} at {info['url']}, since {since}, data in {local.data_dir}")
        print(f"workers ({len(workers)}):" + "".join(f"\n  {w['name']}  pid {w['pid']}  queues "
                                                      f"{','.join(w['queues'])}" for w in workers))
        print("`dflash-eval redis stop` ends it (its AOF keeps the queue for the next start)")
        return 0
    if workers and not args.force:
        names = ", ".join(f"{w['name']} (pid {w['pid']})" for w in workers)
        return fail(f"the local redis-server (pid {local.pid}) serves {len(workers)} running worker(s): {names}; "
                    "stop them first, or pass --force", code=1)
    pid = local.pid
    local.stop()
    print(f"stopped the local redis-server (pid {pid}); queued jobs are kept in {local.data_dir} for its next start")
    return 0
