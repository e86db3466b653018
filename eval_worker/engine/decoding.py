"""The references' decoder: the target's greedy continuations of many prompts, batched, plain or speculative.

Rows (prompts) of different lengths share one target forward per step. Left padding, and the
drafts a row rejected, stay in the shared cache but are masked out (a 2-D attention mask over
the cache's slots) and every row's positions are explicit, so a row computes what it would
alone (the same argmax up to float reassociation: the engine's features pass checks every
reference against its own argmax, `Evaluator._references`).

- plain (`proposer=None`): one token per row per target step;
- speculative: a drafter proposes a block per row, one forward verifies every row's block,
  and each row keeps its drafts up to the first that differs from the target's argmax, plus
  the target's own token there: lossless greedy speculative decoding (the same rule as
  `dflash_train.core.speculative`), so the output is the target's greedy output at about
  one target step per τ tokens instead of one per token.

Targets whose cache cannot hold a row's holes decode one row at a time: a hybrid target (a
linear-attention layer keeps one recurrent state, which padding or a rejected draft would
run through) verifies with the incremental rewind (`VerifyCache`: recurrent states restored
and advanced over the accepted tokens); a sliding-window target (the window counts cache
slots, holes included, and drops old ones, so it cannot be rewound) decodes plainly.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from dflash_train.core import cache_compat
from dflash_train.core.masks import cached_block_mask
from dflash_train.core.model import DFlashDrafter, DraftCache, mask_blocks
from dflash_train.core.target import Target, VerifyCache

DEFAULT_ROWS = 32  # prompts per batch: one forward per step serves them all (a 32-prompt suite: one batch)
# compact the shared cache when the masked slots exceed the longest row's live ones by this factor
COMPACT_RATIO = 1.0


def row_batchable(target: Target) -> bool:
    """True when rows of different lengths can share one cache: attention layers only, no sliding window."""
    from transformers import DynamicCache

    cache = DynamicCache(config=target.model.config)
    if cache_compat.recurrent_layers(cache) or not cache_compat.rewindable(cache):
        return False
    cfg = target.parts.text_config
    types = getattr(cfg, "layer_types", None)
    if types is not None:
        return all(t == "full_attention" for t in types)
    return getattr(cfg, "sliding_window", None) is None or not getattr(cfg, "use_sliding_window", True)


def rewindable(target: Target) -> bool:
    """True when a rejected draft can be taken back from one row's cache (`VerifyCache`): not past a sliding window."""
    from transformers import DynamicCache

    return cache_compat.rewindable(DynamicCache(config=target.model.config)) and (
        row_batchable(target) or bool(cache_compat.recurrent_layers(DynamicCache(config=target.model.config))))


@dataclass
class Row:
    """One prompt's decoding: `context` (the prompt, and any continuation known) and what was decoded after it."""

    index: int
    context: list[int]
    done: Callable[[list[int]], int | None]  # decoded so far -> the length at which the row is complete (None: unknown)
    out: list[int] = field(default_factory=list)
    accepts: list[int] = field(default_factory=list)  # per target step (after the prefill): tokens it committed
    dcache: DraftCache | None = None
    feats: torch.Tensor | None = None  # target features of positions the drafter has not seen yet, [1, n, F]

    def finished(self) -> bool:
        need = self.done(self.out)
        return need is not None and len(self.out) >= need

    def result(self) -> list[int]:
        need = self.done(self.out)
        return self.out[:need] if need is not None else self.out


