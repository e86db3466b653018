"""`dflash-eval dashboard`: rq-dashboard on the eval queue's Redis, set up for our JSON jobs.

Our jobs are JSON (rq's JSONSerializer), so the dashboard needs its JSON switch; and rq-dashboard
0.9 lists workers with `Worker.all(connection)` alone, so a busy worker's current job is read with
the pickle serializer and the workers view answers HTTP 500 (DeserializationError). `dashboard_app`
gives its workers the serializer the rest of the dashboard uses.
"""
from __future__ import annotations

import argparse
import sys

from ._common import add_redis_args, fail

HELP = "serve rq-dashboard (queues, jobs, workers) for the eval queue's Redis, JSON jobs included"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_redis_args(parser)
    parser.add_argument("--bind", default="127.0.0.1",
                        help="address to listen on (default: %(default)s; 0.0.0.0 shows the queue to the network)")
    parser.add_argument("--port", type=int, default=9181, help="port (default: %(default)s)")


def _jobs_queue(connection, base: str) -> str:
    """The queue the Jobs tab opens on: the first of `base`'s queues, in the order workers serve them,
    that holds queued jobs (routed targets' included), else `base` itself."""
    from eval_worker.service.queueing.queue import all_queue_names, get_queue

    names = all_queue_names(connection, base)
    return next((n for n in names if get_queue(connection, n).count), base)


def dashboard_app(redis_url: str, queue: str = "dflash-eval"):
    """The rq-dashboard Flask app for `redis_url`, with the JSON serializer for jobs and workers; its Jobs
    tab opens on the eval queue (`queue`: the base name) rather than RQ's `default`, which is always empty."""
    import os
    import re
    from urllib.parse import quote

    from flask import current_app, redirect, request
    from rq_dashboard.app import create_app

    from eval_worker.service.worker.rq_compat import json_dashboard_workers

    os.environ["RQ_DASHBOARD_REDIS_URL"] = redis_url  # read by create_app (as `rq-dashboard --redis-url`)
    os.environ["RQ_DASHBOARD_JSON_SERIALIZER"] = "true"
    os.environ.setdefault("RQ_DASHBOARD_URL_PREFIX", "")
    json_dashboard_workers()
    app = create_app()

    @app.before_request
    def _jobs_tab_on_the_eval_queue():
        m = re.fullmatch(r"(.*/\d+)/view/jobs/?", request.path)  # the tab's link names no queue
        if m:
            name = _jobs_queue(current_app.redis_conn, queue)
            return redirect(f"{m.group(1)}/view/jobs/{quote(name, safe='')}/queued/8/asc/1")
        return None

    return app


def main(args: argparse.Namespace) -> int:
    try:
        import rq_dashboard  # noqa: F401
    except ImportError:
        return fail("rq-dashboard is not installed: pip install -e '.[worker]'")
    from dflash_train.common.redaction import redact_url
    from eval_worker.redis_client import connect
    from eval_worker.service.local_redis.server import resolve_redis_url

    try:  # the embedded Redis when REDIS_URL is unset, as for the worker
        url = resolve_redis_url(args.redis_url, args.settings,
                                notice=lambda text: print(f"note: {text}", file=sys.stderr))
        connect(url).close()
    except Exception as e:  # noqa: BLE001
        return fail(str(e))
    print(f"rq-dashboard for {redact_url(url)} on http://{args.bind}:{args.port}/", file=sys.stderr, flush=True)
    dashboard_app(url, args.queue).run(host=args.bind, port=args.port)
    return 0
