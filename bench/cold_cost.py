"""The first evaluation (cold) and a later one (warm) vs the reference loop, at τ ≈ 1.3 and τ ≈ 7, one run.

    python bench/cold_cost.py [--cases low,high] [--num-prompts 32] [--max-new-tokens 128] [--repeat 3] [--parts]
                              [--flops] [--threads 1] [--work DIR] [--json OUT]

The bundled tiny target, the built-in coding suite (chat template applied), B=16 two-layer drafters
fitted to the suite's references (`walk_cost.fitted_checkpoint`, kept in --work; `CASES`): `low` (τ ≈ 1.3,
a run's early checkpoint), `high` (τ ≈ 7). Issue 37's sizes, 32 prompts x 128 tokens, by default; `CASES`
also has fits for 8 x 64 (a quicker look; fixed costs weigh more there). A fit uses every core (it is not
timed; ~8 s a pass at 32 x 128 on the 2-core VM), the timings --threads.
Per case, in interleaved rounds (fastest of --repeat):
  - loop: `speculative_generate` (step for step the published `dflash_generate`) over every prompt;
  - cold: a new `Evaluator` on an empty cache directory (references decoded, features computed, the
    step costs measured): run defaults, and `drafting="walk"`;
  - warm: the same `Evaluator` again (references and features cached): run defaults, `drafting="walk"`,
    and the defaults less one part at a time (no leak probe, no step-cost timing, no tree) to show
    what each part of the defaults costs.
With --flops, each way's matrix-product FLOPs (one more untimed run) and the best ratio to the loop they allow at
this machine's single-thread GEMM peak: a goal above that ratio cannot be met by making the code faster, only by
doing less work.
Every result's τ is checked equal to the loop's (macro over prompts) and the references to the loop's tokens
before anything is printed. Target steps: the loop's verify steps; the engine's reference decoding steps
(batched: one forward serves every row of a batch) plus one features pass per prompt.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import torch  # noqa: E402

# (passes, Adam lr) fitting a 2-layer B=16 drafter to the suite's references, per (prompts, tokens). On the tiny
# target at 32 x 128, lr 3e-3: 22 passes τ 1.29, 30 passes τ 1.46, 48 τ 3.5, 60 τ 7.43,
# 72 τ 11.9, 84 τ 15.1 (memorized). At 8 x 64, lr 3e-3: 40 passes
# τ 1.57, 60 passes τ 7.8, 64 passes τ 9.6 (80: 15.9, memorized); lr 1e-2 at 40 passes: τ 1.2
CASES = {(32, 128): {"low": (22, 3e-3), "high": (60, 3e-3)},
         (8, 64): {"low": (40, 3e-3), "high": (60, 3e-3)}}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="low,high")
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "dflash-cold-bench"))
    p.add_argument("--parts", action="store_true", help="also time warm defaults less each part")
    p.add_argument("--oracle-tau", type=float, default=7.0,
                   help="also time the references alone, plain vs speculative, with an oracle drafter "
                        "at this τ (0: off)")
    p.add_argument("--flops", action="store_true",
                   help="also count each way's GEMM FLOPs (one more untimed run each) and the best ratio they "
                        "allow at this machine's GEMM peak")
    p.add_argument("--json")
    args = p.parse_args()
    if (args.num_prompts, args.max_new_tokens) not in CASES:
        p.error(f"no fitted cases for {args.num_prompts} x {args.max_new_tokens}: {sorted(CASES)}")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    rows = [run_case(name, args, work) for name in args.cases.split(",") if name]
    if args.oracle_tau:
        rows.append(oracle_references(args))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


def run_case(name: str, args, work: Path) -> dict:
    from bench.walk_cost import fitted_checkpoint, load_case_target, suite_for
    from dflash_train.checkpoints.checkpoint import load_drafter
    from dflash_train.core.speculative import speculative_generate
    from eval_worker.engine.acceptance import Evaluator

    target = load_case_target("tiny")
    suite = suite_for(target, args.num_prompts, args.max_new_tokens)
    fit_cache = work / "fit-cache"
    passes, lr = CASES[(args.num_prompts, args.max_new_tokens)][name]
    torch.set_num_threads(os.cpu_count() or 1)  # the fit is not timed
    ckpt = fitted_checkpoint(target, "tiny", 2, passes, suite, work, Evaluator(target, fit_cache, progress=False),
                             lr=lr)
    torch.set_num_threads(args.threads)
    drafter = load_drafter(ckpt)
    prompts = [q.ids for q in suite.encode(target.tokenizer)]
    eos = Evaluator(target, fit_cache, progress=False)._eos(_opts({}))
    base = {"max_new_tokens": args.max_new_tokens}
    walk = {**base, "drafting": "walk"}
    loop_out: dict = {}

    def loop():
        res = [speculative_generate(target, drafter, q, args.max_new_tokens, eos) for q in prompts]
        loop_out["steps"] = sum(len(r.accept_lengths) for r in res)
        loop_out["tau"] = float(np.mean([r.tau for r in res]))
        loop_out["tokens"] = [r.tokens for r in res]
        return res

    def cold(options):
        def run():
            ev = Evaluator(target, tempfile.mkdtemp(dir=work), progress=False)
            return ev.evaluate(ckpt, suite, options=options)
        return run

    warm_ev = Evaluator(target, tempfile.mkdtemp(dir=work), progress=False)
    for options in (base, walk, base):  # references, features; both drafting paths measured for `auto`
        warm_ev.evaluate(ckpt, suite, options=options)

    def warm(options):
        return lambda: warm_ev.evaluate(ckpt, suite, options=options)

    ways = {"loop": loop, "cold defaults": cold(base), "cold walk": cold(walk),
            "warm defaults": warm(base), "warm walk": warm(walk)}
    if args.parts:
        ways.update({"warm defaults, no leak probe": warm({**base, "leak_probe_anchors": 0}),
                     "warm defaults, no step cost": warm({**base, "measure_speed": False}),
                     "warm defaults, no tree": warm({**base, "tree_budget": 0})})
    best: dict[str, float] = {}
    out: dict[str, object] = {}
    for _ in range(args.repeat):  # interleaved: a busy spell on the shared machine hits every way alike
        for way, fn in ways.items():
            gc.collect()
            t = time.perf_counter()
            out[way] = fn()
            best[way] = min(best.get(way, float("inf")), time.perf_counter() - t)
    flops = {way: gemm_flops(fn) for way, fn in ways.items()} if args.flops else {}
    for way, r in out.items():
        if way == "loop":
            continue
        assert abs(r.tau["macro"] - loop_out["tau"]) < 1e-9, (way, r.tau["macro"], loop_out["tau"])
        assert [q["num_tokens"] for q in r.to_dict()["prompts"]] == [len(t) for t in loop_out["tokens"]], way
    refs = out["cold defaults"].provenance["references"]
    row = {"case": name, "tau": loop_out["tau"], "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
           "loop_steps": loop_out["steps"], "reference_steps": refs["target_steps"],
           "reference_decoding": refs["decoding"], "seconds": best,
           "vs_loop": {w: best["loop"] / s for w, s in best.items()},
           "timings_cold_defaults": out["cold defaults"].provenance["timings_s"],
           "timings_warm_defaults": out["warm defaults"].provenance["timings_s"],
           "drafting_warm_defaults": out["warm defaults"].provenance["drafting"]["path"], "gemm_gflop": flops}
    print(f"\n{name}: τ {row['tau']:.2f}, {len(prompts)} prompts x {args.max_new_tokens} tokens, "
          f"{args.threads} thread(s), fastest of {args.repeat}")
    print(f"  target steps: loop {row['loop_steps']}; engine cold {row['reference_steps']} reference steps "
          f"({refs['decoding']}, batched, speculative steps kept: {refs.get('speculative_steps')}) "
          f"+ {len(prompts)} features passes")
    peak = gemm_peak() if flops else 0.0
    if flops:
        row["gemm_peak_gflops"] = peak
        print(f"  GEMM FLOPs per way (torch.utils.flop_counter; attention and elementwise work not counted), and the "
              f"best ratio they allow at this machine's single-thread GEMM peak ({peak:.0f} GFLOP/s, measured "
              f"now): the loop's seconds over each way's FLOPs at that peak")
    for way, s in best.items():
        floor = (f"  {flops[way][0]:6.1f} GFLOP, at most {best['loop'] * peak / flops[way][0]:5.2f}x "
                 f"{flops[way][1]}") if flops else ""
        print(f"  {way:34s} {s:7.2f} s  {row['vs_loop'][way]:5.2f}x the loop{floor}")
    print("  cold defaults' timings:", row["timings_cold_defaults"])
    print("  warm defaults' timings:", row["timings_warm_defaults"], "path", row["drafting_warm_defaults"])
    return row


def gemm_flops(fn) -> tuple[float, str]:
    """GFLOP of the matrix products one more (untimed) run of `fn` makes, and its drafting path ("" for the loop):
    `auto` may time its other path on that run."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        r = fn()
    path = r.provenance["drafting"]["path"] if hasattr(r, "provenance") else ""
    return counter.get_total_flops() / 1e9, path


