"""The speed estimate's timing: interleaved rounds, fastest kept."""
from __future__ import annotations

import time

import torch

from eval_worker.speed import _fastest_interleaved


def test_a_slow_spell_does_not_skew_the_ratio():
    calls: list[str] = []
    spell = {3, 4, 5}  # calls during which "another process" slows everything down

    def timed(name: str, base: float):
        def fn():
            calls.append(name)
            time.sleep(base * (20 if len(calls) in spell else 1))
        return fn

    best = _fastest_interleaved({"a": timed("a", 0.002), "b": timed("b", 0.004)}, reps=4, dev=torch.device("cpu"))
    assert calls[:2] == ["a", "b"] and calls[2:] == ["a", "b"] * 4  # warm-up, then rounds in turn
    assert 0.002 <= best["a"] < 0.02 and 0.004 <= best["b"] < 0.04  # the slow spell is never the answer
    assert 1.2 < best["b"] / best["a"] < 4
