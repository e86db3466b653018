"""The block loss: position-weighted cross-entropy over draft slots, plus train metrics.

DFlash loss (the paper's position decay): `w_k = exp(-(k-1)/γ)` for slot k >= 1, 0 for slot 0, the loss
normalised by the sum of the weights. D-PACE (optional) replaces the fixed decay by a
detached weight from the drafter's own running acceptance probability.

Logits come from the target's frozen LM head. For big vocabularies the head + CE run in
chunks of rows, each under activation checkpointing, so `[rows, vocab]` logits never
exist whole (forward or backward).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

DEFAULT_GAMMA = {16: 7.0, 10: 5.0, 8: 4.0}


def default_gamma(block_size: int) -> float:
    """γ = 7 for B=16, 5 for B=10, 4 for B=8 (published); in between, ~B/2.3."""
    return DEFAULT_GAMMA.get(block_size, max(block_size / 2.3, 1.0))


def slot_weights(block_size: int, gamma: float | None = None, device=None) -> torch.Tensor:
    """`[B]` decay weights: 0 for slot 0, `exp(-(k-1)/γ)` for k >= 1."""
    gamma = default_gamma(block_size) if gamma is None else float(gamma)
    if gamma <= 0:
        raise ValueError(f"gamma must be > 0 (got {gamma})")
    k = torch.arange(block_size, dtype=torch.float32, device=device)
    w = torch.exp(-(k - 1) / gamma)
    w[0] = 0.0
    return w


def dpace_weights(ce: torch.Tensor, mask: torch.Tensor, alpha: float = 0.5) -> torch.Tensor:
    """D-PACE weights `[b, N, B]` (detached): `w_j = Σ_{m>=j} P_m`, `P_m = Π_{1<=i<=m} q̃_i`.

    `q̃_i = (1-α) exp(-CE_i) + α`. Masked slots end a block's product (P_m = 0 after them).
    """
    q = (1 - alpha) * torch.exp(-ce.detach().float()) + alpha
    q = torch.where(mask, q, torch.zeros_like(q))
    q[..., 0] = 1.0  # slot 0 is not a prediction; it neither counts nor breaks the chain
    P = torch.cumprod(q, dim=-1)
    P[..., 0] = 0.0
    w = torch.flip(torch.cumsum(torch.flip(P, [-1]), -1), [-1])
    return w * mask


@dataclass
class BlockLossOutput:
    loss: torch.Tensor  # scalar, differentiable: weighted sum / denominator
    weighted_ce_sum: torch.Tensor  # detached local numerator
    weight_sum: torch.Tensor  # detached local denominator
    stats: torch.Tensor  # detached `[5 + 2B]`: see `stats_fields`; sum-reducible across ranks


def _head_ce(head: nn.Module, h: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    logits = head(h).float()
    return F.cross_entropy(logits, y, reduction="none"), logits.argmax(-1) == y


def token_ce(hidden: torch.Tensor, head: nn.Module, labels: torch.Tensor, mask: torch.Tensor,
             chunk_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-slot CE and top-1 correctness `[b, N, B]`, computed only where `mask` is True."""
    H = hidden.shape[-1]
    flat_mask = mask.reshape(-1)
    idx = flat_mask.nonzero().squeeze(1)
    h = hidden.reshape(-1, H).index_select(0, idx)
    y = labels.reshape(-1).index_select(0, idx)
    if chunk_size is None or h.shape[0] <= chunk_size:
        ce, correct = _head_ce(head, h, y)
    else:
        parts = [checkpoint(_head_ce, head, h[s:s + chunk_size], y[s:s + chunk_size], use_reentrant=False)
                 for s in range(0, h.shape[0], chunk_size)]
        ce = torch.cat([p[0] for p in parts])
        correct = torch.cat([p[1] for p in parts])
    ce_full = torch.zeros(flat_mask.shape[0], dtype=ce.dtype, device=ce.device).index_put((idx,), ce)
    ok_full = torch.zeros(flat_mask.shape[0], dtype=torch.bool, device=ce.device).index_put((idx,), correct)
    return ce_full.view(mask.shape), ok_full.view(mask.shape)


def stats_fields(block_size: int) -> list[str]:
    return (["weighted_ce", "weight", "ce_sum", "streak_sum", "blocks"]
            + [f"correct_{k}" for k in range(block_size)] + [f"count_{k}" for k in range(block_size)])


def block_loss(hidden: torch.Tensor, head: nn.Module, labels: torch.Tensor, mask: torch.Tensor, *,
               gamma: float | None = None, loss_type: str = "dflash", dpace_alpha: float = 0.5,
               chunk_size: int | None = None, reduce_stats=None, loss_scale: float = 1.0) -> BlockLossOutput:
    """Weighted CE of drafter hidden states `[b, N*B, H]` against `labels [b, N, B]`.

    `reduce_stats(t)` (e.g. a DDP all-reduce) sums the detached stats over ranks before
    the loss is normalised, so every rank divides by the global weight sum and K ranks
    give the same update as one process on the whole batch. `loss_scale` undoes DDP's
    gradient averaging (pass the world size).
    """
    b, N, B = labels.shape
    ce, correct = token_ce(hidden, head, labels, mask, chunk_size)
    if loss_type == "dflash":
        w = slot_weights(B, gamma, device=ce.device) * mask
    elif loss_type == "dpace":
        w = dpace_weights(ce, mask, dpace_alpha)
    else:
        raise ValueError(f"unknown loss_type {loss_type!r} (dflash, dpace)")
    weighted = (w * ce).sum()
    # streak: leading correct slots of each block, the training-set acceptance estimate
    has_pred = mask[..., 1]
    streak = torch.cumprod((correct & mask)[..., 1:].int(), dim=-1).sum(-1)
    stats = torch.cat([
        torch.stack([weighted.detach(), w.sum(), (ce.detach() * mask).sum(),
                     (streak * has_pred).sum().float(), has_pred.sum().float()]).float(),
        (correct & mask).sum((0, 1)).float(), mask.sum((0, 1)).float()])
    if reduce_stats is not None:
        stats = reduce_stats(stats)
    denom = stats[1].clamp(min=1e-12)
    return BlockLossOutput(weighted * (loss_scale / denom), weighted.detach(), w.sum().detach(), stats)


def summarize_stats(stats: torch.Tensor, block_size: int) -> dict:
    """Readable train metrics from (summed) stats: loss, accuracy, streak, per-slot accuracy."""
    s = stats.detach().double().cpu().tolist()
    B = block_size
    correct, count = s[5:5 + B], s[5 + B:5 + 2 * B]
    n = sum(count)
    return {
        "loss": s[0] / s[1] if s[1] > 0 else math.nan,
        "ce": s[2] / n if n else math.nan,
        "accuracy": sum(correct) / n if n else math.nan,
        "streak": 1.0 + s[3] / s[4] if s[4] else math.nan,  # 1 + leading correct = accept length on train blocks
        "per_slot_accuracy": [c / m if m else math.nan for c, m in zip(correct[1:], count[1:], strict=False)],
        "label_tokens": n,
        "blocks": s[4],
    }
