"""Tiny random targets + regenerated data + configs for fast trainer tests."""
from __future__ import annotations

import functools

import torch

from dflash_train.training.data import Example, regenerate
from dflash_train.training.train_config import TrainConfig

from .factories import MASK_ID, qwen3_target


@functools.lru_cache(maxsize=4)
def target_and_examples(n: int = 16, prompt_len: int = 12, new_tokens: int = 20, seed: int = 0, hidden: int = 32):
    """A random Qwen3 target and `n` examples whose responses are its greedy output (head_dim = hidden / 4:
    8 by default, below what compiled flex_attention accepts on CUDA; 64 gives 16)."""
    target = qwen3_target(layers=6, hidden=hidden, seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    prompts = [torch.randint(1, MASK_ID, (prompt_len,), generator=g).tolist() for _ in range(n)]
    responses = regenerate(target, prompts, new_tokens, batch_size=n)
    return target, tuple(Example(p + r, len(p), f"ex{i}") for i,
                         (p, r) in enumerate(zip(prompts, responses, strict=True)))


def small_config(tmp_path, **overrides) -> TrainConfig:
    base = dict(target="unused", max_steps=6, batch_size=4, num_anchors=4, block_size=8, drafter_layers=1,
                num_features=2, mask_token_id=MASK_ID, checkpoint_root=str(tmp_path / "ckpt"), run_id="run",
                publish_every=3, max_seq_len=64, seq_multiple=16, progress=False, resume="never", lr=3e-3,
                warmup_ratio=0.2, queue_depth=0, log_every=2)
    base.update(overrides)
    return TrainConfig(**base)