class DrafterProposer:
    """A DFlash drafter's block for a row (its own context cache per row), as the reference loop drafts it."""

    def __init__(self, drafter: DFlashDrafter, target: Target):
        self.drafter, self.target = drafter, target
        self.block_size = drafter.config.block_size
        self.layer_ids = list(drafter.config.layer_ids)

    @torch.no_grad()
    def propose(self, row: Row) -> list[int]:
        cfg, dev = self.drafter.config, self.target.device
        embed, head = self.target.parts.embed_tokens, self.target.parts.lm_head
        if row.dcache is None:
            row.dcache = DraftCache(cfg.num_hidden_layers)
        start = len(row.context) + len(row.out) - 1
        block = mask_blocks(torch.tensor([row.out[-1]], device=dev), self.block_size, cfg.mask_token_id)
        positions = torch.arange(start, start + self.block_size, device=dev)[None]
        ctx_pos = torch.arange(row.dcache.length, start, device=dev)[None]
        hidden = self.drafter(embed(block).to(self.drafter.fc.weight.dtype), positions, row.feats, ctx_pos,
                              mask=None, cache=row.dcache)
        return head(hidden[:, 1:].to(head.weight.dtype)).argmax(-1)[0].tolist()

    @torch.no_grad()
    def propose_many(self, rows: list[Row]) -> list[list[int]]:
        """Every row's block in one drafter forward: each row's new context goes into its own cache (a few
        positions), then the rows' caches are stacked, left-padded and masked, and their blocks drafted together
        (one call instead of one per row: at 8-16 rows the per-row calls cost more than the verify they feed).
        The drafts may differ from `propose`'s at near-ties (other float sums); any drafts give the same
        references (the verify keeps only the target's tokens), only the steps they take can change."""
        if len(rows) == 1:
            return [self.propose(rows[0])]
        cfg, dev, drafter = self.drafter.config, self.target.device, self.drafter
        embed, head = self.target.parts.embed_tokens, self.target.parts.lm_head
        starts, caches = [], []
        for row in rows:
            if row.dcache is None:
                row.dcache = DraftCache(cfg.num_hidden_layers)
            dcache = row.dcache
            caches.append(dcache)
            start = len(row.context) + len(row.out) - 1
            starts.append(start)
            if row.feats is not None and row.feats.shape[1] > 0:  # the row's new context keys, into its cache
                ctx = drafter.hidden_norm(drafter.fc(row.feats.to(drafter.fc.weight.dtype)))
                cos, sin = drafter.rotary_emb(ctx, torch.arange(dcache.length, start, device=dev)[None])
                for i, layer in enumerate(drafter.layers):
                    attn: Any = layer.self_attn  # an nn.Module attribute: typed Tensor | Module
                    dcache.extend(i, *attn.key_value(ctx, cos, sin))
                row.feats = row.feats[:, :0]
        lengths = [c.length for c in caches]
        width = max(lengths)
        valid = torch.zeros(len(rows), width, dtype=torch.bool, device=dev)
        ctx_pos = torch.zeros(len(rows), width, dtype=torch.long, device=dev)
        for j, n in enumerate(lengths):
            valid[j, width - n:] = True
            ctx_pos[j, width - n:] = torch.arange(n, device=dev)
        stacked = DraftCache(cfg.num_hidden_layers)
        for i in range(cfg.num_hidden_layers):
            for part, out in ((0, stacked.keys), (1, stacked.values)):
                layer_kv = [c.keys[i] if part == 0 else c.values[i] for c in caches]
                first = layer_kv[0]
                assert first is not None  # every row's context holds at least its prompt
                buf = first.new_zeros(len(rows), first.shape[1], width, first.shape[3])
                for j, t in enumerate(layer_kv):
                    assert t is not None
                    buf[j, :, width - lengths[j]:] = t[0]
                out[i] = buf
        positions = torch.tensor(starts, device=dev)[:, None] + torch.arange(self.block_size, device=dev)[None]
        keys_ok = torch.cat([valid, torch.ones(len(rows), self.block_size, dtype=torch.bool, device=dev)], dim=1)
        masks, built = [], {}
        for spec in cfg.attention():
            if spec not in built:
                m = cached_block_mask(positions, ctx_pos, *spec)
                built[spec] = keys_ok[:, None, None, :] if m is None else m & keys_ok[:, None, None, :]
            masks.append(built[spec].expand(-1, 1, self.block_size, -1))
        block = mask_blocks(torch.tensor([r.out[-1] for r in rows], device=dev), self.block_size, cfg.mask_token_id)
        hidden = drafter(embed(block).to(drafter.fc.weight.dtype), positions, None, None, mask=masks, cache=stacked)
        return head(hidden[:, 1:].to(head.weight.dtype)).argmax(-1).tolist()


@dataclass
class DecodeStats:
    target_steps: int = 0  # target forwards after the prefills (a hybrid row's re-run over accepted tokens included)
    rows: int = 0
    tokens: int = 0
    speculative: bool | None = None  # the last batch's choice: speculative steps (True) or plain (False)


