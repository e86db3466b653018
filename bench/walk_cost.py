"""Per-checkpoint cost: all-anchor drafting vs walk-driven drafting vs the reference loop, and the FLOP bound.

    python bench/walk_cost.py [--cases demo,tau8,qwen3,qwen3_5] [--num-prompts 8] [--max-new-tokens 128]
                              [--work DIR] [--threads 1] [--repeat 2] [--json OUT]

Per case, one process, warm caches (references and features computed by a first evaluation,
not timed), one thread, the two paths run alternately --repeat times each (fastest time of plain runs,
highest peak of runs under the RSS sampler):
  - today: `Evaluator.evaluate(..., drafting="all")`, a block at every anchor (whole call);
  - new: the same call with `drafting="walk"` (eval_worker/engine/walk.py); the two results
    are checked equal field for field (provenance aside) before anything is printed;
  - the reference loop: `speculative_generate` (step for step the published `dflash_generate`)
    on the same prompts, same checkpoint, the target's KV cache warm within each prompt;
  - the FLOP bound: drafter FLOPs of exactly the blocks the result needs (the greedy, tree and
    stride walks' blocks with the LM head up to each block's first miss, top-k as deep as the
    tree goes; the anchor sample and the leak probe's blocks on every slot; each prompt's
    context projected once) divided by this machine's measured fp32 matmul rate;
  - peak RSS above the loaded target during each call (sampled every 0.5 ms; large blocks via
    mmap so RSS tracks live memory);
  - peak live tensor bytes, deterministic (one run each under the torch profiler,
    tests/support/tensor_peak.py): of the whole call (on the evaluate cases the drafter's load sets
    it: its weights twice over) and of the drafting run (`Evaluator._run`: cached features, drafting,
    leak probe, scoring), above that run's start; the forced cases' calls are the drafting phase.

Cases: `demo` the bundled tiny target with a 2-layer B=16 drafter fitted briefly to the suite's
references (τ ≈ 1.8, the demo's range); `tau8` the same drafter fitted longer (τ ≈ 8);
`forced8` / `forced8_spine` / `forced8_peaked` τ ≈ 9 by construction, drafting phase only (`forced_case`; a
random drafter's flat distributions keep a plain tree near τ 1.9 there, a spine tree holds the chain, and so
does a plain tree when the drafter's logits are scaled up); `forced8_wide_peaked` the same construction at
vocab 151,936 and hidden 1024 (`WIDE_HIDDEN`, --real-max-new-tokens per prompt), where the drafter's and the
head's products are large enough to run near this machine's GEMM rate and the head's 622 MB weight is read
from memory by every head call;
`qwen3` / `qwen3_5` the real-shape fixtures at vocab 151,936 / 248,320 (tests/support/factories.py)
with a random drafter (τ ≈ 1 on their random weights). Fitted drafters are kept in --work, so a rerun skips fitting.
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

if "MALLOC_MMAP_THRESHOLD_" not in os.environ:  # RSS that tracks live memory (see eval_speed.py)
    os.execve(sys.executable, [sys.executable, *sys.argv],
              {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"})

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import numpy as np  # noqa: E402
import torch  # noqa: E402

from bench.eval_speed import TINY, peak_during  # noqa: E402
from tests.support.tensor_peak import marked, peak_live_bytes, tensor_events_during  # noqa: E402

CASES = {  # target, drafter layers, fit steps
    "demo": ("tiny", 2, 12),
    "tau8": ("tiny", 2, 40),
    "qwen3": ("qwen3", 1, 0),  # random drafter: τ ≈ 1 on a random target, where the head is all the cost
    "qwen3_5": ("qwen3_5", 1, 0),
}


def side_by_side(a, b, repeat: int, marks: list[int] | None = None):
    """(result, fastest seconds, highest RSS peak MiB, tensor peaks MiB) of a and of b, run alternately `repeat`
    times each, so a busy spell on the shared machine hits both alike. RSS peaks (and results) from runs under the
    RSS sampler; then one run each under the torch profiler: the peak of live tensor bytes allocated during the
    call (deterministic; `tensor_peak.py`), and, with `marks` (filled by a `tensor_peak.marked` phase, e.g.
    `Evaluator._run`), that phase's peak above its start (after the RSS runs: the profiler's own buffers leave
    the heap larger, and a later call's RSS started above its working set: 0.0 MB on the forced rows); times
    from the plain runs after them: the sampler's thread wakes every 0.5 ms and takes the GIL, which cost each
    call ~0.3 s on the tau-8 cases (both paths alike: flatter ratios)."""
    sampled: list[list] = [[], []]
    for _ in range(repeat):
        for k, fn in enumerate((a, b)):
            gc.collect()
            sampled[k].append(peak_during(fn))
    tensor = []
    for fn in (a, b):
        gc.collect()
        if marks is not None:
            marks.clear()
        _, events = tensor_events_during(fn)
        peaks = {"call": peak_live_bytes(events) / 2**20}
        if marks:
            peaks["run"] = peak_live_bytes(events, marks[0], marks[-1]) / 2**20
        tensor.append(peaks)
    plain: list[list] = [[], []]
    for _ in range(repeat):
        for k, fn in enumerate((a, b)):
            gc.collect()
            t = time.perf_counter()
            fn()
            plain[k].append(time.perf_counter() - t)
    return tuple((s[0][0], min(p), max(x[2] for x in s), tp)
                 for s, p, tp in zip(sampled, plain, tensor, strict=True))


def matmul_gflops(reps: int = 7) -> float:
    """Best fp32 GEMM rate of this machine (one [512, 1024] x [1024, 2048] product)."""
    a, b = torch.randn(512, 1024), torch.randn(1024, 2048)
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        a @ b
        best = min(best, time.perf_counter() - t)
    return 2 * 512 * 1024 * 2048 / best / 1e9


def load_case_target(kind: str):
    from dflash_train.core.target import Target

    if kind == "tiny":
        return Target.load(TINY)
    from tests.support.factories import qwen3_5_real_shape, qwen3_real_shape

    return qwen3_real_shape() if kind == "qwen3" else qwen3_5_real_shape()


def suite_for(target, n: int, max_new: int):
    from eval_worker.engine.suite import load_suite

    s = load_suite("coding").head(n)
    s.max_new_tokens = max_new
    return s


def fitted_checkpoint(target, kind, layers, steps, suite, work: Path, ev, lr: float = 1e-2) -> Path:
    """A B=16 drafter fitted `steps` passes over the suite's own references at Adam `lr` (kept in `work`)."""
    from dflash_train.checkpoints.checkpoint import save_drafter
    from dflash_train.core.config import DrafterConfig
    from dflash_train.core.model import DFlashDrafter
    from eval_worker.engine.cache import CacheReport
    from tests.support.engine_helpers import fit_drafter

    path = work / (f"{kind}-L{layers}-s{steps}-p{len(suite.prompts)}-n{suite.max_new_tokens}"
                   + ("" if lr == 1e-2 else f"-lr{lr:g}"))
    if (path / "config.json").is_file():
        return path
    torch.manual_seed(1)
    cfg = DrafterConfig.for_target(target.model.config, mask_token_id=target.mask_token_id(),
                                   num_hidden_layers=layers, num_features=3, block_size=16)
    eos = ev._eos(ev_options())
    refs, _ = ev._references(suite, suite.encode(target.tokenizer), suite.max_new_tokens, eos, 15, CacheReport())
    seqs = [r.prompt_ids + r.tokens for r in refs]
    drafter = DFlashDrafter(cfg).eval()
    if steps:
        drafter = fit_drafter(target, drafter, seqs, [len(r.prompt_ids) for r in refs], steps=steps, lr=lr)
    save_drafter(drafter, path)
    return path


