"""Caches are used when their key matches, rebuilt (and reported) when it does not, never crash."""
import json

import pytest
import torch

from dflash_train.checkpoints.checkpoint import save_drafter
from eval_worker.engine.acceptance import Evaluator
from eval_worker.engine.suite import Prompt, Suite
from tests.support.factories import drafter_for, qwen3_target

OPTS = {"tree_budget": 4, "measure_speed": False}


def suite(first_prompt=(3, 14, 15, 9, 26)):
    return Suite("cachesuite", "1", [Prompt("a", ids=tuple(first_prompt)), Prompt("b", ids=(7, 1, 8, 2, 8))],
                 chat_template=False, max_new_tokens=20)


@pytest.fixture
def setup(tmp_path):
    target = qwen3_target(seed=2)
    target.source = "/models/same-path"  # the slot follows the path; the key, the weights
    drafter = drafter_for(target, block_size=4)
    save_drafter(drafter, tmp_path / "ck")
    return target, tmp_path


def comparable(res):
    d = res.to_dict()
    return d["tau"], d["tree"], [(p["name"], p["accept_lengths"], p["reference_text"]) for p in d["prompts"]]


def test_cold_then_warm(setup):
    target, tmp = setup
    cold = Evaluator(target, tmp / "cache").evaluate(tmp / "ck", suite(), options=OPTS)
    assert cold.cache == {"references": "built", "features": "built", "notes": []}
    warm = Evaluator(target, tmp / "cache").evaluate(tmp / "ck", suite(), options=OPTS)  # fresh process view
    assert warm.cache == {"references": "hit", "features": "hit", "notes": []}
    assert comparable(warm) == comparable(cold)
    assert "CACHE_REBUILT" not in warm.diagnostic_codes()


def test_changed_target_weights_rebuild_and_say_so(setup):
    target, tmp = setup
    Evaluator(target, tmp / "cache").evaluate(tmp / "ck", suite(), options=OPTS)
    other = qwen3_target(seed=5)  # same architecture, same path, new weights
    other.source = target.source
    res = Evaluator(other, tmp / "cache").evaluate(tmp / "ck", suite(), options=OPTS)
    assert res.cache["references"] == "rebuilt" and res.cache["features"] == "rebuilt"
    assert any("target_fingerprint" in n for n in res.cache["notes"])
    assert "CACHE_REBUILT" in res.diagnostic_codes()
    again = Evaluator(other, tmp / "cache").evaluate(tmp / "ck", suite(), options=OPTS)
    assert again.cache["features"] == "hit"
    assert comparable(again) == comparable(res)


def test_fingerprint_one_element_edit_in_saved_target_rebuilds_references_and_features(setup):
    """A target loaded from a directory: an edit of one LM-head element is a new target."""
    from dflash_train.core.target import Target

    target, tmp = setup
    d = tmp / "target"
    target.model.save_pretrained(d)
    first = Evaluator(Target.load(d), tmp / "cache").evaluate(tmp / "ck", suite(), options=OPTS)
    warm = Evaluator(Target.load(d), tmp / "cache").evaluate(tmp / "ck", suite(), options=OPTS)
    assert first.cache["features"] == "built" and warm.cache == {"references": "hit", "features": "hit", "notes": []}
    with torch.no_grad():
        target.parts.lm_head.weight[41, 5] += 1e-4
    target.model.save_pretrained(d)
    res = Evaluator(Target.load(d), tmp / "cache").evaluate(tmp / "ck", suite(), options=OPTS)
    assert res.cache["references"] == "rebuilt" and res.cache["features"] == "rebuilt"
    assert res.target["fingerprint"] != first.target["fingerprint"]


def test_changed_layer_ids_never_reuse_features(setup):
    target, tmp = setup
    Evaluator(target, tmp / "cache").evaluate(tmp / "ck", suite(), options=OPTS)
    other = drafter_for(target, block_size=4, features=2)  # reads other target layers
    assert other.config.target_layer_ids != drafter_for(target).config.target_layer_ids
    save_drafter(other, tmp / "ck2")
    res = Evaluator(target, tmp / "cache").evaluate(tmp / "ck2", suite(), options={**OPTS, "validate": True})
    assert res.cache["references"] == "hit" and res.cache["features"] == "built"
    assert res.validation["ok"]  # drafted from the right layers: equals the real loop
    stored = list((tmp / "cache" / "features").glob("*.safetensors"))
    assert len(stored) == 4  # two prompts x two layer sets, side by side


