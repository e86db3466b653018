"""`dflash-eval watch DIR`: follow a training directory; import and queue each complete checkpoint once."""
from __future__ import annotations

import argparse

from ._common import add_redis_args, connect_from_args, fail

HELP = ("follow a training directory (HF Trainer checkpoint-N/, DeepSpec step_N/, SpecForge training_state.pt, "
        "*.pt files, our published steps): each complete checkpoint is imported and queued once, with its step")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("directory", metavar="DIR",
                        help="the trainer's output directory, or an object-store run prefix (s3://bucket/runs/RUN: "
                             "its published checkpoints are queued)")
    parser.add_argument("--into", default=None, metavar="ROOT",
                        help="checkpoint root for the converted checkpoints and the watch state (default: the first "
                             "of --checkpoint-root / $DFLASH_CHECKPOINT_ROOTS); the worker must have it as a root")
    parser.add_argument("--checkpoint-root", action="append", default=None, metavar="DIR",
                        help="the worker's checkpoint roots (repeatable; default $DFLASH_CHECKPOINT_ROOTS)")
    parser.add_argument("--config", default=None, metavar="CONFIG_JSON",
                        help="the drafter's config.json for checkpoints without one (HF Trainer, *.pt)")
    parser.add_argument("--prefix", default=None, metavar="PREFIX",
                        help="keep only the tensors under PREFIX (a wrapper that also saved the target)")
    parser.add_argument("--run", default=None, help="run id of the records (default: the directory's name)")
    parser.add_argument("--every", type=int, default=None, metavar="N", help="only steps that are multiples of N")
    parser.add_argument("--suite", action="append", default=None, help="suite(s) to evaluate (default: builtin)")
    parser.add_argument("--baseline", default=None, help="a published checkpoint / import record to compare with")
    parser.add_argument("--target", default=None, help="target model: a directory or a Hub model id ORG/NAME[@REV] "
                        "(default $DFLASH_TARGET / the worker's)")
    parser.add_argument("--settle", type=float, default=30.0,
                        help="seconds a file's size and mtime must stay unchanged before it counts as written "
                             "(checkpoints without a completion marker; default %(default)s)")
    parser.add_argument("--interval", type=float, default=10.0, help="seconds between scans (default %(default)s)")
    parser.add_argument("--once", action="store_true", help="scan once and exit (cron, tests)")
    parser.add_argument("--retry-failed", action="store_true",
                        help="try the checkpoints that failed once more (a failed one is retried by itself when its "
                             "files, --config or its file, --prefix or --every change)")
    add_redis_args(parser)


def _state_path(args: argparse.Namespace, roots, into):
    """Where a watch of a store prefix keeps its state (nothing is converted: only the state is kept, here);
    None for a local directory, whose state lives under `into`. ValueError saying what is missing."""
    import hashlib

    from dflash_train.checkpoints.location import CheckpointRef
    from dflash_train.common.errors import StoreError

    try:
        watched = CheckpointRef.parse(args.directory)
    except StoreError as e:
        raise ValueError(f"{args.directory}: {e}") from None
    if not watched.on_this_machine:
        key = hashlib.sha256(args.directory.encode()).hexdigest()[:16]
        return args.settings.home / "watch" / f"{key}.json"
    if into is None:
        raise ValueError("no place for the converted checkpoints: give --into ROOT or set $DFLASH_CHECKPOINT_ROOTS "
                         "(a local directory)")
    if roots is not None:  # `import`'s rule: every checkpoint is converted into --into, which the worker reads
        from eval_worker.service.jobs.confinement import import_roots_problem

        problem = import_roots_problem(into, roots)
        if problem:
            raise ValueError(problem)
    return None


def main(args: argparse.Namespace) -> int:
    import contextlib
    from pathlib import Path

    from dflash_train.checkpoints.location import first_local_root
    from dflash_train.common.settings import parse_roots
    from eval_worker.service.jobs.request import EvalRequest
    from eval_worker.service.jobs.schema import JobError
    from eval_worker.service.queueing.client import JobClient
    from eval_worker.service.queueing.queue import QueueConfig
    from hooks.watch import Watcher

    roots = parse_roots(args.checkpoint_root) or args.settings.checkpoint_roots
    into = args.into or first_local_root(roots)
    try:
        state_path = _state_path(args, roots, into)
    except ValueError as e:
        return fail(str(e))
    try:
        conn, url = connect_from_args(args)
    except Exception as e:  # noqa: BLE001 - RedisAccessError and friends: say why
        return fail(str(e))
    from dflash_train.checkpoints.hub import resolve_target
    from dflash_train.checkpoints.publication import CheckpointError

    try:
        target = resolve_target(args.target or args.settings.target)
    except CheckpointError as e:
        return fail(str(e))
    try:
        request = EvalRequest.of(suites=args.suite, target=target, baseline=args.baseline, requested_by="hook")
    except JobError as e:
        return fail(str(e))
    # outbox first, as the trainer's hook: a Redis outage keeps the jobs beside the checkpoints
    client = JobClient(connection=conn, config=QueueConfig(base=args.queue), roots=roots, settings=args.settings)

    def submit(record) -> str:
        jobs = request.jobs(record, roots=roots)
        receipts = client.post(jobs)
        for r in receipts:
            if r.status == "rejected":  # refused for itself: the command says why, the entry stays unhandled
                raise JobError(r.message)
            if r.status == "owed":  # neither written nor queued: tried again next scan (the job id dedupes)
                raise OSError(r.message)
        return "; ".join(f"{r.status} {r.job_id}" + ("" if r.taken else f" ({r.message})") for r in receipts)

    watcher = Watcher(args.directory, into, submit=submit, config=args.config, every=args.every, settle=args.settle,
                      run_id=args.run, state_path=state_path, prefix=args.prefix, retry_failed=args.retry_failed,
                      log=lambda line: print(line, flush=True))
    # the runs whose outboxes this watcher fills: converted records under `into`, or ours queued where they are
    runs = [watcher.url] if watcher.url else [Path(str(into)).resolve() / watcher.run_id, watcher.directory]

    def before_scan() -> None:  # what an outage left in the outbox goes out before anything new
        with contextlib.suppress(Exception):  # noqa: BLE001 - the scan's own delivery says what is wrong
            for run in runs:
                if run is not None:
                    client.deliver(client.run_outbox(run))
            client.release_pins()

    print(f"watching {watcher.url or watcher.directory} (run {watcher.run_id}, state {watcher.state_path}, "
          f"redis {url})", flush=True)
    try:
        watcher.run(args.interval, once=args.once, before_scan=before_scan)
    except JobError as e:
        return fail(str(e))
    finally:
        client.close()  # what is on disk waits in the outbox for the next start (or `enqueue --outbox`)
    return 0
