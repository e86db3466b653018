"""Greedy reference decoding: one prompt at a time vs batched across prompts vs batched speculative, one run.

    python bench/reference_decoding.py [--num-prompts 8] [--max-new-tokens 64] [--threads 1]
                                       [--drafter DIR] [--rows 16] [--repeat 1]

On the bundled tiny target, the built-in suite's first prompts (chat template applied):
  - one at a time: HF `generate` at batch 1 per prompt (what the engine did before, the lookahead then
    decoded again after a fresh prefill: here max_new_tokens + 7 tokens in one call, cheaper than that);
  - batched: `eval_worker.engine.decoding`, plain (one token per row per step), `--rows` prompts per forward;
  - batched speculative: the same with `--drafter`'s blocks verified (skipped without one).
Every way's tokens are checked equal before anything is printed; target steps counted each way.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from dflash_train.core.speculative import greedy_generate  # noqa: E402
from dflash_train.core.target import Target  # noqa: E402
from eval_worker.engine.decoding import DecodeStats, DrafterProposer, Row, decode  # noqa: E402
from eval_worker.engine.suite import load_suite  # noqa: E402

LOOKAHEAD = 7


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", type=int, default=16)
    ap.add_argument("--drafter", default=None)
    ap.add_argument("--repeat", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target = Target.load(REPO / "dflash_train/assets/tiny_target")
    suite = load_suite("builtin:coding-v1").head(args.num_prompts)
    prompts = [p.ids for p in suite.encode(target.tokenizer, None)]
    n = args.max_new_tokens + LOOKAHEAD
    proposer = None
    if args.drafter:
        from eval_worker.engine.checkpoint_source import open_drafter

        proposer = DrafterProposer(open_drafter(args.drafter, target)[0], target)

    def one_at_a_time():
        return [greedy_generate(target, list(p), n) for p in prompts], DecodeStats(target_steps=len(prompts) * (n - 1))

    def batched(prop):
        def run():
            rows, stats = [Row(i, list(p), lambda out: n) for i, p in enumerate(prompts)], DecodeStats()
            for _ in decode(target, rows, prop, max_rows=args.rows, stats=stats):
                pass
            return [r.result() for r in sorted(rows, key=lambda r: r.index)], stats
        return run

    ways = {"one at a time (HF generate, batch 1)": one_at_a_time, "batched plain": batched(None)}
    if proposer is not None:
        ways["batched speculative"] = batched(proposer)
    best: dict[str, float] = {}
    out: dict[str, tuple] = {}
    for _ in range(args.repeat):  # interleaved: a busy spell hits every way alike
        for name, fn in ways.items():
            t = time.perf_counter()
            out[name] = fn()
            best[name] = min(best.get(name, float("inf")), time.perf_counter() - t)
    first = next(iter(out.values()))[0]
    assert all(o[0] == first for o in out.values()), "the ways disagree"
    base = best[next(iter(best))]
    print(f"{len(prompts)} prompts x {n} tokens, {args.threads} thread(s), rows {args.rows}, fastest of {args.repeat}")
    for name in ways:
        print(f"  {name:40s} {best[name]:8.2f} s  {base / best[name]:5.2f}x  target steps {out[name][1].target_steps}")


if __name__ == "__main__":
    main()
