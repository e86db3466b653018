"""Anchor sampling and block labels: where the training blocks sit and what they predict.

Block j of a row starts at anchor a_j; slot k sits at position a_j + k and predicts the
target's token at a_j + k (same-position labels, design.md). That token is the target's
greedy prediction made at position a_j + k - 1, so

    label[j, k] = pred[a_j + k - 1]        (k >= 1; slot 0 is the given anchor token)

where `pred = target.greedy_tokens(last_hidden)` comes from the same target forward that
produced the context features. Getting this off by one is pitfall 2.7.1 in the notes.
"""
from __future__ import annotations

import torch


def eligible_anchors(loss_mask: torch.Tensor) -> torch.Tensor:
    """`[batch, S]` bool: positions that may start a block.

    An anchor must be supervised and so must the first position it predicts (a + 1);
    it needs at least one context position before it (a >= 1). At inference anchors are
    committed response tokens, never prompt tokens, so this matches the deployed setting.
    """
    ok = torch.zeros_like(loss_mask, dtype=torch.bool)
    ok[:, 1:-1] = loss_mask[:, 1:-1] & loss_mask[:, 2:]
    return ok


def sample_anchors(loss_mask: torch.Tensor, num_anchors: int, seeds: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Up to `num_anchors` sorted anchors per row, uniformly without replacement.

    Row r draws with its own generator seeded by `seeds[r]`, so a row's anchors do not
    depend on the batch it lands in (single process == DDP shards, queue on == off).
    Returns `anchors [batch, N]` (long) and `valid [batch, N]` (bool); rows with fewer
    eligible positions are padded with anchor 0 and valid False.
    """
    if num_anchors < 1:
        raise ValueError(f"num_anchors must be >= 1 (got {num_anchors})")
    if len(seeds) != loss_mask.shape[0]:
        raise ValueError(f"{len(seeds)} seeds for {loss_mask.shape[0]} rows")
    ok = eligible_anchors(loss_mask.cpu())
    anchors = torch.zeros(loss_mask.shape[0], num_anchors, dtype=torch.long)
    valid = torch.zeros(loss_mask.shape[0], num_anchors, dtype=torch.bool)
    for r, seed in enumerate(seeds):
        pos = ok[r].nonzero().squeeze(1)
        g = torch.Generator().manual_seed(int(seed))
        pick = pos[torch.randperm(pos.numel(), generator=g)[:num_anchors]].sort().values
        anchors[r, : pick.numel()] = pick
        valid[r, : pick.numel()] = True
    return anchors, valid


def block_labels(pred: torch.Tensor, anchors: torch.Tensor, valid: torch.Tensor, loss_mask: torch.Tensor,
                 block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Labels `[batch, N, B]` and their mask for the blocks at `anchors`.

    `label[b, j, k] = pred[b, anchors[b, j] + k - 1]`: the target's token for position
    `anchor + k`. The mask is False for slot 0, invalid blocks, positions past the row
    and positions the loss mask does not supervise.
    """
    S = pred.shape[1]
    k = torch.arange(block_size, device=anchors.device)
    pos = anchors[:, :, None] + k  # [b, N, B] label positions
    inside = pos < S
    flat = pos.clamp(max=S - 1).reshape(pos.shape[0], -1)
    labels = torch.gather(pred, 1, (flat - 1).clamp(min=0)).view_as(pos)
    supervised = torch.gather(loss_mask, 1, flat).view_as(pos)
    mask = valid[:, :, None] & inside & supervised & (k >= 1)
    return labels.masked_fill(~mask, 0), mask
