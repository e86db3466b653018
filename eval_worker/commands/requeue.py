"""`dflash-eval requeue --run RUN [--steps 100,200 | --all] [--target T] | --failed`: evaluate again.

Exit status: 0 done; 1 some of `--steps` have no job (the others were requeued, the missing
ones are listed); 2 nothing to do or bad input.
"""
from __future__ import annotations

import argparse
from typing import Any

from ._common import add_redis_args, connect_from_args, fail, print_json

HELP = "re-queue failed jobs (--failed) or evaluate steps of a run again (--run RUN --steps/--all)"


def _steps(text: str) -> list[int]:
    try:
        steps = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--steps wants comma-separated integers, got {text!r}") from None
    if not steps:
        raise argparse.ArgumentTypeError("--steps is empty")
    return steps


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run", default=None, help="training run id")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--steps", type=_steps, default=None, help="comma-separated steps, e.g. 100,200")
    which.add_argument("--all", action="store_true", help="every step of the run the queue has seen")
    parser.add_argument("--target", default=None, metavar="PATH",
                        help="with --run: only the run's jobs on this target (a run evaluated on two targets "
                             "otherwise gets the steps evaluated again on both)")
    parser.add_argument("--failed", action="store_true",
                        help="put failed jobs back on their queues as they are (all, or of --run)")
    parser.add_argument("--job", action="append", default=None, metavar="JOB_ID", help="with --failed: only these")
    parser.add_argument("--json", action="store_true", help="print what was done as JSON")
    add_redis_args(parser)


def main(args: argparse.Namespace) -> int:
    from eval_worker.service.jobs.schema import JobError
    from eval_worker.service.queueing.client import EnqueueOutcome, requeue_run
    from eval_worker.service.queueing.queue import QueueConfig, requeue_failed

    if not args.failed and not args.run:
        return fail("give --failed, or --run RUN with --steps or --all")
    if args.run and not args.failed and not (args.steps or args.all):
        return fail("with --run, say which steps: --steps 100,200 or --all")
    if args.target and (args.failed or not args.run):
        return fail("--target goes with --run RUN --steps/--all (`--failed --job ID` picks failed jobs one by one)")
    try:
        conn, _ = connect_from_args(args)
    except Exception as e:  # noqa: BLE001
        return fail(str(e))
    lines: list[dict[str, Any]] = []
    try:
        if args.failed:
            for job_id in requeue_failed(conn, args.queue, args.job, run=args.run):
                lines.append({"job_id": job_id, "status": "requeued", "message": f"re-queued failed job {job_id}"})
            if not lines:
                lines.append({"job_id": None, "status": "none", "message": "no failed jobs to re-queue"})
        else:
            report = requeue_run(conn, args.run, None if args.all else args.steps, config=QueueConfig(base=args.queue),
                                 target=args.target)
            for r in report.outcomes:
                if isinstance(r, EnqueueOutcome):
                    lines.append(r.to_dict())
                else:
                    lines.append({"job_id": r[0], "status": "requeued" if r[1].startswith("re-queued") else "skipped",
                                  "message": r[1]})
            for step in report.missing_steps:
                lines.append({"job_id": None, "status": "missing", "step": step,
                              "message": f"run {args.run} step {step}: the queue has never seen a job for it"
                                         + (f" on target {args.target}" if args.target else "") + " "
                                         "(enqueue its checkpoint with `dflash-eval enqueue DIR`)"})
    except (JobError, OSError) as e:  # OSError: a store (checkpoints by URL) that did not answer
        return fail(str(e))
    if args.json:
        print_json(lines)
    else:
        for ln in lines:
            print(f"{ln['status']:9s} {ln['message']}")
    # whatever exists was requeued above; a missing step still makes the command fail (scripts see it)
    return 1 if any(ln["status"] == "missing" for ln in lines) else 0
