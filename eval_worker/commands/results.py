"""`dflash-eval results --run RUN...`: a run's evaluations from the ledger, as a table."""
from __future__ import annotations

import argparse

from ._common import fail, print_json

HELP = "print the evaluations of training runs (the ledger: latest attempt per checkpoint and suite) as a table"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run", action="append", default=None, metavar="RUN",
                        help="training run id (repeatable: the runs' rows one after another); without it, "
                             "the runs known (the ledger's and the latest demo's) are listed")
    parser.add_argument("--results", default=None,
                        help="results (ledger) directory (default $DFLASH_RESULTS_DIR, else $DFLASH_HOME/results)")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")


def _f(x, width: int = 6) -> str:
    return f"{x:{width}.3f}" if isinstance(x, (int, float)) else "-".rjust(width)


def _ci(ci) -> str:
    return f"[{_f(ci[0])}, {_f(ci[1])}]" if ci and None not in ci else "-".center(16)


def rows(runs: list[str], results_dir, settings=None) -> list[dict]:
    """Each run's rows; with `settings` and no `results_dir`, a run found only in the latest demo's
    ledger is read from there (latest_demo.results_dir_for)."""
    import sys

    from eval_worker.results import latest_demo
    from eval_worker.results.run_results import load_run

    out = []
    for run in runs:
        where = results_dir
        if settings is not None:
            _, where, note = latest_demo.results_dir_for(run, results_dir, settings)
            if note:
                print(f"note: {note}", file=sys.stderr)
        for r in load_run(run, where):
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

    if not args.run:
        return _list_runs(args)
    try:
        table = rows(args.run, args.results, args.settings)
    except ResultsError as e:
        return fail(str(e))
    if args.json:
        print_json(table)
        return 0
    width = max(len(r["run"]) for r in table)
    print(f"{'run':<{width}} |     step | suite          |  τ (macro) | 95% CI           | tree τ | baseline τ |     "
          f"Δτ | Δτ 95% CI")
    print("-" * (width + 112))
    for r in table:
        print(f"{r['run']:<{width}} | {r['step']:>8} | {r['suite'][:14]:<14} | {_f(r['tau'], 10)} | {_ci(r['ci95'])} | "
              f"{_f(r['tree_tau'])} | {_f(r['baseline_tau'], 10)} | {_f(r['delta_tau'])} | {_ci(r['delta_ci95'])}")
    baselines = sorted({r["baseline"] for r in table if r["baseline"]})
    for b in baselines:
        print(f"baseline: {b}")
    return 0


def _list_runs(args: argparse.Namespace) -> int:
    from pathlib import Path

    from eval_worker.results import latest_demo
    from eval_worker.results.ledger import Ledger

    known = ([(run, Path(args.results)) for run in Ledger(args.results).runs()] if args.results
             else latest_demo.known_runs(args.settings))
    demo = latest_demo.read(args.settings)
    if args.json:
        print_json([{"run": run, "results": str(d), "latest_demo": bool(demo and demo["run_id"] == run
                                                                         and Path(demo["results"]) == d)}
                    for run, d in known])
        return 0
    if not known:
        print(f"no runs recorded under {args.results or args.settings.results_dir}"
              + ("" if args.results else " and no demo recorded (`dflash-eval demo` makes one)"))
        return 0
    print("runs (`dflash-eval results --run RUN` shows one):")
    for run, d in known:
        mark = "  <- latest demo" if demo and demo["run_id"] == run and Path(demo["results"]) == d else ""
        print(f"  {run}  ({d}){mark}")
    return 0
