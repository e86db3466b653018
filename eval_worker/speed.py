"""Measured costs of one speculative step on this machine: draft, verify, plain decode.

Each is timed the way the real loop runs it (`dflash_train.speculative`): the drafter
with a warm context cache plus a few new context positions, the target verifying B
tokens on a warm KV cache, and the target decoding one token on the same cache.

The three are timed in interleaved rounds and each keeps its fastest round: a worker
often shares its machine (with training, on a CPU box), and interference only ever adds
time, so the minimum is the stable estimate and interleaving lets a slow spell hit all
three alike instead of skewing their ratio.
"""
from __future__ import annotations

import time

import torch

from dflash_train.model import DFlashDrafter, DraftCache
from dflash_train.speculative import _supports_crop
from dflash_train.target import Target, crop_cache


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _fastest_interleaved(fns: dict, reps: int, dev: torch.device) -> dict[str, float]:
    """Best time of each function over `reps` rounds that run them all in turn."""
    for fn in fns.values():
        fn()  # warm-up
    best = {name: float("inf") for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            _sync(dev)
            t = time.perf_counter()
            fn()
            _sync(dev)
            best[name] = min(best[name], time.perf_counter() - t)
    return best


@torch.no_grad()
def measure_step_costs(target: Target, drafter: DFlashDrafter, context_len: int = 256, new_context: int = 4,
                       reps: int = 7) -> dict | None:
    """Seconds for (draft, verify, decode-one-token) at `context_len`; None if not measurable."""
    if not _supports_crop(target):
        return None  # recurrent layers: the verify cost model differs (full re-verification)
    from transformers import DynamicCache

    cfg, dev = drafter.config, target.device
    B = cfg.block_size
    gen = torch.Generator().manual_seed(0)
    hi = min(target.vocab_size, cfg.vocab_size)
    ids = torch.randint(0, hi, (1, context_len), generator=gen)
    ids[ids == cfg.mask_token_id] = 0
    ids = ids.to(dev)
    kv = DynamicCache(config=target.model.config)
    feats = target.forward(ids, cfg.target_layer_ids, past_key_values=kv, use_cache=True).features
    embed, ddtype = target.parts.embed_tokens, drafter.fc.weight.dtype
    dcache = DraftCache(cfg.num_hidden_layers)
    old = context_len - new_context
    drafter(embed(ids[:, :B]).to(ddtype), torch.arange(old, old + B, device=dev)[None], feats[:, :old],
            torch.arange(old, device=dev)[None], cache=dcache)
    block = ids[:, -B:].clone()
    block[0, 1:] = cfg.mask_token_id
    positions = torch.arange(context_len, context_len + B, device=dev)[None]
    new_pos = torch.arange(old, context_len, device=dev)[None]

    def draft():
        c = DraftCache(cfg.num_hidden_layers)  # same warm context each time
        c.keys, c.values = list(dcache.keys), list(dcache.values)
        h = drafter(embed(block).to(ddtype), positions, feats[:, old:], new_pos, cache=c)
        target.parts.lm_head(h[:, 1:].to(target.parts.lm_head.weight.dtype)).argmax(-1)

    def run_target(n):
        def fn():
            out = target.forward(block[:, :n], cfg.target_layer_ids, past_key_values=kv, use_cache=True)
            target.parts.lm_head(out.last_hidden).argmax(-1)
            crop_cache(kv, context_len)
        return fn

    best = _fastest_interleaved({"draft_s": draft, "verify_s": run_target(B), "decode_s": run_target(1)}, reps, dev)
    return {**best, "context_len": context_len}
