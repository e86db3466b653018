"""Acceptance metrics from per-anchor drafts along a greedy reference. Pure numpy, no torch.

Coordinates: a reference is `ext = tokens + lookahead` (the target's greedy response and
the greedy tokens that follow it). Response offset s is the token at absolute position
`prompt_len + s`; offset 0 is the token the prefill produces. The block anchored at s
predicts `ext[s + k]` in slot k = 1..B-1 (column k-1 of the draft arrays).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from dflash_train.core.tau import check_counting, tau


def matches(drafts: np.ndarray, ext: npt.ArrayLike, offsets: npt.ArrayLike) -> np.ndarray:
    """`[A, B-1]` bool: slot k of the block at offsets[i] equals ext[offsets[i] + k].

    Slots whose label lies past the end of ext count as misses (nothing to compare).
    """
    drafts = np.asarray(drafts)
    ext_a = np.asarray(ext, dtype=np.int64)
    at = np.asarray(offsets, dtype=np.int64)
    A, D = drafts.shape
    idx = at[:, None] + np.arange(1, D + 1)[None, :]
    inside = idx < len(ext_a)
    labels = np.where(inside, ext_a[np.minimum(idx, len(ext_a) - 1)], -1)
    return inside & (drafts == labels)


def leading_true(m: np.ndarray) -> np.ndarray:
    """Per row, the number of leading True values (the greedy acceptance streak)."""
    m = np.asarray(m, dtype=bool)
    if m.shape[-1] == 0:
        return np.zeros(m.shape[:-1], dtype=np.int64)
    return np.cumprod(m, axis=-1).sum(axis=-1).astype(np.int64)


@dataclass
class Walk:
    accept_lengths: list[int]  # per verify step, bonus included (1..B)
    anchors: list[int]  # response offset each step drafted from
    spans: list[tuple[int, int]]  # token spans [start, end) of the response each step committed

    @property
    def tau(self) -> float | None:
        return tau(self.accept_lengths)


def online_walk(streak_at, num_tokens: int, max_steps: int | None = None, *, counting: str = "response",
                ends_with_stop: bool = False, stop_offset: int | None = None) -> Walk:
    """Replay greedy speculative decoding along a greedy reference of `num_tokens` tokens.

    Mirrors `dflash_train.core.speculative.speculative_generate`: the prefill commits offset 0;
    each step drafts from the last committed offset s, accepts the streak n, commits
    n + 1 tokens (clipped at the reference end, which is either eos or max_new_tokens),
    and the next step drafts from the new last token. `streak_at(s)` gives n at s.

    `counting` says which steps count and what each adds (docs/design.md, "Counting rules"):
    - "response": steps until the response is committed, each adding n + 1. A reference of one
      token (eos first) has no step.
    - "published": z-lab's `dflash_generate`, which loops while `start < prompt + N`
      (N = max_new_tokens = num_tokens when the reference ended by length) and checks for
      a stop token only after a step: one step more whenever the steps sum to exactly
      N - 1 (its tokens lie past the end and are discarded, its length counts), and one
      step when the first token is already eos. `ends_with_stop`: the reference ended at eos.
    - "deepspec": DeepSpec's `generate_decoding_sample`: the steps of "published" except after an
      eos first token (no step), and a step whose accepted drafts reach the eos adds the drafts
      up to and including it, without the bonus. `stop_offset`: where the first stop token of the
      reference and its lookahead lies (default: the last token when `ends_with_stop`); a reference
      cut at max_new_tokens can hold one in its lookahead, which DeepSpec's last round stops at.
    - "vllm": the steps of "response", each adding 1 + its accepted drafts unclipped (vLLM counts
      `len(generated) - 1` accepted before its stop check trims the output).
    - "sglang": the steps of "response", each adding the tokens it commits: SGLang's verify cuts the
      accepted tokens at the finishing one (eos or max_new_tokens).
    """
    check_counting(counting)
    past_end = counting in ("published", "deepspec") and not ends_with_stop
    last = num_tokens if past_end else num_tokens - 1
    if stop_offset is None and ends_with_stop:
        stop_offset = num_tokens - 1
    accepts: list[int] = []
    anchors: list[int] = []
    spans: list[tuple[int, int]] = []
    s = 0
    while (s < last or (counting == "published" and not accepts and num_tokens > 0)) and (
            max_steps is None or len(accepts) < max_steps):
        n = int(streak_at(s))
        end = min(s + n + 1, num_tokens - 1)  # eos / length truncation in the real loop
        if counting == "deepspec" and stop_offset is not None and s + n >= stop_offset:
            accepts.append(stop_offset - s)  # the drafts through the stop token; its round adds no bonus
            anchors.append(s)
            spans.append((s + 1, end + 1))
            break
        elif counting == "sglang":
            accepts.append(end - s)
        else:
            accepts.append(n + 1)
        anchors.append(s)
        spans.append((s + 1, end + 1))
        s = s + n + 1
    return Walk(accepts, anchors, spans)


def stride_blocks(streaks: np.ndarray, num_tokens: int, block_size: int, max_blocks: int | None = None) -> list[int]:
    """Fixed-stride blocks (the seeds' harness): anchors 0, B, 2B, ...; accept = streak + 1."""
    out: list[int] = []
    for s in range(0, max(num_tokens - 1, 0), block_size):
        if max_blocks is not None and len(out) >= max_blocks:
            break
        out.append(int(streaks[s]) + 1)
    return out


def histogram(accept_lengths: Sequence[int], block_size: int) -> list[int]:
    """Counts of accept lengths 1..B."""
    counts = np.bincount(np.asarray(accept_lengths, dtype=np.int64), minlength=block_size + 1)
    if len(counts) > block_size + 1:
        raise ValueError(f"accept length {len(counts) - 1} exceeds the block size {block_size}")
    return counts[1:].tolist()


def conditional_accept(accept_lengths: Sequence[int], block_size: int) -> list[float | None]:
    """Slot k (1..B-1): P(slot k accepted | slots < k accepted) over verify steps."""
    streak = np.asarray(accept_lengths, dtype=np.int64) - 1
    out: list[float | None] = []
    for k in range(1, block_size):
        reached = int((streak >= k - 1).sum())
        out.append(float((streak >= k).sum() / reached) if reached else None)
    return out


def top1_accuracy(match_sum: np.ndarray, valid_sum: np.ndarray) -> list[float | None]:
    """Per-slot accuracy from summed matches / summed comparable slots."""
    return [float(m / v) if v else None for m, v in zip(match_sum.tolist(), valid_sum.tolist(), strict=True)]


def bootstrap_ci(values: Sequence[float | None], *, n_resamples: int = 2000, level: float = 0.95,
                 seed: int = 0) -> tuple[float, float] | None:
    """Percentile bootstrap interval of the mean (resampling the items, e.g. prompts)."""
    v = np.asarray([x for x in values if x is not None], dtype=np.float64)
    if len(v) == 0:
        return None
    if len(v) == 1:
        return float(v[0]), float(v[0])
    rng = np.random.default_rng(seed)
    means = v[rng.integers(0, len(v), size=(n_resamples, len(v)))].mean(axis=1)
    alpha = (1 - level) / 2
    lo, hi = np.quantile(means, [alpha, 1 - alpha])
    return float(lo), float(hi)


def nested_bootstrap_ci(groups: Sequence[Sequence[float | None]], *, n_resamples: int = 2000, level: float = 0.95,
                        seed: int = 0, chunk: int = 256) -> tuple[float, float] | None:
    """Percentile bootstrap interval of the mean over groups of each group's mean (prompts and their
    K samples): each resample draws groups with replacement, then items within each drawn group."""
    rows = [[x for x in g if x is not None] for g in groups]
    rows = [r for r in rows if r]
    if not rows:
        return None
    width = max(len(r) for r in rows)
    v = np.full((len(rows), width), np.nan)
    for i, r in enumerate(rows):
        v[i, : len(r)] = r
    sizes = np.array([len(r) for r in rows])
    if len(rows) == 1 and sizes[0] == 1:
        return float(v[0, 0]), float(v[0, 0])
    rng = np.random.default_rng(seed)
    chunks: list[np.ndarray] = []
    for start in range(0, n_resamples, chunk):  # [chunk, groups, width] at a time: memory flat in n_resamples
        n = min(chunk, n_resamples - start)
        g = rng.integers(0, len(rows), size=(n, len(rows)))
        size = sizes[g][..., None]
        within = (rng.random((n, len(rows), width)) * size).astype(np.int64)  # indices < the group's size
        keep = np.arange(width) < size  # a group of s items resamples s items
        picked = np.where(keep, v[g[..., None], within], 0.0)
        chunks.append((picked.sum(axis=2) / size[..., 0]).mean(axis=1))
    means = np.concatenate(chunks)
    alpha = (1 - level) / 2
    lo, hi = np.quantile(means, [alpha, 1 - alpha])
    return float(lo), float(hi)


def paired_delta(a: Sequence[float | None], b: Sequence[float | None], **kw) -> dict:
    """Mean of per-item differences a - b (items where both exist) with its bootstrap interval."""
    pairs = [(x, y) for x, y in zip(a, b, strict=False) if x is not None and y is not None]
    if not pairs:
        return {"delta": None, "ci95": None, "num_pairs": 0}
    d = [x - y for x, y in pairs]
    ci = bootstrap_ci(d, **kw)
    return {"delta": float(np.mean(d)), "ci95": list(ci) if ci else None, "num_pairs": len(d)}


def macro_pooled(per_prompt_accepts: Sequence[Sequence[int]]) -> tuple[float | None, float | None, int]:
    """Macro mean of per-prompt τ (the DFlash benchmark's number) and pooled mean over steps."""
    taus = [t for a in per_prompt_accepts if (t := tau(a)) is not None]  # None: a prompt without steps
    steps = [x for a in per_prompt_accepts for x in a]
    macro = float(np.mean(taus)) if taus else None  # a mean of τs, not a τ
    return macro, tau(steps), len(steps)


def estimated_speedup(tau: float | None, *, draft_s: float | None = None, verify_s: float | None = None,
                      ar_s: float | None = None, cost_ratio: float | None = None) -> float | None:
    """Tokens per unit time of speculative decoding relative to plain decoding.

    Measured costs: one step costs draft + verify and yields τ tokens, plain decoding costs
    `ar_s` per token. Given only `cost_ratio` = draft/verify: assume verifying a block
    costs one decode step (memory-bound serving), i.e. τ / (1 + ratio).
    """
    if tau is None:
        return None
    if draft_s is not None and verify_s is not None and ar_s is not None and draft_s + verify_s > 0:
        return float(tau * ar_s / (draft_s + verify_s))
    if cost_ratio is not None:
        return float(tau / (1.0 + cost_ratio))
    return None