def test_changed_tokens_rebuild(setup):
    target, tmp = setup
    Evaluator(target, tmp / "cache").evaluate(tmp / "ck", suite(), options=OPTS)
    res = Evaluator(target, tmp / "cache").evaluate(tmp / "ck", suite((3, 14, 15, 9, 27)), options=OPTS)
    assert res.cache["references"] == "rebuilt" and res.cache["features"] == "rebuilt"
    notes = " ".join(res.cache["notes"])
    assert "prompt_ids" in notes and "tokens" in notes and "for a" in notes and "for b" not in notes


def test_changed_target_dtype_rebuilds_features(setup):
    target, tmp = setup
    Evaluator(target, tmp / "cache").evaluate(tmp / "ck", suite(), options=OPTS)
    target.model.to(torch.float64)
    target._fingerprint = None
    res = Evaluator(target, tmp / "cache").evaluate(tmp / "ck", suite(), options=OPTS)
    assert res.cache["features"] == "rebuilt"
    assert any("dtype float32 -> float64" in n for n in res.cache["notes"])


@pytest.mark.parametrize("damage", ["truncate", "garbage", "wrong_shape"])
def test_corrupt_cache_files_are_rebuilt_not_fatal(setup, damage):
    target, tmp = setup
    cold = Evaluator(target, tmp / "cache").evaluate(tmp / "ck", suite(), options=OPTS)
    for f in (tmp / "cache").rglob("*.*"):
        if damage == "truncate":
            f.write_bytes(f.read_bytes()[: len(f.read_bytes()) // 2])
        elif damage == "garbage":
            f.write_bytes(b"\x00not a cache file")
        elif f.suffix == ".json":  # valid JSON, wrong content
            f.write_text(json.dumps({"key": json.loads(f.read_text())["key"], "value": {"name": "a"}}))
        else:
            from safetensors import safe_open
            from safetensors.torch import save_file

            with safe_open(str(f), framework="pt") as h:
                meta = h.metadata()
            save_file({"features": torch.zeros(3, 4), "greedy": torch.zeros(3, dtype=torch.long)}, str(f),
                      metadata=meta)
    res = Evaluator(target, tmp / "cache").evaluate(tmp / "ck", suite(), options=OPTS)
    assert res.cache["references"] == "rebuilt" and res.cache["features"] == "rebuilt"
    assert comparable(res) == comparable(cold)
    assert all("rebuilt" in n for n in res.cache["notes"])


def test_memory_cache_serves_the_next_job(setup):
    target, tmp = setup
    ev = Evaluator(target, None)  # no disk at all: RAM keeps features across jobs
    first = ev.evaluate(tmp / "ck", suite(), options=OPTS)
    second = ev.evaluate(tmp / "ck", suite(), options=OPTS)
    assert first.cache["features"] == "built" and second.cache["features"] == "hit"
    assert second.cache["references"] == "built"  # references are disk-only; regenerated identically
    assert comparable(first) == comparable(second)


def test_reference_lookahead_grows_with_the_block_size(setup):
    """B-1 greedy tokens past the reference end are needed: a shorter stored lookahead is extended (not
    rebuilt), a longer one serves smaller B."""
    target, tmp = setup
    save_drafter(drafter_for(target, block_size=8), tmp / "ck8")
    Evaluator(target, tmp / "cache").evaluate(tmp / "ck", suite(), options=OPTS)  # B=4: lookahead 3
    big = Evaluator(target, tmp / "cache").evaluate(tmp / "ck8", suite(), options={**OPTS, "validate": True})
    assert big.cache["references"] == "extended" and big.cache["notes"] == []
    assert big.validation["ok"]
    small = Evaluator(target, tmp / "cache").evaluate(tmp / "ck", suite(), options=OPTS)
    assert small.cache["references"] == "hit"
