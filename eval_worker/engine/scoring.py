"""Score one drafter's per-anchor drafts along one reference, and aggregate over prompts."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from dflash_train.tau import tau

from eval_worker.engine import metrics
from eval_worker.engine.drafting import AnchorDrafts
from eval_worker.engine.tree import build_tree, tree_streak


@dataclass
class PromptScore:
    name: str
    block_size: int
    num_tokens: int  # response length (offsets 0..num_tokens-1 are anchors)
    streaks: np.ndarray  # [num_tokens] top-1 streak of the block at each offset
    match_sum: np.ndarray  # [B-1] per slot: anchors whose draft equals the reference
    valid_sum: np.ndarray  # [B-1] per slot: anchors with a reference token to compare
    online: metrics.Walk
    stride: list[int]  # accept lengths of the fixed-stride blocks
    tree_online: metrics.Walk | None = None
    tree_stride: list[int] = field(default_factory=list)
    tree_below_chain: int = 0  # visited blocks where the tree walk fell short of the top-1 streak
    greedy: np.ndarray | None = None  # the target's own argmax at offsets 0..num_tokens (divergence check)
    walk: dict = field(default_factory=dict)  # online_walk's counting rule for this prompt

    def full_walk(self) -> metrics.Walk:
        """The whole online walk, whatever max_blocks / mode show (what the real loop does)."""
        return metrics.online_walk(lambda s: self.streaks[s], self.num_tokens, **self.walk)

    def accepts(self, mode: str) -> list[int]:
        return self.online.accept_lengths if mode == "online" else self.stride

    def tree_accepts(self, mode: str) -> list[int]:
        if self.tree_online is None:
            return []
        return self.tree_online.accept_lengths if mode == "online" else self.tree_stride


def score_prompt(name: str, ext: list[int], num_tokens: int, drafts: AnchorDrafts, block_size: int, *,
                 tree_budget: int = 0, tree_spine: bool = False, max_blocks: int | None = None,
                 counting: str = "response", ends_with_stop: bool = False,
                 stop_offset: int | None = None) -> PromptScore:
    """`drafts` rows are the anchors at offsets 0..num_tokens-1, in order.

    `counting` / `ends_with_stop` / `stop_offset`: when the online walks stop (`metrics.online_walk`).
    """
    B = block_size
    if drafts.argmax.shape != (num_tokens, B - 1):
        raise ValueError(f"{name}: expected drafts for {num_tokens} anchors x {B - 1} slots, "
                         f"got {drafts.argmax.shape}")
    offsets = np.arange(num_tokens)
    m = metrics.matches(drafts.argmax, ext, offsets)
    streaks = metrics.leading_true(m)
    idx = offsets[:, None] + np.arange(1, B)[None, :]
    valid = idx < len(ext)
    walk = dict(counting=counting, ends_with_stop=ends_with_stop)
    if stop_offset is not None:
        walk["stop_offset"] = stop_offset
    online = metrics.online_walk(lambda s: streaks[s], num_tokens, max_blocks, **walk)
    stride = metrics.stride_blocks(streaks, num_tokens, B, max_blocks)
    score = PromptScore(name, B, num_tokens, streaks, m.sum(0), valid.sum(0), online, stride, walk=walk)
    if tree_budget > 0 and drafts.topk_ids is not None:
        ext_arr = np.asarray(ext, dtype=np.int64)
        memo: dict[int, int] = {}

        def tstreak(s: int) -> int:
            if s not in memo:
                tree = build_tree(drafts.topk_logp[s], drafts.topk_ids[s], tree_budget, spine=tree_spine,
                                  spine_ids=drafts.argmax[s])
                labels = np.where(valid[s], ext_arr[np.minimum(idx[s], len(ext_arr) - 1)], -1)
                memo[s] = tree_streak(tree, labels)
            return memo[s]

        score.tree_online = metrics.online_walk(tstreak, num_tokens, max_blocks, **walk)
        score.tree_stride = [tstreak(s) + 1 for s in range(0, max(num_tokens - 1, 0), B)][: len(stride)]
        score.tree_below_chain = sum(memo[s] < streaks[s] for s in memo)
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
    all_streaks = np.concatenate([s.streaks for s in scores]) if scores else np.zeros(0)
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
