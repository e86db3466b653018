"""flex_attention where it can run, SDPA where it cannot: the one decision (`masks.choose_backend`),
asked about a CUDA device from the CPU, and the trainer refusing an explicit flex before any step.
(The same on a real GPU: tests/unit/training/test_gpu.py.)"""
import logging

import pytest

from dflash_train.core import masks
from dflash_train.core.masks import AttentionBackendError, choose_backend, flex_unavailable
from dflash_train.training.train_config import TrainConfigError
from dflash_train.training.trainer import Trainer
from tests.support.factories import drafter_for, qwen3_target
from tests.support.train_helpers import small_config, target_and_examples


def _cfg(hidden: int):
    """A drafter config for a random Qwen3 target with 4 heads: head_dim = hidden / 4."""
    return drafter_for(qwen3_target(layers=2, hidden=hidden), layers=1, features=1).config


def test_flex_fallback_decision_for_a_cuda_device():
    small, ok = _cfg(32), _cfg(64)
    assert (small.head_dim, ok.head_dim) == (8, 16)
    # asked about CUDA from this CPU machine: the head_dim rule is the compiled kernel's (>= 16)
    why = flex_unavailable(small, "cuda", triton=True)
    assert why and "head_dim 8 < 16" in why
    assert flex_unavailable(ok, "cuda:0", backward=True, triton=True) is None
    assert choose_backend("auto", ok, "cuda", backward=True, triton=True) == ("flex", None)
    assert choose_backend("auto", small, "cuda", backward=True, triton=True, announce=False) == ("sdpa", why)
    with pytest.raises(AttentionBackendError, match="backend=flex cannot run on cuda: head_dim 8 < 16"):
        choose_backend("flex", small, "cuda", triton=True)
    # a CUDA box without Triton cannot compile flex at all
    assert "Triton" in choose_backend("auto", ok, "cuda", triton=False, announce=False)[1]
    # off CUDA, auto is SDPA without a fallback to report; flex runs eagerly for inference only
    assert choose_backend("auto", small, "cpu") == ("sdpa", None)
    assert choose_backend("flex", small, "cpu") == ("flex", None)
    with pytest.raises(AttentionBackendError, match="no backward pass on cpu"):
        choose_backend("flex", ok, "cpu", backward=True)
    assert choose_backend("sdpa", small, "cuda", triton=True) == ("sdpa", None)
    with pytest.raises(AttentionBackendError, match="unknown attention backend 'triton'"):
        choose_backend("triton", ok, "cpu")


def test_flex_fallback_is_logged_once_per_reason(monkeypatch, caplog):
    monkeypatch.setattr(masks, "_announced", set())
    small = _cfg(32)
    with caplog.at_level(logging.WARNING, logger="dflash_train.core.masks"):
        for _ in range(3):  # the engine asks per drafted chunk
            assert choose_backend("auto", small, "cuda", triton=True)[0] == "sdpa"
    lines = [r.getMessage() for r in caplog.records if r.name == "dflash_train.core.masks"]
    assert len(lines) == 1 and "SDPA instead of flex_attention" in lines[0] and "head_dim 8 < 16" in lines[0]


def test_flex_fallback_explicit_flex_is_refused_before_training(tmp_path):
    """backend=flex where flex cannot train (here: no flex backward on the CPU) fails in the constructor,
    with the reason, not at the first backward pass; auto and sdpa train."""
    target, examples = target_and_examples()
    with pytest.raises(TrainConfigError, match="backend=flex cannot run on cpu: flex_attention has no backward"):
        Trainer(small_config(tmp_path / "flex", backend="flex"), target=target, examples=list(examples))
    assert Trainer(small_config(tmp_path / "auto", max_steps=1), target=target,
                   examples=list(examples)).backend == "sdpa"
    with pytest.raises(TrainConfigError, match="backend must be auto, flex or sdpa"):
        small_config(tmp_path / "bad", backend="cuda")
