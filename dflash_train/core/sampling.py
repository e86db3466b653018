"""Keyed sampling from the target: temperature, top-k, top-p, one uniform draw per position.

The draw for absolute position t of sample k of a prompt is a uniform u in [0, 1) taken
from a hash of (seed, prompt ids, k, t), not from a stateful generator. So whoever samples
that position — the reference generator decoding token by token, or the real draft-verify
loop verifying a block — draws the same u, and with the same logits picks the same token:
the two coincide whenever their prefixes agree (up to float noise in the logits, which
moves the pick only when u lands within that noise of a boundary between two tokens).
The hash needs no device RNG, so CPU and CUDA draw alike.

The token is the inverse CDF of the filtered distribution at u, over the vocabulary in id
order: `softmax(logits / T)`, restricted to the `top_k` largest logits and then to the
smallest set of most likely tokens whose mass reaches `top_p` (temperature, then top-k,
then top-p: the order of transformers' and vLLM's samplers). Temperature 0 is argmax.
"""
from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0: greedy (argmax)
    top_p: float = 1.0  # 1: off
    top_k: int = 0  # 0: off

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def to_dict(self) -> dict:
        return {"temperature": self.temperature, "top_p": self.top_p, "top_k": self.top_k}


def prompt_key(prompt_ids: Sequence[int]) -> str:
    """The prompt's part of a draw's key: a digest of its token ids (the loop knows no names)."""
    return hashlib.blake2b(struct.pack(f"<{len(prompt_ids)}q", *prompt_ids), digest_size=16).hexdigest()


def uniform(seed: int, prompt: str, sample: int, position: int) -> float:
    """The keyed draw: u in [0, 1) from 53 bits of a hash of (seed, prompt, sample, position)."""
    h = hashlib.blake2b(f"{seed}:{prompt}:{sample}:{position}".encode(), digest_size=8).digest()
    return (int.from_bytes(h, "little") >> 11) / float(1 << 53)


def filtered_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """`[..., V]` float64 probabilities after temperature, top-k and top-p (zeros outside)."""
    x = logits.double() / params.temperature
    if params.top_k and params.top_k < x.shape[-1]:
        kth = x.topk(params.top_k, dim=-1).values[..., -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if params.top_p < 1:
        p, order = probs.sort(dim=-1, descending=True, stable=True)
        before = p.cumsum(-1) - p  # mass of the more likely tokens: keep while it is below top_p
        p = p.masked_fill(before >= params.top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample_tokens(logits: torch.Tensor, params: SamplingParams, draws: Sequence[float]) -> torch.Tensor:
    """One token per row of `[n, V]` logits, row i at uniform draws[i] (inverse CDF in id order)."""
    if params.greedy:
        return logits.argmax(-1)
    probs = filtered_probs(logits, params)
    cdf = probs.cumsum(-1)
    u = torch.tensor(list(draws), dtype=cdf.dtype, device=cdf.device)[:, None] * cdf[:, -1:]
    ids = torch.searchsorted(cdf, u, right=True)[:, 0]
    # u * total can round to total: fall back to the last token with mass
    last = (probs > 0).cumsum(-1).argmax(-1)
    return torch.minimum(ids, last)


@dataclass(frozen=True)
class Sampler:
    """Sample k of one prompt: draws keyed by (seed, prompt ids, k, absolute position)."""

    params: SamplingParams
    seed: int
    prompt: str  # prompt_key(prompt ids)
    sample: int = 0

    @classmethod
    def for_prompt(cls, params: SamplingParams, seed: int, prompt_ids: Sequence[int], sample: int = 0) -> Sampler:
        return cls(params, int(seed), prompt_key(prompt_ids), int(sample))

    def uniform_at(self, position: int) -> float:
        return uniform(self.seed, self.prompt, self.sample, position)

    def draws(self, positions: Sequence[int]) -> list[float]:
        return [uniform(self.seed, self.prompt, self.sample, int(t)) for t in positions]

    def tokens(self, logits: torch.Tensor, first_position: int) -> torch.Tensor:
        """Tokens for `[n, V]` logits whose row i predicts absolute position first_position + i."""
        return sample_tokens(logits, self.params, self.draws(range(first_position, first_position + logits.shape[0])))