def ev_options():
    from eval_worker.engine.options import EvalOptions

    return EvalOptions.from_dict({})


def drafter_flops(cfg, vocab: int) -> dict:
    """Multiply-adds x 2 of the drafter's parts: per block at `keys` visible keys, per head slot,
    per context position."""
    H, F, L = cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers  # F: the MLP width
    q, kv, B = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim, cfg.block_size
    return {"block": L * (2 * B * H * (2 * q + 2 * kv) + 2 * 3 * B * H * F),
            "block_per_key": L * 2 * 2 * B * q,  # scores and weighted values over each visible key
            "slot": 2 * H * vocab,
            "context": 2 * cfg.num_features * cfg.target_hidden_size * H + L * 2 * H * 2 * kv}


def required_flops(drafter, vocab: int, ev, refs, result, opts) -> float:
    """FLOPs of the blocks the result needs, from the walk itself (`walk.Walker` on the same inputs)."""
    from eval_worker.engine.cache import CacheReport
    from eval_worker.engine.leak_probe import LeakProbe, probe_offsets
    from eval_worker.engine.scoring import sample_offsets
    from eval_worker.engine.walk import Walker, WalkSeq, context_kv

    f = drafter_flops(drafter.config, vocab)
    B = drafter.config.block_size
    walker = Walker(drafter, ev.target.parts.embed_tokens, ev.target.parts.lm_head, topk=opts.tree_budget,
                    tree_budget=opts.tree_budget)
    quota = -(-opts.anchor_sample // len(refs))
    probe_quota = LeakProbe(B, opts.leak_probe_anchors, len(refs)).quota
    total = 0.0
    for ref in refs:
        P, n = len(ref.prompt_ids), len(ref.tokens)
        feats = ev._features(ref, result_suite(result), drafter.config.target_layer_ids, CacheReport())["features"]
        sample = sample_offsets(n, quota, opts.seed, ref.name)
        probe = probe_offsets(n, probe_quota, sample)  # as the engine picks them
        seq = WalkSeq(torch.tensor(ref.prompt_ids + ref.tokens), P, n, np.asarray(ref.ext),
                      full=np.union1d(sample, probe))
        got = walker.run([seq], [context_kv(drafter, feats[:P + n - 1])])[0]
        total += (P + n - 1) * f["context"]
        for off, need in got.need.items():
            total += f["block"] + (P + off + B) * f["block_per_key"] + need * f["slot"]
        total += len(probe) * (f["block"] + (P + n / 2 + B) * f["block_per_key"] + (B - 1) * f["slot"])  # its own pass
    return total


_SUITE: dict = {}


def result_suite(result):
    return _SUITE["suite"]


def run_case(name: str, args, work: Path) -> dict:
    from dflash_train.checkpoints.checkpoint import load_drafter
    from dflash_train.core.speculative import speculative_generate
    from eval_worker.engine.acceptance import Evaluator
    from eval_worker.engine.cache import CacheReport
    from eval_worker.engine.options import EvalOptions

    kind, layers, steps = CASES[name]
    max_new = args.max_new_tokens if kind == "tiny" else args.real_max_new_tokens
    target = load_case_target(kind)
    suite = suite_for(target, args.num_prompts, max_new)
    _SUITE["suite"] = suite
    cache = Path(tempfile.mkdtemp(dir=work))
    ev = Evaluator(target, cache, progress=False)
    ckpt = fitted_checkpoint(target, kind, layers, steps, suite, work, ev)
    # the anchor sample and the leak probe, scaled to this suite as their defaults are to 23 x 1.5k tokens
    tokens = len(suite.prompts) * max_new
    base = {"measure_speed": False, "tree_budget": 8, "anchor_sample": max(8, round(512 * tokens / 34_500)),
            "leak_probe_anchors": max(8, round(256 * tokens / 34_500))}
    ev.evaluate(ckpt, suite, options={**base, "drafting": "walk"})  # warm: references, features, one-time setup
    marks: list[int] = []
    # the drafting run (features from cache, drafting, leak probe, scoring)
    ev._run = marked(ev._run, marks)  # type: ignore[method-assign]
    (old, old_s, old_mb, old_t), (new, new_s, new_mb, new_t) = side_by_side(
        lambda: ev.evaluate(ckpt, suite, options={**base, "drafting": "all"}),
        lambda: ev.evaluate(ckpt, suite, options={**base, "drafting": "walk"}), args.repeat, marks)
    a, b = old.to_dict(), new.to_dict()
    for d in (a, b):
        d.pop("provenance"), d.pop("cache")
    assert a == b, "walk-driven and all-anchor results differ"
    drafter = load_drafter(ckpt)
    opts = EvalOptions.from_dict(base)
    eos = new.settings["eos_token_id"]
    refs, _ = ev._references(suite, suite.encode(target.tokenizer), new.settings["max_new_tokens"], eos,
                             new.settings["lookahead"], CacheReport())
    t = time.perf_counter()
    steps_loop = 0
    for ref in refs:
        steps_loop += len(speculative_generate(target, drafter, ref.prompt_ids, len(ref.tokens), eos).accept_lengths)
    loop_s = time.perf_counter() - t
    flops = required_flops(drafter, target.vocab_size, ev, refs, new, opts)
    bound_s = flops / (args.gflops * 1e9)
    tp = lambda r: r.provenance["timings_s"]  # noqa: E731
    return {"case": name, "vocab": target.vocab_size, "tau": new.tau["macro"], "tree_tau": new.tree["tau"],
            "prompts": len(refs), "tokens": sum(len(r.tokens) for r in refs),
            "today_s": old_s, "new_s": new_s, "today_draft_s": tp(old)["draft"], "new_draft_s": tp(new)["draft"],
            "loop_s": loop_s, "loop_steps": steps_loop, "flops": flops, "bound_s": bound_s,
            "blocks_today": old.provenance["drafting"]["blocks"], "blocks_new": new.provenance["drafting"]["blocks"],
            "head_slots_today": old.provenance["drafting"]["head_slots"],
            "head_slots_new": new.provenance["drafting"]["head_slots"],
            "peak_today_mb": old_mb, "peak_new_mb": new_mb, "tensor_today_mb": old_t["call"],
            "tensor_new_mb": new_t["call"], "run_tensor_today_mb": old_t["run"], "run_tensor_new_mb": new_t["run"],
            "speedup": old_s / new_s, "vs_loop": loop_s / new_s, "vs_bound": new_s / bound_s,
            "draft_vs_bound": tp(new)["draft"] / bound_s}


# Qwen3-8B with a 5-layer z-lab drafter (B=16), 23 prompts x 1.5k tokens (bench/README.md's estimate)
QWEN3_8B = dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=5, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128, block_size=16, num_features=5, target_hidden_size=4096)
QWEN3_8B_TOKENS, QWEN3_8B_PROMPT = 34_500, 150
CPU_ENGINE_GFLOPS = 12.0  # the engine's drafting rate on the real shapes here (bench/README.md)
H200_GFLOPS = 0.4 * 989e3  # bf16 dense spec sheet at an assumed 40 %


