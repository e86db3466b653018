"""`dflash-eval worker [--queue …] [--burst]`: serve the eval queues with a warm target."""
from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path

from dflash_train.common.settings import parse_roots

from ._common import add_redis_args, connect_from_args, fail

HELP = "run an eval worker: keeps the target loaded across jobs, records results in the ledger"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_redis_args(parser)
    parser.add_argument("--priorities", default="high,default,low",
                        help="which priority queues to serve, in order (default: %(default)s)")
    parser.add_argument("--burst", action="store_true", help="exit when the queues are empty")
    parser.add_argument("--target", default=None,
                        help="target model directory (or a Hub model id ORG/NAME[@REV], from the Hugging Face cache): "
                             "loaded before the first job and kept "
                             "(default $DFLASH_TARGET; jobs naming another target load it on demand, "
                             "if it lies in a --target-root)")
    parser.add_argument("--target-root", action="append", default=None, metavar="DIR",
                        help="jobs may name targets under these roots besides --target (repeatable; default "
                             "$DFLASH_TARGET_ROOTS, else the checkpoint roots)")
    parser.add_argument("--suite-root", action="append", default=None, metavar="DIR",
                        help="jobs may name suite files under these roots besides built-in suites (repeatable; "
                             "default $DFLASH_SUITE_ROOTS, else the checkpoint roots)")
    parser.add_argument("--no-preload", action="store_true", help="load the target on the first job instead")
    parser.add_argument("--checkpoint-root", action="append", default=None, metavar="DIR",
                        help="only evaluate checkpoints under these roots: directories, or store prefixes "
                             "such as s3://bucket/runs whose checkpoints are pulled into the checkpoint cache "
                             "(repeatable; default $DFLASH_CHECKPOINT_ROOTS; required)")
    parser.add_argument("--checkpoint-cache-dir", default=None,
                        help="where checkpoints pulled from a store are kept (default $DFLASH_CHECKPOINT_CACHE_DIR, "
                             "else $DFLASH_HOME/checkpoint-cache)")
    parser.add_argument("--checkpoint-cache-gb", type=float, default=None,
                        help="evict pulled checkpoints, least recently used first, beyond this size "
                             "(default $DFLASH_CHECKPOINT_CACHE_GB, else 20)")
    parser.add_argument("--results-dir", default=None, help="ledger directory (default $DFLASH_RESULTS_DIR, "
                                                            "else $DFLASH_HOME/results)")
    parser.add_argument("--cache-dir", default=None,
                        help="reference/feature cache (default $DFLASH_CACHE_DIR, else $DFLASH_HOME/cache)")
    parser.add_argument("--spool-dir", default=None,
                        help="where a computed result waits when its ledger write fails, so a retry only "
                             "writes it (default $DFLASH_SPOOL_DIR, else $DFLASH_HOME/spool)")
    parser.add_argument("--device", default=None, help="torch device for the target (default $DFLASH_DEVICE, "
                                                       "else the engine's)")
    parser.add_argument("--max-targets", type=int, default=1, help="targets kept loaded at once (LRU)")
    parser.add_argument("--serve-target", action="append", default=None, metavar="DIR",
                        help="also take the jobs routed to this target (`enqueue --route-by-target`), repeatable; "
                             "--target is served too. The queues of the targets held loaded are served first "
                             "within each priority")
    parser.add_argument("--name", default=None, help="worker name (default dflash-<host>-<pid>)")
    parser.add_argument("--maintenance-interval", type=int, default=60,
                        help="seconds between registry cleanups that recover jobs of crashed workers")
    parser.add_argument("--job-monitoring-interval", type=int, default=10, help="seconds between job heartbeats")
    parser.add_argument("--heartbeat-grace", type=int, default=60,
                        help="seconds a running job may miss heartbeats before it counts as abandoned")
    parser.add_argument("--worker-ttl", type=int, default=420, help="seconds an idle worker stays registered")
    parser.add_argument("--stop-timeout", type=float, default=None,
                        help="on SIGTERM, give the current job this long, then put it back on the queue "
                             "(default: let it finish); a second SIGTERM puts it back at once")
    parser.add_argument("--no-scheduler", action="store_true",
                        help="do not run RQ's scheduler here (retry back-off needs one somewhere)")
    parser.add_argument("--max-jobs", type=int, default=None, help="exit after this many jobs")
    parser.add_argument("--evaluator-factory", default=None, metavar="MODULE:CALLABLE",
                        help="build evaluators with this instead of eval_worker.engine.acceptance.Evaluator "
                             "(default $DFLASH_EVALUATOR_FACTORY)")
    parser.add_argument("--sink", default=None,
                        help="comma-separated result sinks: wandb, tensorboard, mlflow, or none "
                                                     "(default $DFLASH_SINKS, else wandb; a job's own list wins)")
    parser.add_argument("--log-level", default="INFO")


