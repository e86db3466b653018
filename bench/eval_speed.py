"""Eval engine speed and memory, measured side by side.

    python bench/eval_speed.py [--target DIR|random] [--checkpoint DIR] [--num-prompts 8]
                               [--max-new-tokens 128] [--memory-anchors 16,64,256,1024,2048]

1. Time per evaluated block: the engine (`Evaluator.evaluate` with a warm cache: whole
   call, all anchors drafted, every metric) vs two one-block-per-forward loops over the
   same blocks, same checkpoint:
   - the seeds' loop (what their harness did): per block, one target forward over the
     context and the block (the drafter's features and the target's labels, nothing
     cached), then one drafter forward on that block alone, LM head on the block;
   - the drafter-only loop: the same but reading the engine's cached target features, so
     only the drafter's context projection is redone per block. It isolates what batching
     the anchors buys; its ratio is bounded by arithmetic (see bench/README.md).
   Also the time to τ: the engine vs the real draft-and-verify loop (KV-cached target),
   which only drafts the online walk's blocks.
2. Peak extra memory of drafting N anchors (fixed ~2k-token context, anchors at its end):
   the engine's chunked drafting vs one unchunked pass ([N*B, vocab] logits at once).
   Each point runs in a fresh process; RSS is sampled every 0.5 ms.

Defaults: the bundled tiny target (random weights of its shape if it is not built yet),
a random-init 1-layer B=16 drafter, the built-in coding suite, one CPU thread.
"""
from __future__ import annotations

import argparse
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

import numpy as np  # noqa: E402
import torch  # noqa: E402

TINY = REPO / "dflash_train" / "assets" / "tiny_target"


def load_target(spec: str):
    from dflash_train.core.target import Target

    if spec != "random" and Path(spec).joinpath("config.json").is_file():
        return Target.load(spec)
    from transformers import Qwen3Config, Qwen3ForCausalLM

    print(f"[bench] {spec} not available: random Qwen3 of the tiny target's shape", file=sys.stderr)
    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=4096, hidden_size=256, intermediate_size=768, num_hidden_layers=8,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
                      tie_word_embeddings=True)
    t = Target(Qwen3ForCausalLM(cfg).float())
    t.source = "random-tiny-shape"
    return t


def make_checkpoint(target, path: Path, block_size: int = 16, layers: int = 1, features: int = 3) -> Path:
    from dflash_train.checkpoints.checkpoint import save_drafter
    from dflash_train.core.config import DrafterConfig
    from dflash_train.core.model import DFlashDrafter

    torch.manual_seed(1)
    mask = target.mask_token_id()
    cfg = DrafterConfig.for_target(target.model.config, mask_token_id=1 if mask is None else mask,
                                   num_hidden_layers=layers, num_features=features, block_size=block_size)
    save_drafter(DFlashDrafter(cfg).eval(), path)
    return path


def suite_for(target, n: int, max_new: int):
    from eval_worker.engine.suite import Prompt, Suite, load_suite

    if target.tokenizer is not None:
        s = load_suite("coding").head(n)
        s.max_new_tokens = max_new
        return s
    g = torch.Generator().manual_seed(0)
    return Suite("rand", "1", [Prompt(f"p{i}", ids=tuple(torch.randint(4, 4000, (24,), generator=g).tolist()))
                               for i in range(n)], chat_template=False, max_new_tokens=max_new)


