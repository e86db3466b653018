"""`dflash-eval dismiss JOB... | --all [--run RUN]`: remove failed eval jobs for good."""
from __future__ import annotations

import argparse

from ._common import add_redis_args, connect_from_args, fail, print_json

HELP = "remove failed eval jobs (instead of waiting out their 30-day failure TTL); the ledger is not touched"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job_ids", nargs="*", metavar="JOB", help="failed job id(s), as listed by `dflash-eval status`")
    parser.add_argument("--all", action="store_true", help="every failed job (of --run, when given)")
    parser.add_argument("--run", default=None, help="with --all: only this training run's failures")
    parser.add_argument("--json", action="store_true", help="print what was dismissed as JSON")
    add_redis_args(parser)


def main(args: argparse.Namespace) -> int:
    from eval_worker.service.queueing.queue import dismiss_failed

    if bool(args.job_ids) == bool(args.all):
        return fail("name the failed job(s) to dismiss, or give --all (optionally with --run RUN)")
    try:
        conn, _ = connect_from_args(args)
    except Exception as e:  # noqa: BLE001
        return fail(str(e))
    dismissed, problems = dismiss_failed(conn, args.queue, args.job_ids or None, run=args.run)
    if args.json:
        print_json({"dismissed": dismissed, "problems": problems})
    else:
        for job_id in dismissed:
            print(f"dismissed {job_id}")
        if args.all and not dismissed:
            print("no failed jobs to dismiss")
    for problem in problems:
        fail(problem)
    return 2 if problems else 0
