"""`dflash-eval results --run RUN...`: a run's evaluations from the ledger, as a table."""
from __future__ import annotations

import argparse

from ._common import fail, print_json, printable

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
    """Each run's rows, each naming what tells its number apart (target, options, prompt count, max tokens:
    run_results.series_of). With `settings` and no `results_dir`, every ledger holding the run is read
    (the configured one and the latest demo's: latest_demo.ledgers_for), each row naming its ledger."""
    import sys

    from eval_worker.results import latest_demo
    from eval_worker.results.run_results import load_run, series_of, target_notes

    out = []
    for run in runs:
        ledgers = (latest_demo.ledgers_for(run, results_dir, settings) if settings is not None
                   else [(results_dir, None)])
        loaded = []
        for where, note in ledgers:
            if note:
                print(f"note: {printable(note)}", file=sys.stderr)
            loaded += [(where, r) for r in load_run(run, where)]
        series = series_of([r for _, r in loaded])
        for note in target_notes([r for _, r in loaded]):
            print(f"warning: run {printable(run)}: {printable(note)}", file=sys.stderr)
        for where, r in loaded:
            res, base = r.result, r.result.get("baseline") or {}
            out.append({"run": run, "step": r.step, "suite": res["suite"]["name"], "series": series[r.key].label,
                        "target": r.target_label, "target_fingerprint": (res.get("target") or {}).get("fingerprint"),
                        "options": r.options, "options_label": r.options_label or "default",
                        "prompts": res["suite"].get("num_prompts"),
                        "max_new_tokens": (res.get("settings") or {}).get("max_new_tokens"),
                        "digest": res["checkpoint"]["digest"], "source": res["checkpoint"].get("source"),
                        "tau": res["tau"]["macro"], "ci95": res["tau"].get("ci95"),
                        "tree_tau": (res.get("tree") or {}).get("tau"),
                        "baseline": base.get("checkpoint"), "baseline_tau": base.get("tau"),
                        "delta_tau": base.get("delta_tau"), "delta_ci95": base.get("delta_ci95"),
                        **({"ledger": str(where)} if len(ledgers) > 1 else {})})
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
    twidth = min(28, max(len("target"), *(len(r["target"]) for r in table)))
    owidth = min(28, max(len("options"), *(len(r["options_label"]) for r in table)))
    print(f"{'run':<{width}} |     step | suite          | {'target':<{twidth}} | {'options':<{owidth}} | prompts | "
          f"max tok |  τ (macro) | 95% CI           | tree τ | baseline τ |     Δτ | Δτ 95% CI")
    print("-" * (width + twidth + owidth + 138))
    for r in table:
        print(f"{printable(r['run']):<{width}} | {r['step']:>8} | {printable(r['suite'])[:14]:<14} | "
              f"{printable(r['target'])[:twidth]:<{twidth}} | {printable(r['options_label'])[:owidth]:<{owidth}} | "
              f"{_n(r['prompts']):>7} | {_n(r['max_new_tokens']):>7} | {_f(r['tau'], 10)} | {_ci(r['ci95'])} | "
              f"{_f(r['tree_tau'])} | {_f(r['baseline_tau'], 10)} | {_f(r['delta_tau'])} | {_ci(r['delta_ci95'])}")
    baselines = sorted({r["baseline"] for r in table if r["baseline"]})
    for b in baselines:
        print(f"baseline: {printable(b)}")
    return 0


def _n(x) -> str:
    return str(x) if isinstance(x, int) else "-"


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
        print(f"  {printable(run)}  ({printable(d)}){mark}")
    return 0