def time_per_block(args) -> dict:
    from dflash_train.checkpoints.checkpoint import load_drafter
    from eval_worker.engine.acceptance import Evaluator
    from eval_worker.engine.cache import CacheReport
    from eval_worker.engine.drafting import draft_one_block

    target = load_target(args.target)
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = Path(args.checkpoint) if args.checkpoint else make_checkpoint(
            target, Path(tmp) / "ck", layers=args.drafter_layers, features=args.features)
        suite = suite_for(target, args.num_prompts, args.max_new_tokens)
        ev = Evaluator(target, Path(tmp) / "cache")
        opts = {"measure_speed": False, "tree_budget": 8}
        t = time.perf_counter()
        ev.evaluate(ckpt, suite, options=opts)
        cold_s = time.perf_counter() - t
        warm_ev = Evaluator(target, Path(tmp) / "cache")  # new evaluator: the disk cache is what is warm
        t = time.perf_counter()
        warm = warm_ev.evaluate(ckpt, suite, options=opts)
        warm_s = time.perf_counter() - t
        assert warm.cache["features"] == "hit", warm.cache
        blocks = sum(p.num_tokens for p in warm.prompts)
        walk_blocks = warm.tau["num_steps"]

        drafter = load_drafter(ckpt)
        embed, head = target.parts.embed_tokens, target.parts.lm_head
        B, layer_ids = drafter.config.block_size, drafter.config.target_layer_ids
        naive_s, naive_n, walk_s = 0.0, 0, 0.0
        seeds_s, seeds_n = 0.0, 0
        refs, _ = warm_ev._references(suite, suite.encode(target.tokenizer), warm.settings["max_new_tokens"],
                                   warm.settings["eos_token_id"], warm.settings["lookahead"], CacheReport())
        for ref, pr in zip(refs, warm.prompts, strict=False):  # the same cached inputs the engine used
            ids = torch.tensor(ref.prompt_ids + ref.tokens)
            feats = warm_ev._features(ref, suite, drafter.config.target_layer_ids, CacheReport())["features"]
            P = len(ref.prompt_ids)
            walk = {P + a for a in np.cumsum([0] + pr.accept_lengths[:-1])}  # where the online walk drafts
            for a in range(P, P + len(ref.tokens)):
                t = time.perf_counter()
                draft_one_block(drafter, embed, head, ids, feats, a, topk=8)
                dt = time.perf_counter() - t
                naive_s += dt
                naive_n += 1
                if a in walk:
                    walk_s += dt
            for a in range(P, P + len(ref.tokens), args.seeds_stride):  # slow: a sample of the same blocks
                t = time.perf_counter()
                out = target.forward(ids[None, :a + B], layer_ids)
                target.greedy_tokens(out.last_hidden[0, a:a + B])  # what the block is checked against
                draft_one_block(drafter, embed, head, ids, out.features[0], a, topk=8)
                seeds_s += time.perf_counter() - t
                seeds_n += 1
        spec_s = 0.0
        from dflash_train.core.speculative import speculative_generate

        for ref in refs:  # the real draft-and-verify loop on the same prompts
            t = time.perf_counter()
            speculative_generate(target, drafter, ref.prompt_ids, len(ref.tokens), warm.settings["eos_token_id"])
            spec_s += time.perf_counter() - t
    per_engine, per_naive, per_seeds = warm_s / blocks, naive_s / naive_n, seeds_s / seeds_n
    return {"target": target.source, "prompts": len(warm.prompts), "blocks": blocks, "walk_blocks": walk_blocks,
            "engine_cold_s": cold_s, "engine_warm_s": warm_s, "engine_ms_per_block": 1e3 * per_engine,
            "seeds_loop_ms_per_block": 1e3 * per_seeds, "seeds_loop_blocks_timed": seeds_n,
            "ratio_per_block_vs_seeds_loop": per_seeds / per_engine,
            "loop_ms_per_block": 1e3 * per_naive, "ratio_per_block": per_naive / per_engine,
            "loop_walk_only_s": walk_s, "ratio_time_to_tau": walk_s / warm_s, "tau": warm.tau["macro"],
            "spec_loop_s": spec_s, "ratio_time_to_tau_vs_spec_loop": spec_s / warm_s,
            "engine_timings_s": warm.provenance["timings_s"]}


