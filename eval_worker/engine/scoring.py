"""Score one drafter's per-anchor drafts along one reference, and aggregate over prompts."""
from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from dflash_train.core.tau import tau
from eval_worker.engine import metrics
from eval_worker.engine.drafting import AnchorDrafts
from eval_worker.engine.tree import build_tree, tree_streak


@dataclass
class PromptScore:
    name: str
    block_size: int
    num_tokens: int  # response length (offsets 0..num_tokens-1 are anchors)
    streaks: np.ndarray  # [num_tokens] top-1 streak of the block at each offset; -1 where no walk drafted one
    match_sum: np.ndarray  # [B-1] per slot: sampled anchors whose draft equals the reference
    valid_sum: np.ndarray  # [B-1] per slot: sampled anchors with a reference token to compare
    online: metrics.Walk
    stride: list[int]  # accept lengths of the fixed-stride blocks
    tree_online: metrics.Walk | None = None
    tree_stride: list[int] = field(default_factory=list)
    tree_below_chain: int = 0  # visited blocks where the tree walk fell short of the top-1 streak
    greedy: np.ndarray | None = None  # the target's own argmax at offsets 0..num_tokens (divergence check)
    walk: dict = field(default_factory=dict)  # online_walk's counting rule for this prompt
    sample: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # offsets of the anchor sample

    def full_walk(self) -> metrics.Walk:
        """The whole online walk, whatever max_blocks / mode show (what the real loop does)."""
        return metrics.online_walk(self._streak, self.num_tokens, **self.walk)

    def _streak(self, s: int) -> int:
        if self.streaks[s] < 0:
            raise ValueError(f"{self.name}: no block was drafted at offset {s}")
        return int(self.streaks[s])

    @property
    def sample_streaks(self) -> np.ndarray:
        return self.streaks[self.sample]

    def accepts(self, mode: str) -> list[int]:
        return self.online.accept_lengths if mode == "online" else self.stride

    def tree_accepts(self, mode: str) -> list[int]:
        if self.tree_online is None:
            return []
        return self.tree_online.accept_lengths if mode == "online" else self.tree_stride


def sample_offsets(num_tokens: int, quota: int | None, seed: int, name: str) -> np.ndarray:
    """The fixed, seeded sample of anchors that statistics over every anchor are taken from:
    `quota` offsets of 0..num_tokens-1 (all of them when quota is None or at least num_tokens),
    drawn by (seed, prompt name), sorted."""
    if quota is None or quota >= num_tokens:
        return np.arange(num_tokens, dtype=np.int64)
    rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
    return np.sort(rng.choice(num_tokens, size=max(quota, 0), replace=False)).astype(np.int64)


def tree_streak_of(topk_ids: np.ndarray, topk_logp: np.ndarray, argmax: np.ndarray, labels: np.ndarray,
                   budget: int, spine: bool) -> int:
    """The tree walk's streak on one block (`labels`: the reference at slots 1..B-1, -1 past its end)."""
    return tree_streak(build_tree(topk_logp, topk_ids, budget, spine=spine, spine_ids=argmax), labels)


def score_prompt(name: str, ext: list[int], num_tokens: int, drafts: AnchorDrafts, block_size: int, *,
                 tree_budget: int = 0, tree_spine: bool = False, max_blocks: int | None = None,
                 counting: str = "response", ends_with_stop: bool = False,
                 sample: np.ndarray | None = None, stop_offset: int | None = None) -> PromptScore:
    """Score the all-anchor drafts: `drafts` rows are the anchors at offsets 0..num_tokens-1, in order.

    `counting` / `ends_with_stop` / `stop_offset`: when the online walks stop (`metrics.online_walk`).
    `sample`: the anchors of the statistics over every anchor (default: all of them).
    """
    B = block_size
    if drafts.argmax.shape != (num_tokens, B - 1):
        raise ValueError(f"{name}: expected drafts for {num_tokens} anchors x {B - 1} slots, "
                         f"got {drafts.argmax.shape}")
    offsets = np.arange(num_tokens)
    streaks = metrics.leading_true(metrics.matches(drafts.argmax, ext, offsets))
    sample = offsets if sample is None else sample
    tree_at = None
    topk_ids, topk_logp = drafts.topk_ids, drafts.topk_logp
    if tree_budget > 0 and topk_ids is not None:
        assert topk_logp is not None  # drafted together (drafting.draft_anchors)
        ext_arr = np.asarray(ext, dtype=np.int64)

        def tree_at(s: int) -> int:
            labels = walk_labels(ext_arr, s, B)
            return tree_streak_of(topk_ids[s], topk_logp[s], drafts.argmax[s], labels, tree_budget, tree_spine)

    return score_blocks(name, ext, num_tokens, B, streaks, tree_at, sample, drafts.argmax[sample],
                        max_blocks=max_blocks, counting=counting, ends_with_stop=ends_with_stop,
                        stop_offset=stop_offset)


