"""The speed estimate's timing: interleaved rounds, fastest kept."""
from __future__ import annotations

import time

import torch

from eval_worker.engine.speed import _fastest_interleaved


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


def test_speed_is_measured_on_hybrid_targets_too(tmp_path):
    """Recurrent (linear-attention) layers: verify is timed with the rollback the loop does."""
    from dflash_train.checkpoints.checkpoint import save_drafter
    from eval_worker.engine.acceptance import Evaluator
    from eval_worker.engine.speed import measure_step_costs
    from eval_worker.engine.suite import Prompt, Suite
    from tests.support.factories import drafter_for, qwen3_5_vlm_target

    target = qwen3_5_vlm_target()
    drafter = drafter_for(target, features=1, block_size=4)
    costs = measure_step_costs(target, drafter, context_len=40, reps=2, committed=2)
    assert costs["recurrent_layers"] == 3 and costs["committed_per_step"] == 2
    assert all(costs[k] > 0 for k in ("draft_s", "verify_s", "decode_s"))
    save_drafter(drafter, tmp_path / "ck")
    suite = Suite("s", "1", [Prompt("a", ids=(3, 1, 4, 1, 5))], chat_template=False, max_new_tokens=12)
    res = Evaluator(target, None).evaluate(tmp_path / "ck", suite, options={"validate": True})
    assert res.speedup["estimated"] is not None and res.speedup["source"].startswith("measured on")
    assert res.validation["ok"]  # and the real loop on this target still equals the replay


def test_step_cost_cached(tmp_path):
    """The step costs are timed once per (target, device, drafter shape): a second checkpoint of the same shape
    (other weights) and the next process on the same cache directory read them (issue 37, item 3)."""
    import json

    from dflash_train.checkpoints.checkpoint import save_drafter
    from dflash_train.core.target import Target
    from eval_worker.engine.acceptance import Evaluator
    from eval_worker.engine.suite import Prompt, Suite
    from tests.support.factories import drafter_for

    target = Target.load("dflash_train/assets/tiny_target")
    for seed in (0, 1):
        save_drafter(drafter_for(target, block_size=4, seed=seed), tmp_path / f"ck{seed}")
    suite = Suite("s", "1", [Prompt("a", ids=(3, 1, 4, 1, 5))], chat_template=False, max_new_tokens=8)
    opts = {"leak_probe_anchors": 0, "tree_budget": 0}
    ev = Evaluator(target, tmp_path / "cache", progress=False)
    first = ev.evaluate(tmp_path / "ck0", suite, options=opts).speedup
    second = ev.evaluate(tmp_path / "ck1", suite, options=opts).speedup
    assert ev.step_costs.measured == 1
    assert first["cached"] is False and second["cached"] is True and second["measured"] == first["measured"]
    again = Evaluator(target, tmp_path / "cache", progress=False)
    third = again.evaluate(tmp_path / "ck1", suite, options=opts).speedup
    assert again.step_costs.measured == 0 and third["cached"] is True
    assert json.loads(json.dumps(third["measured"])) == json.loads(json.dumps(first["measured"]))
    assert third["estimated"] is not None
