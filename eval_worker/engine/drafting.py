"""Draft a block at every anchor of a sequence in a few batched drafter passes.

Uses `DFlashDrafter.forward_blocks` (the multi-block mask layout training uses): one
chunk of anchors per pass, context = the target features before each anchor. The LM head
runs on chunks of rows sized to a fixed logits budget and keeps only argmax and top-k
log-probs, so peak memory is set by the chunk sizes, not by the number of anchors or the
vocabulary.

`draft_one_block` is the one-block-per-forward path (each block alone, context recomputed)
that the seeds' harness used; the tests hold the two equal and the bench times both.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import numpy as np
import torch
from torch import nn

from dflash_train.core.masks import choose_backend
from dflash_train.core.model import DFlashDrafter, mask_blocks
from dflash_train.core.target import logits_rows

DEFAULT_QUERY_BUDGET = 2048  # block slots per drafter pass
DEFAULT_HEAD_ROWS = None  # rows per LM-head chunk; None: `target.logits_rows` (a fixed logits budget)
# LM-head columns per product: a chunk's logits are one tile at a time, never `[rows, vocab]`, so the rows a
# chunk takes (and that share one read of the head's weight, a call's whole cost at a large vocabulary and a few
# rows: 622 MB at vocab 151,936 x hidden 1024 in fp32) are set by the tile, not the vocabulary; and the argmax,
# top-k and log-sum-exp read each tile while it is still in cache. A vocabulary up to this is one tile
VOCAB_TILE = 16384
# the log-sum-exp's differences below this are clamped there: exp's vectorised path slows ~20x on inputs that
# underflow, where a peaked drafter puts most of the vocabulary; each clamped term is below 1.7e-38, under
# float32's resolution of a sum that is at least 1 (the max's own term), so the result stays torch's
UNDERFLOW = -87.0
# SDPA with a dense mask materialises [heads, queries, keys] scores: cap them (flex does not)
DENSE_SCORE_BUDGET = 32 * 1024 * 1024


@dataclass
class AnchorDrafts:
    """Per anchor: the drafter's argmax for slots 1..B-1 (column k-1 = slot k), and top-k
    log-probs for the first D slots (a tree of budget N is never deeper than N)."""

    anchors: np.ndarray  # [A] absolute positions
    argmax: np.ndarray  # [A, B-1] int64
    topk_ids: np.ndarray | None = None  # [A, D, K] int64
    topk_logp: np.ndarray | None = None  # [A, D, K] float32, descending

    def select(self, rows: np.ndarray) -> AnchorDrafts:
        pick = lambda a: None if a is None else a[rows]  # noqa: E731
        return AnchorDrafts(self.anchors[rows], self.argmax[rows], pick(self.topk_ids), pick(self.topk_logp))


class _CastEmbedding(nn.Module):
    """The target's embedding, cast to the drafter's dtype (bf16 drafter on an fp32 target)."""

    def __init__(self, embed: nn.Module, dtype: torch.dtype):
        super().__init__()
        self.embed, self.dtype = embed, dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.embed(ids).to(self.dtype)


@torch.no_grad()
def head_topk(head: nn.Module, hidden: torch.Tensor, topk: int = 0, rows_per_chunk: int | None = DEFAULT_HEAD_ROWS,
              *, topk_rows: int | None = None):
    """argmax of `head(hidden)` for `[rows, H]`, and with `topk` the top-k log-probs of its first `topk_rows`
    rows (None: all), a chunk of rows at a time, each chunk over vocabulary tiles of `VOCAB_TILE` columns
    (`TiledHead`). Returns (argmax [rows], ids [topk_rows, K], log-probs [topk_rows, K]; None without topk)."""
    rows = hidden.shape[0]
    k_rows = (rows if topk_rows is None else min(topk_rows, rows)) if topk else 0
    tiled = TiledHead(head)
    # with top-k, the log-sum-exp takes a second [rows, tile] temporary: half the rows, same budget
    rows_per_chunk = rows_per_chunk or max(1, logits_rows(tiled.tile) // (2 if k_rows else 1))
    arg = torch.empty(rows, dtype=torch.long)
    ids = torch.empty(k_rows, topk, dtype=torch.long) if topk else None
    logp = torch.empty(k_rows, topk, dtype=torch.float32) if topk else None
    K = topk
    for s in range(0, rows, rows_per_chunk):
        e = min(s + rows_per_chunk, rows)
        m = max(0, min(e, k_rows) - s)
        a, v, i = tiled(hidden[s:e], topk, m)
        arg[s:e] = a.cpu()
        if m:
            assert logp is not None and ids is not None  # m > 0 only with topk
            K = v.shape[1]
            logp[s:s + m, :K], ids[s:s + m, :K] = v.cpu(), i.cpu()
    return arg, (ids[:, :K] if ids is not None else None), (logp[:, :K] if logp is not None else None)


class TiledHead:
    """The LM head over vocabulary tiles (`tile_topk`): a tile's product is the full product's columns bit for
    bit (a GEMM's columns do not depend on its width), each written into one buffer per call (a fresh result per
    tile would pay its page faults each time)."""

    def __init__(self, head: nn.Module):
        self.head, self.W = head, cast(torch.Tensor, head.weight)  # an LM head's [vocab, hidden] weight
        self.vocab = self.W.shape[0]
        self.tile = min(self.vocab, VOCAB_TILE)
        self.plain = type(head) is nn.Linear and head.bias is None  # the product is x @ W.T (F.linear, no bias)

    @torch.no_grad()
    def __call__(self, x: torch.Tensor, topk: int, m: int):
        """`tile_topk` of `head(x)` for `x [R, H]`, top-k for its first `m` rows."""
        R, T, W = x.shape[0], self.tile, self.W
        x = x.to(W.dtype)
        if not self.plain:
            return logits_topk(self.head(x), topk, m)
        buf = torch.empty(R * T, dtype=W.dtype, device=W.device)

        def tiles():
            for c in range(0, self.vocab, T):
                d = min(self.vocab, c + T)
                yield c, torch.matmul(x, W[c:d].t(), out=buf[: R * (d - c)].view(R, d - c))

        return tile_topk(tiles(), topk, m)


def logits_topk(logits: torch.Tensor, topk: int, m: int | None = None):
    """`tile_topk` of `[rows, vocab]` logits (top-k for the first `m` rows; None: all)."""
    V = logits.shape[-1]
    return tile_topk(((c, logits[:, c:c + VOCAB_TILE]) for c in range(0, V, VOCAB_TILE)), topk,
                     logits.shape[0] if m is None else m)


def tile_topk(tiles, topk: int, m: int):
    """The one LM-head rule of the engine (the all-anchor pass and the walk alike), over a row's vocabulary
    tiles `(first column, logits [R, t])` in order: (argmax [R], top-k log-probs [m, K], their ids [m, K];
    None, None without top-k). The argmax keeps the first index of the largest logit (as `argmax` over the
    whole row, also on an exact tie); the top-k merges tile by tile; the log-sum-exp is `logsumexp`'s steps
    per tile, combined from each tile's (max, sum of exp) in tile order. With one tile (vocabulary <=
    `VOCAB_TILE`) the log-probs are `torch.logsumexp`'s bit for bit (a property test holds it)."""
    best_v: torch.Tensor | None = None
    best_i: torch.Tensor | None = None  # set with best_v
    top_v: torch.Tensor | None = None
    top_i: torch.Tensor | None = None  # set with top_v
    stats = []  # per tile, of the top-k rows: (max, max with inf as 0, sum of exp below it)
    for c, logits in tiles:
        v, i = logits.max(-1)  # the first index of the largest, as `argmax`
        if best_v is None or best_i is None:
            best_v, best_i = v, i
        else:
            better = v > best_v  # an equal value in a later tile keeps the earlier index
            best_v, best_i = torch.where(better, v, best_v), torch.where(better, i + c, best_i)
        if not (topk and m):
            continue
        tv, ti = logits[:m].topk(min(topk, logits.shape[-1]), dim=-1)
        if top_v is None or top_i is None:
            top_v, top_i = tv, ti + c
        else:
            cv, ci = torch.cat([top_v, tv], 1), torch.cat([top_i, ti + c], 1)
            top_v, j = cv.topk(min(topk, cv.shape[1]), dim=-1)
            top_i = ci.gather(1, j)
        mx = v[:m, None].float()
        mm = mx.masked_fill(mx.abs() == float("inf"), 0)
        stats.append((mx, mm, (logits[:m].float() - mm).clamp_(min=UNDERFLOW).exp_().sum(-1, keepdim=True)))
    if not stats:
        return best_i, None, None
    if len(stats) == 1:
        mx, mm, total = stats[0]
    else:
        mx = torch.cat([t[0] for t in stats], 1).amax(1, keepdim=True)
        mm = mx.masked_fill(mx.abs() == float("inf"), 0)
        total = sum(s_ * (tm - mm).exp() for _, tm, s_ in stats)  # a tile whose max is -inf adds 0
    lse = total.log_().add_(mm).masked_fill_(mx == -float("inf"), -float("inf"))  # a row of -inf only
    assert top_v is not None  # set with the stats
    return best_i, top_v.float() - lse, top_i