def walk_labels(ext: np.ndarray, offset: int, block_size: int) -> np.ndarray:
    """ext[offset + k] for slots k = 1..B-1, -1 past the end."""
    idx = offset + np.arange(1, block_size)
    return np.where(idx < len(ext), ext[np.minimum(idx, len(ext) - 1)], -1)


def score_blocks(name: str, ext: list[int], num_tokens: int, block_size: int, streaks: np.ndarray, tree_at,
                 sample: np.ndarray, sample_argmax: np.ndarray, *, max_blocks: int | None = None,
                 counting: str = "response", ends_with_stop: bool = False,
                 stop_offset: int | None = None) -> PromptScore:
    """Replay the walks over per-anchor streaks (all anchors, or the ones the walks visited: -1
    elsewhere) and take the per-slot statistics from the sampled anchors' full drafts
    `sample_argmax [len(sample), B-1]`. `tree_at(s)`: the tree walk's streak at s (None: no tree)."""
    B = block_size
    m = metrics.matches(sample_argmax, ext, sample)
    valid = (sample[:, None] + np.arange(1, B)[None, :]) < len(ext)
    walk: dict[str, Any] = dict(counting=counting, ends_with_stop=ends_with_stop)
    if stop_offset is not None:
        walk["stop_offset"] = stop_offset
    # online: an empty walk until the next line replays it (the walk reads the score's own streaks)
    score = PromptScore(name, B, num_tokens, streaks, m.sum(0), valid.sum(0), metrics.Walk([], [], []), [],
                        walk=walk, sample=sample)
    score.online = metrics.online_walk(score._streak, num_tokens, max_blocks, **walk)
    score.stride = metrics.stride_blocks(streaks, num_tokens, B, max_blocks)
    if tree_at is not None:
        memo: dict[int, int] = {}

        def tstreak(s: int) -> int:
            if s not in memo:
                memo[s] = tree_at(s)
            return memo[s]

        score.tree_online = metrics.online_walk(tstreak, num_tokens, max_blocks, **walk)
        score.tree_stride = [tstreak(s) + 1 for s in range(0, max(num_tokens - 1, 0), B)][: len(score.stride)]
        score.tree_below_chain = sum(memo[s] < score._streak(s) for s in memo)
    return score


@dataclass
class Summary:
    """Aggregates over prompts for one drafter (the result's headline blocks)."""

    mode: str
    per_prompt_tau: list[float | None]
    tau: dict
    histogram: list[int]
    per_position: dict
    mean_streak_all_anchors: float | None
    tree: dict
    stride: dict


def summarize(scores: list[PromptScore], block_size: int, mode: str, *, tree_budget: int, tree_spine: bool,
              max_blocks: int | None, n_resamples: int = 2000, seed: int = 0) -> Summary:
    B = block_size
    accepts = [s.accepts(mode) for s in scores]
    per_prompt = [tau(a) for a in accepts]
    macro, pooled, steps = metrics.macro_pooled(accepts)
    ci = metrics.bootstrap_ci(per_prompt, n_resamples=n_resamples, seed=seed)
    flat = [x for a in accepts for x in a]
    match_sum = sum((s.match_sum for s in scores), np.zeros(B - 1, dtype=np.int64))
    valid_sum = sum((s.valid_sum for s in scores), np.zeros(B - 1, dtype=np.int64))
    streak = np.asarray(flat, dtype=np.int64) - 1
    all_streaks = np.concatenate([s.sample_streaks for s in scores]) if scores else np.zeros(0)
    cond = metrics.conditional_accept(flat, B)
    top1 = metrics.top1_accuracy(match_sum, valid_sum)
    per_position = {
        # unreached slots read 0.0 (consumers plot these as numbers); `reached` tells them apart
        "conditional_accept": [c if c is not None else 0.0 for c in cond],
        "top1_accuracy": [t if t is not None else 0.0 for t in top1],
        "reached": [int((streak >= k - 1).sum()) for k in range(1, B)],
    }
    tree_acc = [s.tree_accepts(mode) for s in scores]
    t_macro, t_pooled, t_steps = metrics.macro_pooled(tree_acc)
    tree = {"budget": tree_budget, "spine": tree_spine, "tau": t_macro, "tau_pooled": t_pooled,
            "num_steps": t_steps, "blocks_below_top1": int(sum(s.tree_below_chain for s in scores))}
    s_macro, s_pooled, s_steps = metrics.macro_pooled([s.stride for s in scores])
    stride = {"stride": B, "max_blocks": max_blocks, "tau": s_macro, "tau_pooled": s_pooled, "num_blocks": s_steps}
    return Summary(
        mode=mode, per_prompt_tau=per_prompt,
        tau={"macro": macro, "pooled": pooled, "ci95": list(ci) if ci else None, "num_steps": steps},
        histogram=metrics.histogram(flat, B) if flat else [0] * B,
        per_position=per_position,
        mean_streak_all_anchors=float(all_streaks.mean()) if all_streaks.size else None,
        tree=tree, stride=stride)
