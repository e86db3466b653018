"""The engine at real shapes: phase times and peak memory vs the tiny target, hybrid
validation cost per step, and the arithmetic for a real Qwen3-8B evaluation.

    python bench/real_shapes.py [--num-prompts 8] [--max-new-tokens 64] [--threads 1]
                                [--contexts 256,2048] [--steps 8] [--hidden 512] [--parts phases,hybrid,estimate]

1. phases: one whole `Evaluator.evaluate` (cold: no cache) per target, each in a fresh
   process: the bundled tiny target (vocab 2,048), Qwen3 at vocab 151,936 and a wrapped
   hybrid Qwen3.5 at 248,320 (random weights, hidden 128, 8 layers: tests/support/factories.py),
   a random 1-layer B=16 drafter, the built-in coding suite. Per phase (references,
   features, draft, score): seconds, and peak RSS above the RSS once the target is loaded
   (RSS sampled every 0.5 ms; blocks over 128 KiB mmapped, so freed memory leaves RSS),
   next to the weights' own size. Also the peak of what the
   references phase used to do (full-sequence logits for the lookahead), for comparison.
2. hybrid: seconds per verify step of the real draft-verify loop (validation mode) on the
   hybrid target (width `--hidden`, so that the target's forward is what a step costs) at
   `--contexts` prompt lengths: re-running the whole sequence each step (before: the only way
   on recurrent layers) vs the incremental verify with recurrent-state rollback (now); plain
   Qwen3 of the same size for reference (its KV cache was always cropped).
3. estimate: the machine's measured fp32 matmul rate and copy bandwidth, the engine's
   measured drafting rate, and from them (and an H200's spec sheet) the arithmetic for a
   real Qwen3-8B evaluation of 23 prompts x 1.5k tokens. Printed as estimates.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

TINY = REPO / "dflash_train" / "assets" / "tiny_target"
SHAPES = ("tiny", "qwen3", "qwen3_5")
PHASES = ("references", "features", "draft", "score")


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class RssSampler:
    """Peak RSS per named phase (the phase is whatever `phase` holds when a sample is taken)."""

    def __init__(self):
        self.phase, self.peaks, self._stop = None, {}, threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            if self.phase is not None:
                self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), _rss())
            time.sleep(0.0005)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self.thread.join()


def build(shape: str):
    from dflash_train.core.target import Target
    from tests.support.factories import qwen3_5_real_shape, qwen3_real_shape, real_shape_drafter

    target = Target.load(TINY) if shape == "tiny" else {"qwen3": qwen3_real_shape,
                                                        "qwen3_5": qwen3_5_real_shape}[shape]()
    if shape == "tiny":
        from dflash_train.core.config import DrafterConfig
        from dflash_train.core.model import DFlashDrafter

        torch.manual_seed(1)
        drafter = DFlashDrafter(DrafterConfig.for_target(target.model.config, mask_token_id=target.mask_token_id(),
                                                         num_hidden_layers=1, num_features=5, block_size=16)).eval()
    else:
        drafter = real_shape_drafter(target, layers=1, block_size=16)
    return target, drafter


def child_phases(args) -> dict:
    """One cold evaluation in this (fresh) process."""
    from dflash_train.checkpoints.checkpoint import save_drafter
    from eval_worker.engine import acceptance
    from eval_worker.engine.acceptance import Evaluator
    from eval_worker.engine.suite import load_suite

    torch.set_num_threads(args.threads)
    target, drafter = build(args.child)
    weights = sum(t.numel() * t.element_size() for t in target.model.state_dict().values())
    with tempfile.TemporaryDirectory() as tmp:
        save_drafter(drafter, Path(tmp) / "ck")
        suite = load_suite("coding").head(args.num_prompts)
        suite.max_new_tokens = args.max_new_tokens
        base = _rss()
        sampler = RssSampler()
        timer = acceptance._timer

        @contextlib.contextmanager
        def tracked(timings, name):
            outer, sampler.phase = sampler.phase, name
            try:
                with timer(timings, name):
                    yield
            finally:
                sampler.phase = outer

        acceptance._timer = tracked
        with sampler:
            res = Evaluator(target, None).evaluate(Path(tmp) / "ck", suite,
                                                   options={"measure_speed": False, "tree_budget": 8})
        acceptance._timer = timer
        longest = max((r for r in res.prompts), key=lambda p: p.num_tokens)
        ids = suite.encode(target.tokenizer)[[p.name for p in res.prompts].index(longest.name)].ids
        before = _rss()
        old = old_references_peak(target, ids + [0] * longest.num_tokens) - before
    t = res.provenance["timings_s"]
    return {"shape": args.child, "vocab": target.vocab_size, "weights_mb": weights / 1e6,
            "seconds": {k: t.get(k, 0.0) for k in PHASES},
            "peak_extra_mb": {k: (sampler.peaks.get(k, base) - base) / 1e6 for k in PHASES},
            "old_references_extra_mb": old / 1e6, "tau": res.tau["macro"],
            "anchors": sum(p.num_tokens for p in res.prompts)}


def old_references_peak(target, ids: list[int]) -> int:
    """Peak RSS of what greedy_extend did before: the full model's logits over the sequence."""
    sampler = RssSampler()
    sampler.phase = "old"
    with sampler, torch.no_grad():
        target.model(input_ids=torch.tensor([ids])).logits[0, -1].argmax()
    return sampler.peaks["old"]


