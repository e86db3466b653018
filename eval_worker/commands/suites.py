"""`dflash-eval suites [SUITE...]`: list the suites, or load the given ones and show what a job would evaluate.

Loading an `hf:` suite where the Hub is reachable also fills the `datasets` cache, so this is
the way to get a benchmark onto a machine before its workers go offline. Exit status: 0 every
suite loaded; 2 one did not (the message says why and how to provide it).
"""
from __future__ import annotations

import argparse
import json
import sys
from typing import Any

HELP = "list the prompt suites, or load suites (hf: benchmarks: fills the datasets cache) and show their fingerprints"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("suites", nargs="*", metavar="SUITE",
                   help="builtin:NAME, a .jsonl file or hf:NAME[:n=N][:seed=S][:thinking=on]; none: list what exists")
    p.add_argument("--show", type=int, default=0, metavar="N", help="also print the first N prompts of each suite")
    p.add_argument("--json", action="store_true", help="print JSON")


def main(args: argparse.Namespace) -> int:
    from eval_worker.engine.suite import HF_SUITES, SuiteError, builtin_suites, load_suite

    if not args.suites:
        listing: dict[str, Any] = {"builtin": [f"builtin:{n}" for n in builtin_suites()],
                   "hf": {f"hf:{n}": {"dataset": b.repo, "config": b.config, "split": b.split, "note": b.note or None}
                          for n, b in HF_SUITES.items()}}
        if args.json:
            print(json.dumps(listing, indent=1))
        else:
            print("built-in: " + ", ".join(listing["builtin"]))
            for name, b in listing["hf"].items():
                print(f"{name:<14} {b['dataset']} ({b['config'] or 'default'}, {b['split']})"
                      + (f"  {b['note']}" if b["note"] else ""))
            print("local dataset copies: " + (str(args.settings.hf_datasets_dir) if args.settings.hf_datasets_dir
                                              else "none ($DFLASH_HF_DATASETS_DIR); the datasets cache, else the Hub"))
        return 0
    out, failed = [], False
    for spec in args.suites:
        try:
            s = load_suite(spec, hf_datasets_dir=args.settings.hf_datasets_dir)
        except SuiteError as e:
            print(f"dflash-eval suites: {e}", file=sys.stderr)
            failed = True
            continue
        out.append({"spec": spec, **s.to_dict(), "max_new_tokens": s.max_new_tokens,
                    "chat_template_kwargs": s.chat_template_kwargs,
                    "prompts": [p.to_dict() for p in s.prompts[:max(0, args.show)]]})
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        for d in out:
            origin = d.get("origin")
            where = (f"  {origin['dataset']} {origin['split']} rev {origin['revision'] or '-'} "
                     f"data {origin['data_fingerprint']}{' (local copy)' if origin['local'] else ''}") if origin else ""
            print(f"{d['spec']}: {d['name']}-v{d['version']}  {d['num_prompts']} prompts  fp {d['fingerprint']}{where}")
            for p in d["prompts"]:
                print(f"  {p['name']}: {json.dumps(p.get('prompt') or p.get('messages') or p.get('ids'))[:200]}")
    return 2 if failed else 0