def main(args: argparse.Namespace) -> int:
    import logging

    from dflash_train.checkpoints.hub import resolve_target
    from dflash_train.checkpoints.publication import CheckpointError
    from dflash_train.checkpoints.storage import StoreError
    from dflash_train.common.progress import limit_repeated_warnings
    from eval_worker.service.queueing.queue import queue_name
    from eval_worker.service.queueing.routing import serving_queue_names
    from eval_worker.service.worker.evaluators import WorkerSettings
    from eval_worker.service.worker.worker import serve, worker_name

    try:
        args.target = resolve_target(args.target)  # a Hub model id: its snapshot in the Hugging Face cache
    except CheckpointError as e:
        return fail(str(e))
    path = lambda p: Path(p).expanduser() if p else None  # noqa: E731
    if args.sink is not None:
        from dflash_train.common.settings import KNOWN_SINKS, parse_sinks

        sinks, unknown = parse_sinks(args.sink)
        if unknown:
            return fail(f"--sink: unknown sink(s) {list(unknown)}; known: {', '.join(KNOWN_SINKS)}")
        args.settings = dataclasses.replace(args.settings, sinks=sinks, unknown_sinks=())
    try:
        roots = parse_roots(args.checkpoint_root)
    except StoreError as e:
        return fail(f"--checkpoint-root: {e}")
    settings = WorkerSettings.from_settings(
        args.settings, results_dir=path(args.results_dir), roots=roots,
        target_roots=parse_roots(args.target_root), suite_roots=parse_roots(args.suite_root),
        cache_dir=path(args.cache_dir), default_target=args.target, device=args.device, max_targets=args.max_targets,
        evaluator_factory=args.evaluator_factory, spool_dir=path(args.spool_dir),
        checkpoint_cache_dir=path(args.checkpoint_cache_dir), checkpoint_cache_gb=args.checkpoint_cache_gb)
    if settings.roots is None:
        return fail("no checkpoint roots configured: pass --checkpoint-root DIR (repeatable) or set "
                    "DFLASH_CHECKPOINT_ROOTS; the worker only reads checkpoints under them")
    from dflash_train.checkpoints import storage
    from dflash_train.checkpoints.location import CheckpointRef

    for root in CheckpointRef.parse_all(settings.roots):  # a missing bucket, a read-only key: now, not at job 1
        if not root.on_this_machine:
            try:
                storage.preflight(root.text)
            except (StoreError, OSError) as e:
                return fail(f"--checkpoint-root {root.shown}: {e}")
    serve_targets = None
    if args.serve_target:
        serve_targets = list(dict.fromkeys(os.path.abspath(t) for t in [*([args.target] if args.target else []),
                                                                        *args.serve_target]))
    try:
        priorities = [p.strip() for p in args.priorities.split(",") if p.strip()]
        for p in priorities:
            queue_name(args.queue, p)  # an unknown priority is refused here
        queues = serving_queue_names(args.queue, priorities, serve_targets or [])
    except ValueError as e:
        return fail(str(e))
    try:
        conn, url = connect_from_args(args)
    except Exception as e:  # noqa: BLE001
        return fail(str(e))
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s",
                        datefmt="%H:%M:%S")
    limit_repeated_warnings()  # Redis down: one line per 30 s per message, not one per reconnect
    name = args.name or worker_name()
    print(f"worker {name} serving {', '.join(queues)} on {url}; results in {settings.results_dir}; "
          f"roots {os.pathsep.join(map(str, settings.roots))}", flush=True)
    serve(conn, queues, settings, burst=args.burst, preload=not args.no_preload, name=name,
          maintenance_interval=args.maintenance_interval, job_monitoring_interval=args.job_monitoring_interval,
          heartbeat_grace=args.heartbeat_grace, worker_ttl=args.worker_ttl, stop_timeout=args.stop_timeout,
          with_scheduler=not args.no_scheduler, max_jobs=args.max_jobs, logging_level=args.log_level,
          route_base=args.queue, serve_targets=serve_targets)
    return 0
