"""Measured costs of one speculative step on this machine: draft, verify, plain decode.

Each is timed the way the real loop runs it (`dflash_train.speculative`): the drafter
with a warm context cache plus a few new context positions, the target verifying B
tokens on a warm KV cache, and the target decoding one token on the same cache.
"""
from __future__ import annotations

import statistics
import time

import torch

from dflash_train.model import DFlashDrafter, DraftCache
from dflash_train.speculative import _supports_crop
from dflash_train.target import Target, crop_cache


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _median_time(fn, reps: int, dev: torch.device) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        _sync(dev)
        t = time.perf_counter()
        fn()
        _sync(dev)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


@torch.no_grad()
def measure_step_costs(target: Target, drafter: DFlashDrafter, context_len: int = 256, new_context: int = 4,
                       reps: int = 5) -> dict | None:
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

    return {"draft_s": _median_time(draft, reps, dev), "verify_s": _median_time(run_target(B), reps, dev),
            "decode_s": _median_time(run_target(1), reps, dev), "context_len": context_len}
