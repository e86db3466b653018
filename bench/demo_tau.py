"""Acceptance length τ of the demo drafter: untrained vs each published checkpoint.

    python bench/demo_tau.py [--config demo] [--train] [--run-dir runs/demo] [--max-new-tokens 128]
                             [--sets suite,heldout-code,heldout-instruct] [--per-set 12] [--json out.json]

τ = mean accept length (bonus included) of real greedy speculative decoding
(`dflash_train.core.speculative.speculative_generate`), pooled over the prompts of a set:
- `suite`: the built-in eval suite's coding requests (eval_worker/engine/suites/coding.jsonl, chat template);
- `heldout-code`: code prefixes from the stdlib files the tiny target never trained on;
- `heldout-instruct`: coding requests made from those held-out files' docstrings.
None of these prompts is in the training data. With --train the demo config is trained first
(its wall time is printed); otherwise the checkpoints already in --run-dir are measured.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from dflash_train.checkpoints.checkpoint import load_drafter  # noqa: E402
from dflash_train.checkpoints.publication import list_checkpoints, read_manifest  # noqa: E402
from dflash_train.core.model import DFlashDrafter  # noqa: E402
from dflash_train.core.speculative import speculative_generate  # noqa: E402
from dflash_train.core.target import Target  # noqa: E402
from dflash_train.training.data import encode_record, stdlib_code_prompts, stdlib_instruct_prompts  # noqa: E402
from dflash_train.training.train_config import load_config  # noqa: E402
from dflash_train.training.trainer import Trainer, resolve_target_path  # noqa: E402

SUITE = REPO / "eval_worker" / "engine" / "suites" / "coding.jsonl"


def prompt_sets(tok, names: list[str], per_set: int) -> dict[str, list[list[int]]]:
    out = {}
    for name in names:
        if name == "suite":
            recs = [json.loads(line) for line in SUITE.read_text().splitlines() if line.strip()]
            recs = [r for r in recs if "prompt" in r or "messages" in r][:per_set]
            out[name] = [encode_record(tok, r, "auto")[0] for r in recs]
        elif name == "heldout-code":
            out[name] = [e.ids for e in stdlib_code_prompts(tok, per_set, 64, "heldout")]
        elif name == "heldout-instruct":
            out[name] = [e.ids for e in stdlib_instruct_prompts(tok, per_set, "heldout")]
        else:
            raise SystemExit(f"unknown prompt set {name}")
    return out


def tau(target, drafter, prompts, max_new) -> tuple[float, float]:
    """(pooled τ, macro τ) over prompts."""
    lengths, per_prompt = [], []
    for p in prompts:
        r = speculative_generate(target, drafter, p, max_new, eos_token_id=target.tokenizer.eos_token_id)
        lengths += r.accept_lengths
        per_prompt.append(r.tau)
    return sum(lengths) / len(lengths), sum(per_prompt) / len(per_prompt)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default="demo")
    ap.add_argument("--train", action="store_true")
    ap.add_argument("--run-dir", help="default: <checkpoint_root>/<run_id> of the config")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--sets", default="suite,heldout-code,heldout-instruct")
    ap.add_argument("--per-set", type=int, default=12)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json")
    ap.add_argument("--set", nargs="*", default=[], help="config overrides key=value")
    args = ap.parse_args()
    import logging
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(args.threads)
    cfg = load_config(args.config, dict(kv.split("=", 1) for kv in args.set))
    report = {"config": cfg.to_dict()}
    if args.train:
        t, c = time.perf_counter(), time.process_time()
        trainer = Trainer(cfg)
        setup_wall, setup_cpu = time.perf_counter() - t, time.process_time() - c
        summary = trainer.train()
        report.update(train_wall_s=time.perf_counter() - t, setup_wall_s=setup_wall, setup_cpu_s=setup_cpu,
                      loop_wall_s=summary.wall_s, loop_cpu_s=summary.cpu_s, train_tokens_per_s=summary.tokens_per_s)
        print(f"trained {summary.step} steps in {report['train_wall_s']:.0f}s wall: setup (target, data, regeneration) "
              f"{setup_wall:.0f}s wall / {setup_cpu:.0f}s CPU, loop {summary.wall_s:.0f}s wall / {summary.cpu_s:.0f}s "
              f"CPU; "
              f"{summary.tokens_per_s:.0f} target tok/s. CPU seconds ~ wall seconds on an idle core.")
    run_dir = Path(args.run_dir) if args.run_dir else Path(cfg.checkpoint_root) / cfg.run_id
    target = Target.load(resolve_target_path(cfg.target))
    sets = prompt_sets(target.tokenizer, args.sets.split(","), args.per_set)
    ckpts = list_checkpoints(run_dir)
    if not ckpts:
        raise SystemExit(f"no published checkpoints in {run_dir}")
    cfg0 = load_drafter(ckpts[0]).config
    torch.manual_seed(cfg.seed)
    untrained = DFlashDrafter(cfg0).float().eval()  # the trainer's initial weights (same seed)
    rows = [("init", 0, untrained, {})] + [(p.name, read_manifest(p)["step"], load_drafter(p).float().eval(),
                                              read_manifest(p)["train_metrics"]) for p in ckpts]
    report["curve"] = []
    print(f"{'checkpoint':<16}{'step':>6}  " + "  ".join(f"{s:>22}" for s in sets) + "   train acc/streak")
    for name, step, drafter, tm in rows:
        row = {"checkpoint": name, "step": step, "train_metrics": tm}
        cells = []
        for s, prompts in sets.items():
            pooled, macro = tau(target, drafter, prompts, args.max_new_tokens)
            row[s] = {"tau_pooled": pooled, "tau_macro": macro}
            cells.append(f"τ {pooled:5.2f} (macro {macro:5.2f})")
        report["curve"].append(row)
        acc = f"{tm.get('accuracy', float('nan')):.3f}/{tm.get('streak', float('nan')):.2f}" if tm else "-"
        print(f"{name:<16}{step:>6}  " + "  ".join(f"{c:>22}" for c in cells) + f"   {acc}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2, default=str))


if __name__ == "__main__":
    main()