def gemm_peak() -> float:
    """GFLOP/s of the drafter's and the target's largest products here ([448, 256] x [256, 704], a 28-row
    verify's MLP), the fastest of a few seconds: what no way can beat per FLOP."""
    x, w = torch.randn(448, 256), torch.randn(704, 256)
    best = 0.0
    for _ in range(5):
        t, n = time.perf_counter(), 0
        while time.perf_counter() - t < 0.2:
            torch.nn.functional.linear(x, w)
            n += 1
        best = max(best, 2 * 448 * 256 * 704 * n / (time.perf_counter() - t) / 1e9)
    return best


class Oracle:
    """Proposes the greedy continuation (known) with each block cut at a random slot: the next token there is
    wrong, so a verify commits about `tau` tokens; stands in for a drafter at that τ (references only)."""

    def __init__(self, truth: list[list[int]], block_size: int, tau: float, vocab: int):
        self.truth, self.B, self.vocab = truth, block_size, vocab
        self.rng = np.random.default_rng(0)
        self.p = min(1.0, 1.0 / max(tau - 1.0, 1e-9))  # geometric streaks: mean accepted drafts tau - 1
        self.layer_ids: list[int] = []

    def propose(self, row) -> list[int]:
        at = len(row.out)
        true = list(self.truth[row.index][at:at + self.B - 1]) + [7] * self.B
        stop = int(min(self.rng.geometric(self.p) - 1, self.B - 1))
        return [t if k < stop else (t + 1) % self.vocab for k, t in enumerate(true[:self.B - 1])]