@torch.no_grad()
def decode(target: Target, rows: list[Row], proposer: DrafterProposer | None = None, max_rows: int = DEFAULT_ROWS,
           stats: DecodeStats | None = None, adaptive: bool = True) -> Iterator[list[Row]]:
    """Decode every row until it is `finished()`; yields each batch's rows when they are done.

    Rows are batched by context length (little padding). `proposer`: speculative decoding with
    its blocks (None: plain); `adaptive`: speculative steps only where they commit tokens cheaper than plain ones
    (timed on the first steps of each batch). Targets that cannot share a cache across rows take one row at a time."""
    stats = stats if stats is not None else DecodeStats()
    if proposer is not None and not rewindable(target):
        proposer = None  # a sliding-window cache cannot take a rejected draft back: plain decoding
    per = max_rows if row_batchable(target) else 1
    order = sorted(rows, key=lambda r: len(r.context))
    for i in range(0, len(order), per):
        batch = order[i:i + per]
        if per == 1:
            _decode_one(target, batch[0], proposer, stats)
        else:
            _decode_batch(target, batch, proposer, stats, adaptive)
        stats.rows += len(batch)
        stats.tokens += sum(len(r.out) for r in batch)
        yield batch


def _propose(proposer, rows: list[Row]) -> list[list[int]]:
    """Every row's drafts: in one call where the proposer batches rows, else row by row."""
    many = getattr(proposer, "propose_many", None)
    return many(rows) if many is not None else [proposer.propose(r) for r in rows]


def _choose(target: Target, last_hidden: torch.Tensor) -> torch.Tensor:
    return target.greedy_tokens(last_hidden)


def _accept(row: Row, drafts: list[int], posterior: list[int]) -> int:
    """Drafts kept up to the first that differs from the target's token there; the target's token after them."""
    n = 0
    while n < len(drafts) and drafts[n] == posterior[n]:
        n += 1
    row.out.extend(drafts[:n] + [posterior[n]])
    row.accepts.append(n + 1)
    return n


def _decode_one(target: Target, row: Row, proposer: DrafterProposer | None, stats: DecodeStats) -> None:
    """One row, its own cache: attention layers cropped, recurrent states restored and advanced (`VerifyCache`)."""
    dev = target.device
    layer_ids = proposer.layer_ids if proposer else []
    cache = VerifyCache(target)
    out = target.forward(torch.tensor([row.context], device=dev), layer_ids, past_key_values=cache.kv, use_cache=True)
    row.out.append(int(_choose(target, out.last_hidden[:, -1:])[0, 0]))
    row.feats = out.features
    while not row.finished():
        start = len(row.context) + len(row.out) - 1
        drafts = proposer.propose(row) if proposer else []
        block = torch.tensor([[row.out[-1], *drafts]], device=dev)
        if drafts:
            cache.save()
        vout = target.forward(block, layer_ids, past_key_values=cache.kv, use_cache=True,
                              position_ids=torch.arange(start, start + block.shape[1], device=dev)[None])
        stats.target_steps += 1
        n = _accept(row, drafts, _choose(target, vout.last_hidden)[0].tolist())
        row.feats = vout.features[:, : n + 1]
        if drafts:
            before = cache.length
            cache.rewind(start, block[:, : n + 1], layer_ids)
            stats.target_steps += int(bool(cache.recurrent) and start + n + 1 < before)


