"""`dflash-eval report --run RUN`: the local HTML report of a run's evaluations."""
from __future__ import annotations

import argparse
import sys

HELP = "write a self-contained HTML report (and PNGs) of a training run's evaluations"


def _steps(text: str) -> list[int]:
    try:
        return [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--steps must be comma-separated integers, got {text!r}") from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run", default=None, help="training run id (default: the latest demo's)")
    p.add_argument("--out", help="output directory (default: ./reports/<run>; the latest demo's run: its report "
                                 "directory)")
    p.add_argument("--results", help="results (ledger) directory (default $DFLASH_RESULTS_DIR, else "
                                     "$DFLASH_HOME/results: the worker's)")
    p.add_argument("--steps", type=_steps,
                   help="checkpoints shown in detail, e.g. 100,400 (default: first, best, latest)")
    p.add_argument("--suite", help="suite shown in detail (default: the one with the most evaluations)")


def main(args: argparse.Namespace) -> int:
    from pathlib import Path

    from eval_worker.results import latest_demo
    from eval_worker.results.report import build_report
    from eval_worker.results.run_results import ResultsError

    run, results, note = latest_demo.results_dir_for(args.run, args.results, args.settings)
    if run is None:
        print("dflash-eval report: give --run RUN (no demo recorded to default to)", file=sys.stderr)
        return 2
    if note:
        print(f"note: {note}", file=sys.stderr)
    out = args.out
    demo = latest_demo.read(args.settings)
    if out is None and note and demo and demo["run_id"] == run:
        out = str(Path(demo["report"]).parent)  # next to the demo's own report, not in the current directory
    try:
        path = build_report(run, results_dir=results, out_dir=out, steps=args.steps, suite=args.suite)
    except ResultsError as e:
        print(f"dflash-eval report: {e}", file=sys.stderr)
        return 2
    print(f"report: {path.resolve()}")
    return 0