def phases(args) -> list[dict]:
    rows = []
    for shape in SHAPES:
        # glibc keeps freed heap pages: large blocks through mmap make RSS follow the live tensors
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
        out = subprocess.run([sys.executable, __file__, "--child", shape, "--num-prompts", str(args.num_prompts),
                              "--max-new-tokens", str(args.max_new_tokens), "--threads", str(args.threads)],
                             capture_output=True, text=True, check=True, env=env)
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    tiny = rows[0]
    print(f"\n1. one cold evaluation ({args.num_prompts} coding prompts x {args.max_new_tokens} tokens, random 1-layer "
          f"B=16 drafter, {args.threads} thread(s)); ratios vs the tiny target")
    print(f"{'target':<10} {'vocab':>7} {'weights':>9} | " + " | ".join(f"{p:>18}" for p in PHASES)
          + " | old refs peak")
    for r in rows:
        cells = []
        for p in PHASES:
            ratio = r["seconds"][p] / max(tiny["seconds"][p], 1e-9)
            cells.append(f"{r['seconds'][p]:6.2f}s {ratio:5.1f}x {r['peak_extra_mb'][p]:4.0f}M")
        print(f"{r['shape']:<10} {r['vocab']:>7} {r['weights_mb']:7.0f}MB | " + " | ".join(f"{c:>18}" for c in cells)
              + f" | {r['old_references_extra_mb']:6.0f}MB")
    print("(per phase: seconds, ratio to tiny, peak RSS above the loaded target; "
          "'old refs peak': full-sequence logits, what the references phase did before)")
    return rows


def hybrid(args) -> dict:
    from dflash_train.core.speculative import speculative_generate
    from tests.support.factories import qwen3_5_real_shape, qwen3_real_shape, real_shape_drafter

    torch.set_num_threads(args.threads)
    contexts = [int(c) for c in args.contexts.split(",")]
    out = {}
    for name, make in (("qwen3_5", qwen3_5_real_shape), ("qwen3", qwen3_real_shape)):
        target = make(hidden=args.hidden)
        drafter = real_shape_drafter(target, layers=1, block_size=16)
        g = torch.Generator().manual_seed(0)
        for ctx in contexts:
            prompt = torch.randint(0, 100000, (ctx,), generator=g).tolist()
            per = {}
            for mode, use_cache in (("full", False), ("incremental", None)):
                speculative_generate(target, drafter, prompt[:32], 3, use_cache=use_cache)  # warm-up
                runs = []
                for n in (2, args.steps + 2):  # the difference of two runs: the prompt's prefill cancels out
                    t = time.perf_counter()
                    res = speculative_generate(target, drafter, prompt, n, use_cache=use_cache)
                    runs.append((time.perf_counter() - t, len(res.accept_lengths)))
                per[mode] = (runs[1][0] - runs[0][0]) / (runs[1][1] - runs[0][1])
            out[(name, ctx)] = per
    print(f"\n2. real draft-verify loop (validation), seconds per verify step, {args.steps} steps, random drafter "
          f"(tau 1: every step rolls back), hidden {args.hidden}, 8 layers, {args.threads} thread(s)")
    for (name, ctx), per in out.items():
        print(f"  {name:<8} prompt {ctx:>5}: re-run whole sequence {per['full']:.3f}s   incremental "
              f"{per['incremental']:.3f}s   -> {per['full'] / per['incremental']:.1f}x")
    return out


