"""Measured costs of one speculative step on this machine: draft, verify, plain decode.

Each is timed the way the real loop runs it (`dflash_train.core.speculative`): the drafter
with a warm context cache plus a few new context positions, the target verifying B
tokens on a warm KV cache, and the target decoding one token on the same cache.

The three are timed in interleaved rounds and each keeps its fastest round: a worker
often shares its machine (with training, on a CPU box), and interference only ever adds
time, so the minimum is the stable estimate and interleaving lets a slow spell hit all
three alike instead of skewing their ratio.
"""
from __future__ import annotations

import json
import platform
import time

import torch

from dflash_train.core import cache_compat
from dflash_train.core.model import DFlashDrafter, DraftCache, mask_blocks
from dflash_train.core.target import Target, VerifyCache
from eval_worker.engine.cache import DiskCache, digest


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
                       reps: int = 7, committed: int | None = None) -> dict | None:
    """Seconds for (draft, verify, decode-one-token) at `context_len`; None if not measurable.

    On a hybrid target (recurrent layers) a verify step also pays the rollback the real
    loop does when drafts are rejected: the accepted tokens run through the target again.
    `committed` (default: 1) is the number of tokens a typical step keeps, e.g. round(τ).
    """
    cache = VerifyCache(target)
    if not cache.rewindable:
        return None  # sliding-window target layers have dropped the positions a crop would need

    cfg, dev = drafter.config, target.device
    B = cfg.block_size
    committed = max(1, min(B, committed or 1))
    gen = torch.Generator().manual_seed(0)
    hi = min(target.vocab_size, cfg.vocab_size)
    ids = torch.randint(0, hi, (1, context_len), generator=gen)
    ids[ids == cfg.mask_token_id] = 0
    ids = ids.to(dev)
    feats = target.forward(ids, cfg.layer_ids, past_key_values=cache.kv, use_cache=True).features
    cache.save()  # every timed call starts from this warm cache
    embed, ddtype = target.parts.embed_tokens, drafter.fc.weight.dtype
    dcache = DraftCache(cfg.num_hidden_layers)
    old = context_len - new_context
    drafter(embed(ids[:, :B]).to(ddtype), torch.arange(old, old + B, device=dev)[None], feats[:, :old],
            torch.arange(old, device=dev)[None], cache=dcache)
    block = mask_blocks(ids[:, -B], B, cfg.mask_token_id)
    positions = torch.arange(context_len, context_len + B, device=dev)[None]
    new_pos = torch.arange(old, context_len, device=dev)[None]

    def draft():
        c = DraftCache(cfg.num_hidden_layers)  # same warm context each time
        c.keys, c.values = list(dcache.keys), list(dcache.values)
        h = drafter(embed(block).to(ddtype), positions, feats[:, old:], new_pos, cache=c)
        target.parts.lm_head(h[:, 1:].to(target.parts.lm_head.weight.dtype)).argmax(-1)

    def verify():
        out = target.forward(block, cfg.layer_ids, past_key_values=cache.kv, use_cache=True)
        target.parts.lm_head(out.last_hidden).argmax(-1)
        cache.rewind(context_len, block[:, :committed], cfg.layer_ids)  # what the loop does next
        cache.restore(context_len)

    def decode():
        out = target.forward(block[:, :1], cfg.layer_ids, past_key_values=cache.kv, use_cache=True)
        target.parts.lm_head(out.last_hidden).argmax(-1)
        cache.restore(context_len)

    best = _fastest_interleaved({"draft_s": draft, "verify_s": verify, "decode_s": decode}, reps, dev)
    return {**best, "context_len": context_len, "recurrent_layers": len(cache.recurrent),
            "committed_per_step": committed}


class StepCosts:
    """Measured step costs, one measurement per (target, device and host, drafter shape and dtype, context
    length; on a hybrid target also the tokens a step commits, which its rollback re-runs), kept in memory and
    in the cache directory (kind "step_costs"): later checkpoints of a run, and the next process on the same
    machine, read it instead of timing again (~0.1-1 s a checkpoint on the tiny target's CPU run, more on a
    real target). The costs depend on shapes, not weights, so a checkpoint's τ changes nothing else here."""

    KIND = "step_costs"

    def __init__(self, disk: DiskCache | None = None):
        self.disk = disk if disk is not None else DiskCache(None)
        self.memory: dict[str, dict | None] = {}
        self.measured = 0  # fresh measurements made (the rest were read)

    def get(self, target: Target, drafter: DFlashDrafter, context_len: int, committed: int) -> tuple[dict | None, bool]:
        """(costs, read from the cache) at `context_len`; costs None where not measurable."""
        from transformers import DynamicCache

        recurrent = bool(cache_compat.recurrent_layers(DynamicCache(config=target.model.config)))
        key = {"target_fingerprint": target.fingerprint(), "device": str(target.device), "host": platform.node(),
               "torch": torch.__version__, "threads": torch.get_num_threads(),
               "drafter": drafter.config.to_dict(), "drafter_dtype": str(drafter.fc.weight.dtype),
               "context_len": context_len, "committed": committed if recurrent else None}
        key = json.loads(json.dumps(key))  # as the cache file holds it (tuples are lists there)
        slot = digest(key)
        if slot in self.memory:
            return self.memory[slot], True
        look = self.disk.get_json(self.KIND, slot, key)
        if look.status == "hit" and isinstance(look.value, dict) and "costs" in look.value:
            self.memory[slot] = look.value["costs"]
            return self.memory[slot], True
        costs = measure_step_costs(target, drafter, context_len=context_len, committed=committed)
        self.measured += 1
        self.memory[slot] = costs
        self.disk.put_json(self.KIND, slot, key, {"costs": costs})
        return costs, False
