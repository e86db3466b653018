"""Leak probe: would this drafter do much better if it saw what a leaky trainer shows it?

A drafter trained with a context leak learned to read its answers off something inference
never provides, so its training accuracy is high on *any* data while real τ is ~1 (SF #455:
70% training accuracy, accept length 1.02). Distribution shift also puts τ far below what
training accuracy promised, so comparing the two cannot tell them apart. The probe asks the
suite itself instead, on a sample of its anchors, and compares per-slot top-1 accuracy of

- `strict`: the inference view (context `kv < anchor`), the drafts τ is made of;
- `anchor_state`: the same blocks with the anchor's own target state visible (`kv <= anchor`,
  the inclusive-anchor leak). A leak-trained drafter jumps here; a healthy one cannot use a
  state it never saw in training, on familiar or unfamiliar prompts alike;
- `shifted_label`: the strict drafts against the reference one token later (slot k vs the
  token at anchor + k + 1: the label-offset bug). A drafter trained on shifted labels jumps.

Shifted prompts lower every view together; only a leak opens a gap between them.

It also checks the drafting path itself against the drafter's contract: changing the target
states at and after an anchor must not change that anchor's block by a single bit (a leak in
the evaluated path would inflate the replayed τ instead of deflating it).
"""
from __future__ import annotations

import numpy as np
import torch

from eval_worker.engine import metrics
from eval_worker.engine.drafting import draft_anchors
from eval_worker.engine.options import DEFAULT_LEAK_PROBE_ANCHORS

DEFAULT_PROBE_ANCHORS = DEFAULT_LEAK_PROBE_ANCHORS  # over the whole suite; 0 turns the probe off
CONTRACT_ANCHORS_PER_PROMPT = 2  # blocks re-drafted with their future perturbed, per prompt
# ... and in all: the contract is one of the drafting path, not of a prompt, and each check drafts twice over the
# whole context (at 32 prompts, 2 per prompt cost more than the probe's anchor-state view; issue 37)
CONTRACT_CHECKS = 4
MIN_PROBE_ANCHORS = 64  # fewer say nothing either way
# Slot-1 accuracy a leak view must gain over the inference view, absolute and relative (the
# views are compared on the same anchors). Measured: healthy drafters gain -0.06..+0.04 (demo
# drafters on the built-in suite and on raw code, fitted test drafters); a drafter trained with
# the inclusive-anchor leak gains +0.29 on held-out prompts (tests/integration/test_leak_alarm.py).
LEAK_GAIN_ABS = 0.15
LEAK_GAIN_REL = 1.5

VIEWS = ("strict", "anchor_state", "shifted_label")


def probe_offsets(num_tokens: int, quota: int, within: np.ndarray | None = None) -> np.ndarray:
    """Up to `quota` response offsets spread evenly over 0..num_tokens-1 (deterministic); with `within` (sorted
    offsets, the run's anchor sample) holding at least `quota`, spread evenly over those instead: the sample's
    blocks are drafted on every slot anyway, so the probe's strict view costs no block of its own (any anchors
    serve the probe: its views are compared on the same ones)."""
    if num_tokens <= 0 or quota <= 0:
        return np.zeros(0, dtype=np.int64)
    if within is not None and len(within) >= quota:
        return np.unique(within[np.linspace(0, len(within) - 1, quota).round().astype(np.int64)])
    return np.unique(np.linspace(0, num_tokens - 1, min(quota, num_tokens)).round().astype(np.int64))


class LeakProbe:
    """Per-slot hit/comparable counts of the three views, summed over the probed anchors."""

    def __init__(self, block_size: int, budget: int, num_prompts: int):
        self.block_size = block_size
        self.quota = -(-budget // max(num_prompts, 1)) if budget > 0 else 0
        self.anchors = 0
        self.future_reads: list[str] = []  # "<prompt>@<offset>" whose block changed with its future
        self.contract_checked = 0
        self.hits = {v: np.zeros(block_size - 1, dtype=np.int64) for v in VIEWS}
        self.valid = {v: np.zeros(block_size - 1, dtype=np.int64) for v in VIEWS}

    def add(self, ext: list[int], offsets: np.ndarray, strict: np.ndarray, anchor_state: np.ndarray) -> None:
        """`strict`, `anchor_state`: `[len(offsets), B-1]` argmax drafts of the blocks at `offsets`."""
        n = len(ext)
        for view, drafts, at in (("strict", strict, offsets), ("anchor_state", anchor_state, offsets),
                                 ("shifted_label", strict, offsets + 1)):
            self.hits[view] += metrics.matches(drafts, ext, at).sum(0)
            self.valid[view] += ((at[:, None] + np.arange(1, self.block_size)[None]) < n).sum(0)
        self.anchors += len(offsets)

    @torch.no_grad()
    def check_contract(self, name: str, drafter, embed, head, input_ids: torch.Tensor, features: torch.Tensor,
                       prompt_len: int, offsets: np.ndarray, **draft_kw) -> None:
        """Re-draft a few blocks with the target states at and after their anchor replaced by noise (the first
        prompts' until CONTRACT_CHECKS are made)."""
        if self.contract_checked >= CONTRACT_CHECKS:
            return
        gen = torch.Generator().manual_seed(len(self.future_reads) + self.contract_checked)
        k = min(CONTRACT_ANCHORS_PER_PROMPT, CONTRACT_CHECKS - self.contract_checked, len(offsets))
        picks = offsets[np.linspace(0, len(offsets) - 1, k).astype(int)]
        for off in np.unique(picks).tolist():
            a = prompt_len + off
            noisy = features.clone()
            noise = torch.randn(noisy[a:].shape, generator=gen).to(noisy.device, noisy.dtype)
            noisy[a:] = noise * features.float().std().to(noisy.dtype)
            same = draft_anchors(drafter, embed, head, input_ids, features, [a], topk=2, **draft_kw)
            moved = draft_anchors(drafter, embed, head, input_ids, noisy, [a], topk=2, **draft_kw)
            assert same.topk_logp is not None and moved.topk_logp is not None  # topk=2 drafts them
            if not (np.array_equal(same.argmax, moved.argmax) and np.array_equal(same.topk_logp, moved.topk_logp)):
                self.future_reads.append(f"{name}@{off}")
            self.contract_checked += 1

    def to_dict(self) -> dict:
        top1 = {f"{v}_top1": [float(h / c) if c else None for h,
                              c in zip(self.hits[v].tolist(), self.valid[v].tolist(), strict=True)]
                for v in VIEWS}
        return {"anchors": self.anchors, **top1, "contract_checked": self.contract_checked,
                "future_reads": self.future_reads}


def leak_signature(probe: dict | None) -> tuple[str, str] | None:
    """(kind, what) the probe points at, or None. kind "path": the evaluated drafting reads the
    future; kind "trained": the drafter does far better with what only a leaky trainer shows."""
    if probe and probe.get("future_reads"):
        return "path", f"blocks {probe['future_reads'][:5]} changed when only the states at and after their anchor did"
    if not probe or probe.get("anchors", 0) < MIN_PROBE_ANCHORS:
        return None
    strict = (probe.get("strict_top1") or [None])[0]
    if strict is None:
        return None
    for view, name in (("anchor_state", "the anchor's own target state (inclusive-anchor context, kv <= anchor)"),
                       ("shifted_label", "labels one token later (slot k trained on anchor+k+1)")):
        leaky = (probe.get(f"{view}_top1") or [None])[0]
        if leaky is not None and leaky - strict >= LEAK_GAIN_ABS and leaky >= LEAK_GAIN_REL * strict:
            return "trained", name
    return None
