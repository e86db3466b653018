"""`dflash-eval publish --run RUN [--sink wandb,tensorboard,mlflow]`: rebuild the eval run of a
training run in each sink from the ledger.

Also the recovery path after a W&B outage: offline it writes one complete run with every
ledger point; online it logs exactly the records the live run is missing.
"""
from __future__ import annotations

import argparse
import sys

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
        rc = max(rc, _publish(args, name))
    return rc


def _overrides(args: argparse.Namespace, name: str) -> dict:
    """The flags of this command that set a sink's target (None: not given, the settings decide)."""
    if name == "wandb":
        return {"mode": args.mode, "root": args.wandb_dir, "identity_of": args.run}
    if name == "tensorboard":
        return {"root": args.tensorboard_dir}
    return {"tracking_uri": args.mlflow_uri, "experiment": args.mlflow_experiment,
            "parent_run_id": args.mlflow_parent_run}


def _publish(args: argparse.Namespace, name: str) -> int:
    from dflash_train.common.redaction import redact_url
    from eval_worker.results.run_results import ResultsError
    from eval_worker.results.sinks import registry
    from eval_worker.results.sinks.base import SinkError
    from eval_worker.results.sinks.wandb_lock import LockTimeout

    s = args.settings
    sink = registry.get(name)
    # the W&B project and entity flags override the run's last publication (its identity)
    cfg = {k: v for k, v in (("project", args.project), ("entity", args.entity)) if v} if name == "wandb" else None
    try:
        target = sink.target(cfg, s, **_overrides(args, name))
        info = sink.publish_run(args.run, target, results_dir=args.results or s.results_dir,
                                redis_url=args.redis_url or s.redis_url, force=args.force)
    except ResultsError as e:
        print(f"dflash-eval publish: {e}", file=sys.stderr)
        return 2
    except (SinkError, LockTimeout) as e:
        print(f"dflash-eval publish: {e}", file=sys.stderr)
        return 1
    except Exception as e:  # noqa: BLE001 - tracker / network errors: say what and where, keep the ledger
        print(f"dflash-eval publish: {sink.label} publication failed ({type(e).__name__}): {redact_url(str(e))}",
              file=sys.stderr)
        return 1
    for line in sink.summary(info, target):
        print(line)
    return 0