def context_sweep(args) -> list[dict]:
    """ms per block, engine drafting vs the one-block loop, as the context grows (same drafter)."""
    from dflash_train.checkpoints.checkpoint import load_drafter
    from eval_worker.engine.drafting import draft_anchors, draft_one_block

    target = load_target(args.target)
    with tempfile.TemporaryDirectory() as tmp:
        drafter = load_drafter(make_checkpoint(target, Path(tmp) / "ck", layers=args.drafter_layers,
                                               features=args.features))
    embed, head = target.parts.embed_tokens, target.parts.lm_head
    out = []
    for S in [int(x) for x in args.contexts.split(",")]:
        ids = torch.randint(4, min(4000, target.vocab_size), (S,), generator=torch.Generator().manual_seed(0))
        feats = torch.randn(S, drafter.fc.in_features, generator=torch.Generator().manual_seed(1))
        anchors = np.arange(S - 128, S)
        t = time.perf_counter()
        draft_anchors(drafter, embed, head, ids, feats, anchors, topk=8, topk_slots=8)
        eng = (time.perf_counter() - t) / len(anchors)
        sample = anchors[:: len(anchors) // 16]
        t = time.perf_counter()
        for a in sample:
            draft_one_block(drafter, embed, head, ids, feats, int(a), topk=8)
        loop = (time.perf_counter() - t) / len(sample)
        out.append({"context": S, "engine_ms": 1e3 * eng, "loop_ms": 1e3 * loop, "ratio": loop / eng})
    return out


# --- memory -------------------------------------------------------------------------
def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_during(fn):
    """(fn(), seconds, peak RSS above the start in MiB), RSS sampled every 0.5 ms on a thread."""
    base, peak, stop = rss_bytes(), [0], threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], rss_bytes())
            time.sleep(0.0005)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    t = time.perf_counter()
    try:
        out = fn()
    finally:
        el = time.perf_counter() - t
        stop.set()
        th.join()
    return out, el, (max(peak[0], rss_bytes()) - base) / 2**20


def memory_point(target_spec: str, n: int, mode: str, layers: int, features: int) -> dict:
    """Runs in a child process: peak extra RSS while drafting n anchors."""
    import ctypes
    import gc

    from eval_worker.engine.drafting import draft_anchors, head_topk

    torch.set_num_threads(1)
    target = load_target(target_spec)
    with tempfile.TemporaryDirectory() as tmp:
        from dflash_train.checkpoints.checkpoint import load_drafter

        drafter = load_drafter(make_checkpoint(target, Path(tmp) / "ck", layers=layers, features=features))
    S = 2100
    ids = torch.randint(4, min(4000, target.vocab_size), (S,), generator=torch.Generator().manual_seed(0))
    feats = torch.randn(S, drafter.fc.in_features, generator=torch.Generator().manual_seed(1))
    anchors = np.arange(S - n, S)
    embed, head = target.parts.embed_tokens, target.parts.lm_head
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    def run():
        with torch.no_grad():
            if mode == "engine":
                draft_anchors(drafter, embed, head, ids, feats, anchors, topk=8, topk_slots=8)
            else:  # one pass over every anchor, the head on all rows at once
                hidden = drafter.forward_blocks(embed, ids[None], feats[None], torch.as_tensor(anchors)[None])
                B = drafter.config.block_size
                rows = hidden.view(-1, B, hidden.shape[-1])[:, 1:].reshape(-1, hidden.shape[-1])
                head_topk(head, rows, 8, rows_per_chunk=rows.shape[0])

    _, el, peak_mb = peak_during(run)
    return {"anchors": n, "mode": mode, "peak_extra_mb": peak_mb, "seconds": el}


