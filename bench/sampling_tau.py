"""τ under sampling for a demo drafter, and what K samples cost next to greedy.

    python bench/sampling_tau.py [--train] [--run-dir runs/demo] [--step 400] [--temperatures 0.6,1.0]
                                 [--num-samples 4] [--num-prompts 8] [--max-new-tokens 128] [--json out.json]

1. τ vs temperature: the engine (`Evaluator.evaluate` with `temperatures`) on the built-in coding
   suite, greedy τ next to τ at each temperature with its 95% interval (bootstrap over prompts,
   then the K keyed samples within each).
2. Cost, side by side in one process: the same job greedy only vs with the temperatures, each on
   a cold cache (references generated, features computed) and again warm (a new Evaluator reading
   the disk cache: what a worker pays for the next checkpoint of a run). Printed as ratios.
With --train the demo config is trained first (`dflash-train --config demo`'s Trainer); otherwise
the checkpoint `step-<step>` in --run-dir is used.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from dflash_train.checkpoints.publication import list_checkpoints, read_manifest  # noqa: E402
from dflash_train.core.target import Target  # noqa: E402
from dflash_train.training.train_config import load_config  # noqa: E402
from dflash_train.training.trainer import Trainer, resolve_target_path  # noqa: E402
from eval_worker.engine.acceptance import Evaluator  # noqa: E402


def timed_eval(target, cache: Path, ckpt: Path, options: dict):
    ev = Evaluator(target, cache, progress=False)
    t = time.perf_counter()
    res = ev.evaluate(ckpt, "builtin:coding-v1", options=options)
    return time.perf_counter() - t, res


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", action="store_true", help="train the demo config first")
    ap.add_argument("--run-dir", help="default: <checkpoint_root>/<run_id> of the demo config")
    ap.add_argument("--step", type=int, default=400)
    ap.add_argument("--temperatures", default="0.6,1.0")
    ap.add_argument("--num-samples", type=int, default=4)
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json")
    ap.add_argument("--set", nargs="*", default=[], help="demo config overrides key=value (with --train)")
    args = ap.parse_args()
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    torch.set_num_threads(args.threads)
    cfg = load_config("demo", dict(kv.split("=", 1) for kv in args.set))
    if args.train:
        t = time.perf_counter()
        Trainer(cfg).train()
        print(f"trained the demo config in {time.perf_counter() - t:.0f}s", flush=True)
    run_dir = Path(args.run_dir) if args.run_dir else Path(cfg.checkpoint_root) / cfg.run_id
    ckpt = next((p for p in list_checkpoints(run_dir) if read_manifest(p)["step"] == args.step), None)
    if ckpt is None:
        raise SystemExit(f"no published step {args.step} in {run_dir} (use --train or --run-dir)")
    target = Target.load(resolve_target_path(cfg.target))
    temps = [float(t) for t in args.temperatures.split(",")]
    base = {"num_prompts": args.num_prompts, "max_new_tokens": args.max_new_tokens}
    sampled = {**base, "temperatures": temps, "num_samples": args.num_samples}
    with tempfile.TemporaryDirectory() as tmp:
        cold_g, greedy = timed_eval(target, Path(tmp) / "g", ckpt, base)
        cold_s, res = timed_eval(target, Path(tmp) / "s", ckpt, sampled)
        warm_g, _ = timed_eval(target, Path(tmp) / "g", ckpt, base)
        warm_s, _ = timed_eval(target, Path(tmp) / "s", ckpt, sampled)
    r = res.to_dict()
    print(f"\n{ckpt}  ({args.num_prompts} prompts, max_new {args.max_new_tokens}, B={r['settings']['block_size']}, "
          f"K={args.num_samples} samples per prompt and temperature, top_p 1, top_k off)")
    print(f"{'temperature':<12} {'τ':>6}  {'95% CI':<16} {'pooled':>7} {'steps':>6}")
    ci = r["tau"]["ci95"]
    rows = [{"temperature": 0.0, "tau": r["tau"]["macro"], "ci95": ci, "pooled": r["tau"]["pooled"],
             "num_steps": r["tau"]["num_steps"]}]
    for e in r["sampling"]["by_temperature"].values():
        rows.append({"temperature": e["temperature"], "tau": e["tau"]["macro"], "ci95": e["tau"]["ci95"],
                     "pooled": e["tau"]["pooled"], "num_steps": e["tau"]["num_steps"]})
    for row in rows:
        lo, hi = row["ci95"]
        print(f"{row['temperature']:<12g} {row['tau']:6.2f}  [{lo:5.2f}, {hi:5.2f}]   {row['pooled']:7.2f} "
              f"{row['num_steps']:>6}")
    n = len(temps) * args.num_samples
    print(f"\ncost of {len(temps)} temperatures x K={args.num_samples} samples ({n} sampled references per prompt) "
          f"next to the greedy job:")
    print(f"  cold cache: greedy {cold_g:6.1f}s, with sampling {cold_s:6.1f}s -> {cold_s / cold_g:5.2f}x "
          f"({(cold_s - cold_g) / n / cold_g:.2f}x a greedy job per sampled reference set)")
    print(f"  warm cache: greedy {warm_g:6.1f}s, with sampling {warm_s:6.1f}s -> {warm_s / warm_g:5.2f}x "
          f"({(warm_s - warm_g) / n / warm_g:.2f}x a greedy job per sampled reference set)")
    t = r["provenance"]["timings_s"]
    print("  cold sampled job, seconds by phase: " + ", ".join(f"{k} {v:.1f}" for k, v in t.items()))
    if args.json:
        Path(args.json).write_text(json.dumps({"checkpoint": str(ckpt), "rows": rows, "timings": {
            "cold_greedy_s": cold_g, "cold_sampled_s": cold_s, "warm_greedy_s": warm_g, "warm_sampled_s": warm_s},
            "num_samples": args.num_samples, "temperatures": temps, "phases": t}, indent=2))


if __name__ == "__main__":
    main()