def qwen3_8b_estimate(row: dict) -> dict:
    """Arithmetic, not a measurement: this case's blocks and head slots per response token (sample and
    probe scaled to 34.5k tokens as here) at Qwen3-8B's shapes, today's path vs the walk."""
    from types import SimpleNamespace

    f = drafter_flops(SimpleNamespace(**QWEN3_8B), 151_936)
    keys = QWEN3_8B_PROMPT + 750 + 16  # mean visible keys of a block
    per_block = f["block"] + keys * f["block_per_key"]
    n = QWEN3_8B_TOKENS
    today = n * (per_block + 15 * f["slot"])
    new = n * (row["blocks_new"] / row["tokens"] * per_block + row["head_slots_new"] / row["tokens"] * f["slot"]
               + f["context"])
    return {"today_pflop": today / 1e15, "new_pflop": new / 1e15, "ratio": today / new,
            "cpu_h_today": today / (CPU_ENGINE_GFLOPS * 1e9) / 3600,
            "cpu_h_new": new / (CPU_ENGINE_GFLOPS * 1e9) / 3600,
            "h200_s_today": today / (H200_GFLOPS * 1e9), "h200_s_new": new / (H200_GFLOPS * 1e9)}


PEAK = 32.0  # forced8_peaked: logits x 32 (a random drafter's are flat: top-1 vs top-2 a few 0.01 apart)