def oracle_references(args) -> dict:
    """The references alone, batched plain vs batched speculative at a forced τ (the decoder's own cost)."""
    from bench.walk_cost import load_case_target, suite_for
    from eval_worker.engine.decoding import DecodeStats, Row, decode

    torch.set_num_threads(args.threads)
    target = load_case_target("tiny")
    suite = suite_for(target, args.num_prompts, args.max_new_tokens)
    prompts = [q.ids for q in suite.encode(target.tokenizer)]
    n = args.max_new_tokens + 15

    def run(prop):
        rows, stats = [Row(i, list(q), lambda out: n) for i, q in enumerate(prompts)], DecodeStats()
        for _ in decode(target, rows, prop, stats=stats):
            pass
        return [r.result() for r in sorted(rows, key=lambda r: r.index)], stats, rows

    truth, plain_stats, _ = run(None)
    best: dict[str, float] = {}
    for _ in range(args.repeat):
        for way in ("plain", "speculative"):
            oracle = Oracle(truth, 16, args.oracle_tau, target.vocab_size) if way == "speculative" else None
            t = time.perf_counter()
            got, stats, rows = run(oracle)
            best[way] = min(best.get(way, float("inf")), time.perf_counter() - t)
            assert got == truth
            if oracle is not None:
                tau = float(np.mean([a for r in rows for a in r.accepts]))
                spec_stats = stats
    print(f"\nreferences alone, oracle drafter at τ {tau:.2f} ({len(prompts)} x {n} tokens, fastest of {args.repeat}):")
    print(f"  batched plain        {best['plain']:7.2f} s  target steps {plain_stats.target_steps}")
    print(f"  batched speculative  {best['speculative']:7.2f} s  target steps {spec_stats.target_steps} "
          f"(kept: {spec_stats.speculative})  {best['plain'] / best['speculative']:.2f}x")
    return {"case": "oracle_references", "tau": tau, "seconds": best, "plain_steps": plain_stats.target_steps,
            "speculative_steps": spec_stats.target_steps}


def _opts(d):
    from eval_worker.engine.options import EvalOptions

    return EvalOptions.from_dict(d)


if __name__ == "__main__":
    main()