def estimate(args, rows: list[dict] | None) -> dict:
    """Measured rates of this machine, and the arithmetic for a real Qwen3-8B evaluation."""
    torch.set_num_threads(args.threads)
    a, b = torch.randn(1024, 4096), torch.randn(4096, 4096)
    a @ b
    t = time.perf_counter()
    for _ in range(5):
        a @ b
    gflops = 5 * 2 * 1024 * 4096 * 4096 / (time.perf_counter() - t) / 1e9
    x = torch.empty(256 << 20, dtype=torch.uint8)
    x.clone()
    t = time.perf_counter()
    for _ in range(3):
        x.clone()
    bw = 3 * 2 * x.numel() / (time.perf_counter() - t) / 1e9  # read + write
    # Qwen3-8B: 36 layers, hidden 4096, vocab 151,936; z-lab drafter: 5 layers, B = 16
    P, N, prompt = 23, 1500, 200
    body, head = 2 * 6.95e9, 2 * 4096 * 151936  # FLOP per token: decoder stack; LM head
    drafter = 2 * 0.97e9 * 16 + 15 * head  # FLOP per anchor: block through 5 layers + head on 15 slots
    tokens, anchors = P * (prompt + N), P * N
    work = {"references": ("decode", P * N), "features": ("flop", tokens * body + anchors * head),
            "draft": ("flop", anchors * drafter)}
    weights_bf16, weights_fp32 = 16.4e9, 32.8e9
    eff_cpu = gflops
    if rows:  # the engine's own drafting rate on the real shapes (FLOP of the same formula / measured time)
        r = rows[1]
        hs = 128
        per_anchor = 2 * (12 * hs * hs) * 16 + 15 * 2 * hs * r["vocab"]  # 1-layer drafter, hidden 128, LM head
        eff_cpu = min(gflops, r["anchors"] * per_anchor / max(r["seconds"]["draft"], 1e-9) / 1e9)
    h200_flops, h200_bw = 989e12 * 0.4, 4.8e12 * 0.7  # spec sheet x assumed efficiency
    est = {}
    for phase, (kind, amount) in work.items():
        if kind == "decode":
            est[phase] = {"gpu_s": amount * weights_bf16 / h200_bw, "cpu_s": amount * weights_fp32 / (bw * 1e9)}
        else:
            est[phase] = {"gpu_s": amount / h200_flops, "cpu_s": amount / (eff_cpu * 1e9)}
    score_s = (rows[1]["seconds"]["score"] / rows[1]["anchors"] * anchors) if rows else 0.0
    est["score"] = {"gpu_s": score_s, "cpu_s": score_s}
    print(f"\n3. this machine: fp32 matmul {gflops:.0f} GFLOP/s, copy bandwidth {bw:.1f} GB/s, engine drafting at "
          f"{eff_cpu:.0f} GFLOP/s ({args.threads} thread(s))")
    print(f"ESTIMATE (arithmetic, not measured) for Qwen3-8B, {P} prompts x {N} tokens (B=16, 5-layer drafter):")
    for phase, e in est.items():
        print(f"  {phase:<10} one H200 ~{e['gpu_s']:8.1f} s    CPU (this machine's rates) ~{e['cpu_s'] / 3600:8.1f} h")
    tot_gpu = sum(e["gpu_s"] for e in est.values())
    tot_cpu = sum(e["cpu_s"] for e in est.values())
    per_ck_gpu = est["draft"]["gpu_s"] + est["score"]["gpu_s"]
    per_ck_cpu = est["draft"]["cpu_s"] + est["score"]["cpu_s"]
    print(f"  total      one H200 ~{tot_gpu / 60:.1f} min, CPU ~{tot_cpu / 3600:.0f} h; per further checkpoint "
          f"(references and features cached): H200 ~{per_ck_gpu:.0f} s, CPU ~{per_ck_cpu / 3600:.1f} h")
    return {"gflops": gflops, "bandwidth_gbs": bw, "engine_gflops": eff_cpu, "estimate": est}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--contexts", default="256,2048", help="prompt lengths for part 2")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512, help="target width for part 2 (the loop's cost is the target's)")
    ap.add_argument("--parts", default="phases,hybrid,estimate")
    ap.add_argument("--child", choices=SHAPES, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child_phases(args)))
        return
    parts = args.parts.split(",")
    rows = phases(args) if "phases" in parts else None
    if "hybrid" in parts:
        hybrid(args)
    if "estimate" in parts:
        estimate(args, rows)


if __name__ == "__main__":
    main()