def _decode_batch(target: Target, rows: list[Row], proposer: DrafterProposer | None, stats: DecodeStats,
                  adaptive: bool = True) -> None:
    """Rows in one cache: left padding and rejected drafts masked out, positions explicit."""
    from transformers import DynamicCache

    dev = target.device
    layer_ids = proposer.layer_ids if proposer else []
    kv = cache_compat.spare_room(DynamicCache(config=target.model.config))  # no copy of the cache per step
    width = max(len(r.context) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long, device=dev)
    mask = torch.zeros(len(rows), width, dtype=torch.bool, device=dev)
    for j, r in enumerate(rows):
        ids[j, width - len(r.context):] = torch.tensor(r.context, device=dev)
        mask[j, width - len(r.context):] = True
    pos = (mask.long().cumsum(1) - 1).clamp(min=0)
    out = target.forward(ids, layer_ids, attention_mask=mask.long(), position_ids=pos, past_key_values=kv,
                         use_cache=True)
    first = _choose(target, out.last_hidden[:, -1:])[:, 0].tolist()
    for j, r in enumerate(rows):
        r.out.append(first[j])
        r.feats = out.features[j:j + 1, width - len(r.context):]
    live = [r for r in rows if not r.finished()]
    if len(live) < len(rows):
        mask = _select(kv, mask, [rows.index(r) for r in live])
    choice = _Choice(proposer is not None, adaptive)
    while live:
        use = proposer if choice.speculative() else None
        t0 = time.perf_counter()
        drafts = _propose(use, live) if use else [[] for _ in live]
        k = 1 + len(drafts[0])
        block = torch.tensor([[r.out[-1], *d] for r, d in zip(live, drafts, strict=True)], device=dev)
        starts = torch.tensor([len(r.context) + len(r.out) - 1 for r in live], device=dev)
        positions = starts[:, None] + torch.arange(k, device=dev)[None]
        mask = torch.cat([mask, torch.ones(len(live), k, dtype=torch.bool, device=dev)], dim=1)
        vout = target.forward(block, layer_ids if choice.drafting() else [], attention_mask=mask.long(),
                              position_ids=positions, past_key_values=kv, use_cache=True)
        stats.target_steps += 1
        posterior = _choose(target, vout.last_hidden).tolist()
        committed = 0
        for j, (r, d) in enumerate(zip(live, drafts, strict=True)):
            n = _accept(r, d, posterior[j])
            committed += n + 1
            mask[j, mask.shape[1] - k + n + 1:] = False  # the rejected drafts' slots
            if choice.drafting():  # the drafter's next context: what it has not seen yet
                new = vout.features[j:j + 1, : n + 1]
                r.feats = new if use or r.feats is None else torch.cat([r.feats, new], dim=1)
        choice.record(use is not None, time.perf_counter() - t0, committed / len(live))
        keep = [j for j, r in enumerate(live) if not r.finished()]
        held = int(mask.sum(1).max()) if keep else 0
        if len(keep) < len(live) or mask.shape[1] - held > COMPACT_RATIO * held + 64:
            mask = _select(kv, mask, keep)
        live = [live[j] for j in keep]
    stats.speculative = choice.chosen


class _Choice:
    """Speculative or plain steps, whichever commits tokens cheaper on this device at this drafter's τ: a few
    steps of each are timed first (at τ near 1 on a CPU a verify of B tokens costs several plain steps and
    commits one token: plain wins; at high τ or on a GPU, where a verify costs about a plain step, speculative)."""

    PROBE = 3

    def __init__(self, speculative: bool, adaptive: bool = True):
        self.seen: dict[bool, list[float]] = {True: [], False: []}  # seconds per committed token, per way
        self.chosen: bool | None = None if speculative and adaptive else speculative

    def speculative(self) -> bool:
        if self.chosen is not None:
            return self.chosen
        return len(self.seen[True]) < self.PROBE  # probe speculative steps, then plain ones

    def drafting(self) -> bool:
        """The drafter may still draft: its context (target features) is kept."""
        return self.chosen is not False

    def record(self, speculative: bool, seconds: float, per_row: float) -> None:
        self.seen[speculative].append(seconds / max(per_row, 1e-9))
        if self.chosen is None and len(self.seen[False]) >= self.PROBE - 1:
            self.chosen = min(self.seen[True]) < min(self.seen[False])


def _select(kv, mask: torch.Tensor, keep: list[int]) -> torch.Tensor:
    """The cache with rows `keep` only and their live slots packed to the right (left padding); the new mask."""
    rows = torch.tensor(keep, dtype=torch.long, device=mask.device)
    mask = mask[rows]
    counts = mask.sum(1)
    width = int(counts.max()) if len(keep) else 0
    index = torch.zeros(len(keep), width, dtype=torch.long, device=mask.device)
    packed = torch.zeros(len(keep), width, dtype=torch.bool, device=mask.device)
    for j in range(len(keep)):
        live = mask[j].nonzero()[:, 0]
        index[j, width - len(live):] = live
        packed[j, width - len(live):] = True
    cache_compat.select_slots(kv, rows, index)
    return packed