def memory_curve(args) -> list[dict]:
    out = []
    for n in [int(x) for x in args.memory_anchors.split(",")]:
        for mode in ("engine", "unchunked"):
            if mode == "unchunked" and n > args.unchunked_max:
                continue
            cmd = [sys.executable, __file__, "--_memory-point", f"{n}:{mode}", "--target", args.target,
                   "--drafter-layers", str(args.drafter_layers), "--features", str(args.features)]
            # large blocks via mmap: freed memory leaves RSS at once, so RSS tracks live memory
            # (glibc's heap otherwise keeps freed chunks and RSS only ever grows)
            env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"}
            res = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
            out.append(json.loads(res.stdout.strip().splitlines()[-1]))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", default=str(TINY))
    p.add_argument("--checkpoint")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--seeds-stride", type=int, default=4, help="time the seeds' loop on every k-th block")
    p.add_argument("--drafter-layers", type=int, default=1)
    p.add_argument("--features", type=int, default=3, help="target layers feeding the drafter")
    p.add_argument("--contexts", default="128,512,2048", help="context lengths for the per-block sweep")
    p.add_argument("--memory-anchors", default="16,64,256,1024,2048")
    p.add_argument("--unchunked-max", type=int, default=256, help="largest N for the unchunked pass (it grows fast)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--skip-memory", action="store_true")
    p.add_argument("--json")
    p.add_argument("--_memory-point", dest="memory_point")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    if args.memory_point:
        n, mode = args.memory_point.split(":")
        print(json.dumps(memory_point(args.target, int(n), mode, args.drafter_layers, args.features)))
        return
    speed = time_per_block(args)
    print(f"target {speed['target']}: {speed['prompts']} prompts, {speed['blocks']} blocks "
          f"({speed['walk_blocks']} on the online walk), τ={speed['tau']:.3f}")
    print(f"engine, warm cache : {speed['engine_ms_per_block']:.3f} ms/block  "
          f"(whole evaluate {speed['engine_warm_s']:.2f}s; cold {speed['engine_cold_s']:.2f}s)")
    print(f"seeds' loop        : {speed['seeds_loop_ms_per_block']:.3f} ms/block "
          f"(target + drafter forward per block; {speed['seeds_loop_blocks_timed']} blocks timed)")
    print(f"ratio per block    : {speed['ratio_per_block_vs_seeds_loop']:.1f}x  (goal >= 20x)")
    print(f"drafter-only loop  : {speed['loop_ms_per_block']:.3f} ms/block (cached features) "
          f"-> {speed['ratio_per_block']:.1f}x")
    print(f"time to τ          : engine {speed['engine_warm_s']:.2f}s vs real draft-and-verify loop "
          f"{speed['spec_loop_s']:.2f}s -> {speed['ratio_time_to_tau_vs_spec_loop']:.1f}x; vs drafter-only loop "
          f"over the walk's blocks {speed['loop_walk_only_s']:.2f}s -> {speed['ratio_time_to_tau']:.1f}x")
    sweep = context_sweep(args) if args.contexts else []
    if sweep:
        print("\nper block as the context grows (128 anchors at the end of the context):")
        print(f"{'context':>8} {'engine ms':>10} {'loop ms':>8} {'ratio':>6}")
        for r in sweep:
            print(f"{r['context']:>8} {r['engine_ms']:>10.3f} {r['loop_ms']:>8.3f} {r['ratio']:>5.1f}x")
    mem = [] if args.skip_memory else memory_curve(args)
    if mem:
        print("\npeak extra memory while drafting N anchors (context 2100 tokens):")
        print(f"{'N':>6} {'engine MB':>10} {'unchunked MB':>13} {'engine s':>9}")
        for n in sorted({m['anchors'] for m in mem}):
            e = next(m for m in mem if m["anchors"] == n and m["mode"] == "engine")
            u = next((m for m in mem if m["anchors"] == n and m["mode"] == "unchunked"), None)
            print(f"{n:>6} {e['peak_extra_mb']:>10.1f} {format(u['peak_extra_mb'], '.1f') if u else '-':>13} "
                  f"{e['seconds']:>9.2f}")
        from eval_worker.engine.drafting import anchors_per_pass

        chunk = anchors_per_pass(16, context_len=2100, heads=4, dense=True)
        eng = [m for m in mem if m["mode"] == "engine"]
        full = [m for m in eng if m["anchors"] >= chunk] or eng
        print(f"engine drafts {chunk} anchors per pass; peak from N={full[0]['anchors']} to N={full[-1]['anchors']}: "
              f"{full[-1]['peak_extra_mb'] / max(full[0]['peak_extra_mb'], 1e-9):.2f}x "
              f"for {full[-1]['anchors'] / full[0]['anchors']:.0f}x the anchors")
    if args.json:
        Path(args.json).write_text(json.dumps({"speed": speed, "context_sweep": sweep, "memory": mem}, indent=2))


if __name__ == "__main__":
    main()