def anchors_per_pass(block_size: int, query_budget: int = DEFAULT_QUERY_BUDGET, *, context_len: int = 0,
                     heads: int = 1, dense: bool = False) -> int:
    """Anchors per drafter pass.

    flex skips masked tiles, so it takes the whole query budget. A dense mask pays for
    every (block query, other block's key) pair it masks out: keep the blocks' share of
    the keys near the context's (measured best on CPU), and cap the score matrix so peak
    memory stays flat in the number of anchors and bounded in the context length.
    """
    n = max(1, query_budget // block_size)
    if dense:
        n = max(1, min(n, max(256, context_len) // block_size))
        while n > 1 and heads * n * block_size * (context_len + n * block_size) > DENSE_SCORE_BUDGET:
            n //= 2
    return n


@torch.no_grad()
def draft_anchors(drafter: DFlashDrafter, embed: nn.Module, head: nn.Module, input_ids: torch.Tensor,
                  features: torch.Tensor, anchors: list[int] | np.ndarray, *, topk: int = 0,
                  topk_slots: int | None = None, anchors_per_chunk: int | None = None,
                  head_rows: int | None = DEFAULT_HEAD_ROWS, backend: str = "auto",
                  see_anchor_state: bool = False) -> AnchorDrafts:
    """Draft the block at each anchor of one sequence.

    input_ids `[S]` (prompt + reference), features `[S, n*H]` from `Target.forward`.
    Anchor a's block is `[input_ids[a], MASK...]`; its context is features[:a]
    (features[:a + 1] with `see_anchor_state`: the leak probe's view, never τ's).
    Top-k (when topk > 0) is kept for the first `topk_slots` slots (default: all).
    """
    cfg = drafter.config
    B = cfg.block_size
    D = B - 1 if topk_slots is None else max(0, min(topk_slots, B - 1))
    anchors = np.asarray(anchors, dtype=np.int64)
    if anchors.size and (anchors.min() < 0 or anchors.max() >= input_ids.shape[0]):
        raise ValueError(f"anchors must lie in [0, {input_ids.shape[0]})")
    dev = next(drafter.parameters()).device
    emb = _CastEmbedding(embed, drafter.fc.weight.dtype)
    backend, _ = choose_backend(backend, cfg, dev)  # SDPA where flex cannot run this drafter (logged once)
    flex = backend == "flex"
    per = anchors_per_chunk or anchors_per_pass(B, context_len=int(input_ids.shape[0]),
                                                heads=cfg.num_attention_heads, dense=not flex)
    out_arg, out_ids, out_logp = [], [], []
    for c in range(0, len(anchors), per):
        chunk = torch.as_tensor(anchors[c:c + per], device=dev)
        n = chunk.numel()
        S = int(chunk.max()) + 1  # context beyond the last anchor is never visible
        valid = torch.ones(n, dtype=torch.bool, device=dev)
        if flex:  # a few fixed shapes, so the compiled flex kernel is not rebuilt per chunk
            S, pad = -(-S // 256) * 256, per - n
            chunk = torch.cat([chunk, chunk.new_zeros(pad)])
            valid = torch.cat([valid, valid.new_zeros(pad)])
        ids = _fit(input_ids.to(dev), S)[None]
        feats = _fit(features.to(dev), S)[None]
        hidden = drafter.forward_blocks(emb, ids, feats, chunk[None], valid[None], backend=backend,
                                        see_anchor_state=see_anchor_state)
        H = hidden.shape[-1]
        slots = hidden.view(-1, B, H)[:n, 1:]
        if topk and D:
            arg_a, tids, tlogp = head_topk(head, slots[:, :D].reshape(-1, H), topk, head_rows)
            arg_b, _, _ = head_topk(head, slots[:, D:].reshape(-1, H), 0, head_rows)
            arg = torch.cat([arg_a.view(n, D), arg_b.view(n, B - 1 - D)], dim=1)
            out_ids.append(tids.view(n, D, -1))
            out_logp.append(tlogp.view(n, D, -1))
        else:
            arg, _, _ = head_topk(head, slots.reshape(-1, H), 0, head_rows)
        out_arg.append(arg.view(n, B - 1))
        del hidden, slots
    cat = lambda xs, shape: torch.cat(xs).numpy() if xs else np.zeros(shape)  # noqa: E731
    return AnchorDrafts(anchors, cat(out_arg, (0, B - 1)).astype(np.int64),
                        cat(out_ids, (0, D, topk)).astype(np.int64) if topk and D else None,
                        cat(out_logp, (0, D, topk)).astype(np.float32) if topk and D else None)


def _fit(x: torch.Tensor, length: int) -> torch.Tensor:
    """First `length` rows of x, zero-padded if x is shorter (padding is never attended)."""
    if x.shape[0] >= length:
        return x[:length]
    return torch.cat([x, x.new_zeros((length - x.shape[0], *x.shape[1:]))])


@torch.no_grad()
def draft_one_block(drafter: DFlashDrafter, embed: nn.Module, head: nn.Module, input_ids: torch.Tensor,
                    features: torch.Tensor, anchor: int, topk: int = 0):
    """One block, one drafter forward, full context recomputed: the seeds' way (and the spec loop's math)."""
    cfg = drafter.config
    B = cfg.block_size
    dev = next(drafter.parameters()).device
    block = mask_blocks(input_ids[anchor:anchor + 1].to(dev), B, cfg.mask_token_id)
    pos = torch.arange(anchor, anchor + B, device=dev)[None]
    ctx = features[:anchor].to(dev)[None]
    hidden = drafter(embed(block).to(drafter.fc.weight.dtype), pos, ctx, torch.arange(anchor, device=dev)[None])
    return head_topk(head, hidden[0, 1:], topk)
