"""`dflash-eval results --run RUN...`: a run's evaluations from the ledger, as a table."""
from __future__ import annotations

import argparse

from ._common import fail, print_json

HELP = "print the evaluations of training runs (the ledger: latest attempt per checkpoint and suite) as a table"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run", action="append", required=True, metavar="RUN",
                        help="training run id (repeatable: the runs' rows one after another)")
    parser.add_argument("--results", default=None,
                        help="results (ledger) directory (default $DFLASH_RESULTS_DIR, else $DFLASH_HOME/results)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")


def _f(x, width: int = 6) -> str:
    return f"{x:{width}.3f}" if isinstance(x, (int, float)) else "-".rjust(width)


def _ci(ci) -> str:
    return f"[{_f(ci[0])}, {_f(ci[1])}]" if ci and None not in ci else "-".center(16)


def rows(runs: list[str], results_dir) -> list[dict]:
    from eval_worker.results.run_results import load_run

    out = []
    for run in runs:
        for r in load_run(run, results_dir):
            res, base = r.result, r.result.get("baseline") or {}
            out.append({"run": run, "step": r.step, "suite": res["suite"]["name"],
                        "digest": res["checkpoint"]["digest"], "source": res["checkpoint"].get("source"),
                        "tau": res["tau"]["macro"], "ci95": res["tau"].get("ci95"),
                        "tree_tau": (res.get("tree") or {}).get("tau"),
                        "baseline": base.get("checkpoint"), "baseline_tau": base.get("tau"),
                        "delta_tau": base.get("delta_tau"), "delta_ci95": base.get("delta_ci95")})
    return out


def main(args: argparse.Namespace) -> int:
    from eval_worker.results.run_results import ResultsError

    try:
        table = rows(args.run, args.results or args.settings.results_dir)
    except ResultsError as e:
        return fail(str(e))
    if args.json:
        print_json(table)
        return 0
    width = max(len(r["run"]) for r in table)
    print(f"{'run':<{width}} |     step | suite          |  τ (macro) | 95% CI           | tree τ | baseline τ |     Δτ | Δτ 95% CI")
    print("-" * (width + 112))
    for r in table:
        print(f"{r['run']:<{width}} | {r['step']:>8} | {r['suite'][:14]:<14} | {_f(r['tau'], 10)} | {_ci(r['ci95'])} | "
              f"{_f(r['tree_tau'])} | {_f(r['baseline_tau'], 10)} | {_f(r['delta_tau'])} | {_ci(r['delta_ci95'])}")
    baselines = sorted({r["baseline"] for r in table if r["baseline"]})
    for b in baselines:
        print(f"baseline: {b}")
    return 0