WIDE_HIDDEN = 1024  # forced8_wide: a hidden size at which the drafter's and the head's GEMMs are compute-bound


def forced_inputs(args, peaked: bool = False, wide: bool = False):
    """The forced cases' inputs: (target, random 2-layer B=16 drafter, [(prompt, features, reference)],
    anchor-sample quota per prompt); see `forced_case`. The target is the tiny one, or with `wide` the
    Qwen3 real-shape fixture at hidden `WIDE_HIDDEN` (vocab 151,936; only its embedding and head
    are used), `args.real_max_new_tokens` tokens per prompt."""
    from dflash_train.core.config import DrafterConfig
    from dflash_train.core.model import DFlashDrafter
    from tests.support.engine_helpers import forced_reference
    from tests.support.factories import qwen3_real_shape

    target = qwen3_real_shape(hidden=WIDE_HIDDEN) if wide else load_case_target("tiny")
    torch.manual_seed(1)
    cfg = DrafterConfig.for_target(target.model.config, mask_token_id=target.mask_token_id(), num_hidden_layers=2,
                                   num_features=3, block_size=16)
    drafter = DFlashDrafter(cfg).eval()
    if peaked:
        with torch.no_grad():
            drafter.norm.weight.mul_(PEAK)
    B, n, V = 16, (args.real_max_new_tokens if wide else args.max_new_tokens), target.vocab_size
    rng = np.random.default_rng(0)
    embed, head = target.parts.embed_tokens, target.parts.lm_head  # the construction drafts with this target

    seqs = []
    for i in range(args.num_prompts):
        prompt = rng.integers(4, V - 1, 24).tolist()
        feats = torch.randn(len(prompt) + n + B, cfg.num_features * target.hidden_size,
                            generator=torch.Generator().manual_seed(i))
        # accepts uniform in 0..B-1: τ ≈ 8.5
        ext = forced_reference(drafter, embed, head, V, feats, prompt, n, "random", rng)
        seqs.append((prompt, feats, ext))
    quota = max(1, -(-max(8, round(512 * n * len(seqs) / 34_500)) // len(seqs)))
    return target, drafter, seqs, quota


def forced_all(drafter, embed, head, seqs, n: int, quota: int, spine: bool) -> list:
    """Today's path on the forced inputs: `draft_anchors` at every anchor, then `score_prompt`."""
    from eval_worker.engine.drafting import draft_anchors
    from eval_worker.engine.scoring import sample_offsets, score_prompt

    out = []
    for j, (prompt, feats, ext) in enumerate(seqs):
        P = len(prompt)
        ids = torch.tensor(prompt + ext[:n])
        d = draft_anchors(drafter, embed, head, ids, feats, np.arange(P, P + n), topk=8, topk_slots=8)
        out.append(score_prompt(f"p{j}", ext, n, d, drafter.config.block_size,
                                sample=sample_offsets(n, quota, 0, f"p{j}"), tree_budget=8, tree_spine=spine,
                                max_blocks=None, counting="response", ends_with_stop=False))
    return out


def forced_walk(drafter, embed, head, seqs, n: int, quota: int, spine: bool):
    """The walk on the forced inputs, prompts in groups whose context keys fit the budget, as the engine
    walks them: (scores, `Walker` results, `WalkSeq`s)."""
    from eval_worker.engine.scoring import sample_offsets, score_blocks
    from eval_worker.engine.walk import GroupKV, Walker, WalkSeq, context_kv, group_kv_budget, walk_groups

    B, V = drafter.config.block_size, head.weight.shape[0]
    walker = Walker(drafter, embed, head, topk=8, tree_budget=8, tree_spine=spine)
    lengths = [len(p) + n - 1 for p, _, _ in seqs]
    budget = group_kv_budget(drafter, [(len(p), n) for p, _, _ in seqs], V, tree_depths=8)
    ws = [WalkSeq(torch.tensor(prompt + ext[:n]), len(prompt), n, np.asarray(ext),
                  full=sample_offsets(n, quota, 0, f"p{j}")) for j, (prompt, _, ext) in enumerate(seqs)]
    got: list = []
    for group in walk_groups(drafter, lengths, budget):  # as the engine groups and stores them
        kv = GroupKV(drafter, [lengths[j] for j in group])
        for row, j in enumerate(group):
            kv.add(row, context_kv(drafter, seqs[j][1][:lengths[j]]))
        got += walker.run([ws[j] for j in group], kv)
    out = []
    for j, (w, g) in enumerate(zip(ws, got, strict=True)):
        st = np.full(n, -1)
        st[list(g.streak)] = list(g.streak.values())
        out.append(score_blocks(f"p{j}", seqs[j][2], n, B, st, g.tree_streaks.__getitem__, w.full,
                                np.stack([g.argmax[o] for o in w.full.tolist()]), max_blocks=None,
                                counting="response", ends_with_stop=False))
    return out, got, ws


def forced_case(args, spine: bool = False, peaked: bool = False, wide: bool = False) -> dict:
    """τ ≈ 8 by construction, drafting phase only: the tiny target's shapes, a random 2-layer B=16
    drafter, random features, and references that follow the drafter's own blocks for a random
    `a` (uniform in 0..B-1) accepted slots per step, then a token it did not propose (the
    construction of tests/support/engine_helpers.forced_reference). `draft_anchors` + `score_prompt` (today) vs
    `Walker` + `score_blocks` (new, prompts grouped as the engine groups them) on the same inputs,
    results checked equal; each run once
    untimed first (one-time costs: code paths paged in, allocator pools).
    `peaked`: the drafter's final norm scaled by `PEAK`, so its logits are too (same argmax, the
    same references): distributions as peaked as a trained drafter's, whose plain tree holds the chain."""
    target, drafter, seqs, quota = forced_inputs(args, peaked, wide)
    cfg = drafter.config
    embed, head = target.parts.embed_tokens, target.parts.lm_head
    B, n, V = cfg.block_size, (args.real_max_new_tokens if wide else args.max_new_tokens), target.vocab_size
    tokens = n * len(seqs)

    def today():
        return forced_all(drafter, embed, head, seqs, n, quota, spine)

    def new():
        return forced_walk(drafter, embed, head, seqs, n, quota, spine)

    today(), new()  # warm
    (old, old_s, old_mb, old_t), ((fresh, got, ws), new_s, new_mb, new_t) = side_by_side(today, new, args.repeat)
    for a, b in zip(old, fresh, strict=True):
        assert a.online.accept_lengths == b.online.accept_lengths
        assert a.tree_online.accept_lengths == b.tree_online.accept_lengths
        assert a.stride == b.stride and a.tree_below_chain == b.tree_below_chain and (a.match_sum == b.match_sum).all()
    f = drafter_flops(cfg, V)
    flops = 0.0
    for w, g in zip(ws, got, strict=True):
        flops += (w.prompt_len + n - 1) * f["context"]
        for off, need in g.need.items():
            flops += f["block"] + (w.prompt_len + off + B) * f["block_per_key"] + need * f["slot"]
    tau_ = float(np.mean([a.online.tau for a in old]))
    bound_s = flops / (args.gflops * 1e9)
    return {"case": "forced8" + ("_wide" if wide else "") + ("_spine" if spine else "") + ("_peaked" if peaked else ""),
            "vocab": V, "tau": tau_,
            "tree_tau": float(np.mean([a.tree_online.tau for a in old])),
            "prompts": len(seqs), "tokens": tokens, "today_s": old_s, "new_s": new_s, "today_draft_s": old_s,
            "new_draft_s": new_s, "loop_s": float("nan"), "loop_steps": 0, "flops": flops, "bound_s": bound_s,
            "blocks_today": tokens, "blocks_new": sum(g.blocks for g in got),
            "head_slots_today": tokens * (B - 1), "head_slots_new": sum(g.head_slots for g in got),
            "peak_today_mb": old_mb, "peak_new_mb": new_mb, "tensor_today_mb": old_t["call"],
            "tensor_new_mb": new_t["call"], "run_tensor_today_mb": old_t["call"], "run_tensor_new_mb": new_t["call"],
            "speedup": old_s / new_s, "vs_loop": float("nan"),
            "vs_bound": new_s / bound_s, "draft_vs_bound": new_s / bound_s}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="demo,tau8,qwen3,qwen3_5")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128, help="reference tokens, tiny target")
    p.add_argument("--real-max-new-tokens", type=int, default=64, help="reference tokens, real-shape targets")
    p.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "dflash-walk-bench"))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeat", type=int, default=2, help="alternate runs per path: fastest time, highest peak")
    p.add_argument("--json")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    args.gflops = matmul_gflops()
    print(f"matmul rate: {args.gflops:.1f} GFLOP/s fp32, {args.threads} thread(s)")
    rows = []
    hdr = (f"{'case':>8} {'vocab':>7} {'tau':>5} {'today s':>8} {'new s':>7} {'x':>5} {'loop s':>7} {'vs loop':>7} "
           f"{'bound s':>8} {'new/bound':>9} {'draft/bound':>11} {'blocks':>11} {'RSS MB':>13} {'tensor MB':>13} "
           f"{'run tensor MB':>13}")
    for name in args.cases.split(","):
        r = (forced_case(args, "spine" in name, "peaked" in name, "wide" in name) if name.startswith("forced8")
             else run_case(name, args, work))
        rows.append(r)
        if len(rows) == 1:
            print(hdr)
        print(f"{name:>8} {r['vocab']:>7} {r['tau']:>5.2f} {r['today_s']:>8.2f} {r['new_s']:>7.2f} "
              f"{r['speedup']:>4.1f}x {r['loop_s']:>7.2f} {r['vs_loop']:>6.1f}x {r['bound_s']:>8.3f} "
              f"{r['vs_bound']:>8.2f}x {r['draft_vs_bound']:>10.2f}x {r['blocks_today']:>5}/{r['blocks_new']:<5} "
              f"{r['peak_today_mb']:>6.1f}/{r['peak_new_mb']:<6.1f} "
              f"{r['tensor_today_mb']:>6.2f}/{r['tensor_new_mb']:<6.2f} "
              f"{r['run_tensor_today_mb']:>6.2f}/{r['run_tensor_new_mb']:<6.2f}", flush=True)
    print("\nQwen3-8B estimate (arithmetic: each case's blocks and head slots per token at Qwen3-8B shapes):")
    for r in rows:
        e = r["qwen3_8b"] = qwen3_8b_estimate(r)
        print(f"{r['case']:>8} τ {r['tau']:.2f}: {e['today_pflop']:.2f} -> {e['new_pflop']:.2f} PFLOP "
              f"({e['ratio']:.1f}x); "
              f"CPU {e['cpu_h_today']:.0f} h -> {e['cpu_h_new']:.1f} h; one H200 {e['h200_s_today']:.1f} s -> "
              f"{e['h200_s_new']:.1f} s")
    if args.json:
        Path(args.json).write_text(json.dumps({"gflops": args.gflops, "cases": rows}, indent=2))


if __name__ == "__main__":
    main()
