"""`dflash-eval publish --run RUN [--sink wandb,tensorboard,mlflow]`: rebuild the eval run of a
training run in each sink from the ledger.

Also the recovery path after a W&B outage: offline it writes one complete run with every
ledger point; online it logs exactly the records the live run is missing.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

HELP = ("rebuild the eval run of a training run in W&B, TensorBoard or MLflow from the results ledger "
        "(offline by default)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run", required=True, help="training run id")
    p.add_argument("--results", help="results (ledger) directory (default $DFLASH_RESULTS_DIR, else "
                                     "$DFLASH_HOME/results: the worker's)")
    p.add_argument("--mode", choices=("offline", "online"), help="W&B mode (default: $WANDB_MODE, else offline)")
    p.add_argument("--wandb-dir",
                   help="local W&B directory (default: $DFLASH_WANDB_DIR, $WANDB_DIR, $DFLASH_HOME/wandb)")
    p.add_argument("--project", help="W&B project (default: as last published, $WANDB_PROJECT, dflash-eval)")
    p.add_argument("--entity", help="W&B entity")
    p.add_argument("--force", action="store_true", help="offline: rebuild even when the current build is up to date "
                                                        "(MLflow: log every record again)")
    p.add_argument("--redis-url", help="Redis for the writer lock (default: $REDIS_URL; without one a local file lock)")
    p.add_argument("--sink", default="wandb", help="comma-separated sinks to rebuild: wandb, tensorboard, mlflow "
                                                   "(default: wandb)")
    p.add_argument("--tensorboard-dir",
                   help="TensorBoard root (default: $DFLASH_TENSORBOARD_DIR, else $DFLASH_HOME/tensorboard)")
    p.add_argument("--mlflow-uri", help="MLflow tracking URI (default: $DFLASH_MLFLOW_TRACKING_URI, "
                                        "$MLFLOW_TRACKING_URI, a sqlite store under $DFLASH_HOME)")
    p.add_argument("--mlflow-experiment", help="MLflow experiment (default: $DFLASH_MLFLOW_EXPERIMENT, dflash-eval)")
    p.add_argument("--mlflow-parent-run", help="nest the eval run under this MLflow run (the trainer's)")


def main(args: argparse.Namespace) -> int:
    from dflash_train.common.settings import KNOWN_SINKS

    names = [n.strip() for n in (args.sink or "").split(",") if n.strip()]
    unknown = [n for n in names if n not in KNOWN_SINKS]
    if not names or unknown:
        print(f"dflash-eval publish: unknown sink(s) {unknown or names}; known: {', '.join(KNOWN_SINKS)}",
              file=sys.stderr)
        return 2
    rc = 0
    for name in names:
        rc = max(rc, {"wandb": _wandb, "tensorboard": _tensorboard, "mlflow": _mlflow}[name](args))
    return rc


def _other(args: argparse.Namespace, sink: str, publish) -> int:
    from dflash_train.common.redaction import redact_url
    from eval_worker.results.run_results import ResultsError
    from eval_worker.results.sinks.wandb_lock import LockTimeout

    try:
        info = publish()
    except ResultsError as e:
        print(f"dflash-eval publish: {e}", file=sys.stderr)
        return 2
    except LockTimeout as e:
        print(f"dflash-eval publish: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # noqa: BLE001 - tracker errors: say what and where, keep the ledger
        print(f"dflash-eval publish: {sink} publication failed ({type(e).__name__}): {redact_url(str(e))}",
              file=sys.stderr)
        return 1
    if sink == "tensorboard":
        what = "already up to date" if info.get("skipped") else "rebuilt"
        print(f"tensorboard eval run {info['eval_run_id']} {what}: steps {', '.join(map(str, info['steps']))}")
        print(f"  event file: {info['event_file']}")
        print(f"  to view:    {info['view']}")
    else:
        print(f"mlflow run {info['mlflow_run_id']} ({info['eval_run_id']}): logged {len(info['logged'])} missing "
              f"record(s), {len(info['records'])} in total ({redact_url(info['tracking_uri'])})")
    return 0


def _tensorboard(args: argparse.Namespace) -> int:
    from eval_worker.results.sinks.tensorboard_sink import TensorBoardTarget, publish_run

    s = args.settings
    root = Path(args.tensorboard_dir).expanduser().resolve() if args.tensorboard_dir else s.tensorboard_dir
    target = TensorBoardTarget(root=root, primary_suite=s.wandb_primary_suite)
    return _other(args, "tensorboard", lambda: publish_run(
        args.run, target, results_dir=args.results or s.results_dir, redis_url=args.redis_url or s.redis_url,
        force=args.force))


def _mlflow(args: argparse.Namespace) -> int:
    from eval_worker.results.sinks.mlflow_sink import publish_run, target_from

    s = args.settings
    target = target_from(None, s, tracking_uri=args.mlflow_uri, experiment=args.mlflow_experiment,
                         parent_run_id=args.mlflow_parent_run)
    return _other(args, "mlflow", lambda: publish_run(
        args.run, target, results_dir=args.results or s.results_dir, redis_url=args.redis_url or s.redis_url,
        force=args.force))


def _wandb(args: argparse.Namespace) -> int:
    from dflash_train.common.redaction import redact_url
    from eval_worker.results.run_results import ResultsError
    from eval_worker.results.sinks.wandb_lock import LockTimeout
    from eval_worker.results.sinks.wandb_sink import SinkError, publish_run, saved_identity, target_from

    settings = args.settings
    target_root = Path(args.wandb_dir).expanduser().resolve() if args.wandb_dir else settings.wandb_dir
    cfg = dict(saved_identity(args.run, target_root))
    cfg.update({k: v for k, v in (("project", args.project), ("entity", args.entity)) if v})
    try:
        target = target_from(cfg, settings, mode=args.mode, root=target_root)
        info = publish_run(args.run, target, results_dir=args.results or settings.results_dir,
                           redis_url=args.redis_url or settings.redis_url, force=args.force)
    except ResultsError as e:
        print(f"dflash-eval publish: {e}", file=sys.stderr)
        return 2
    except (SinkError, LockTimeout) as e:
        print(f"dflash-eval publish: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # noqa: BLE001 - W&B / network errors: say what and where, keep the ledger
        print(f"dflash-eval publish: W&B publication failed ({type(e).__name__}): {redact_url(str(e))}",
              file=sys.stderr)
        return 1
    if info.get("mode") == "disabled":
        print("W&B is disabled (WANDB_MODE=disabled); nothing published")
        return 0
    if target.mode == "online":
        print(f"eval run {info['eval_run_id']}: logged {len(info['logged'])} missing record(s), "
              f"{len(info['records'])} in total (project {target.project})")
    else:
        what = "already up to date" if info.get("skipped") else "rebuilt"
        print(f"eval run {info['eval_run_id']} {what}: steps {', '.join(map(str, info['steps']))}")
        print(f"  offline run: {info['run_dir']}")
        print(f"  to upload:   {info['sync']}")
    return 0
