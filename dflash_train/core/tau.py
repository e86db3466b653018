"""τ, the acceptance length: the mean number of tokens a verify step commits (bonus included).

Written once, torch- and numpy-free, and used wherever a τ is computed: the reference
draft-verify loop (`speculative.py`), the engine's replayed walks, its tree walk and its
per-prompt and pooled figures. A prompt with no verify step has no τ (None), never 0.

`COUNTING_RULES` names which verify steps a τ counts and what each step adds (docs/design.md,
"Counting rules"): the real loop and the replay follow the same rule. Under `deepspec`, `vllm`
and `sglang` the figure their source prints is the pooled τ (Σ per-step lengths / steps over all
prompts), not the macro mean of per-prompt τ: `POOLED_RULES`.
"""
from __future__ import annotations

from collections.abc import Sequence

COUNTING_RULES = ("response", "published", "deepspec", "vllm", "sglang")
POOLED_RULES = ("deepspec", "vllm", "sglang")


def tau(accept_lengths: Sequence[int]) -> float | None:
    """Mean accept length over verify steps; None when there is no step."""
    if not len(accept_lengths):
        return None
    return float(sum(int(a) for a in accept_lengths)) / len(accept_lengths)


def check_counting(counting: str) -> str:
    if counting not in COUNTING_RULES:
        raise ValueError(f"counting must be one of {COUNTING_RULES}, got {counting!r}")
    return counting
