"""`dflash-eval cancel JOB`: cancel a queued eval job or stop a running one."""
from __future__ import annotations

import argparse

from ._common import add_redis_args, connect_from_args, fail

HELP = "cancel a queued eval job, or stop a running one"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("job_ids", nargs="+", metavar="JOB", help="job id(s), as shown by `dflash-eval status`")
    add_redis_args(parser, queue=False)


def main(args: argparse.Namespace) -> int:
    from eval_worker.service.jobs.schema import JobError
    from eval_worker.service.queueing.queue import cancel

    try:
        conn, _ = connect_from_args(args)
    except Exception as e:  # noqa: BLE001
        return fail(str(e))
    code = 0
    for job_id in args.job_ids:
        try:
            print(cancel(conn, job_id))
        except JobError as e:
            code = fail(str(e))
    return code
