"""The result: JSON round trip, consistent numbers, baseline Δ, stride mode, diagnostics."""
import json

import numpy as np
import pytest
import torch

from dflash_train.checkpoints.checkpoint import save_drafter
from eval_worker.engine.acceptance import Evaluator
from eval_worker.engine.result import SCHEMA, EvalResult, ResultSchemaError
from eval_worker.engine.suite import Prompt, Suite
from tests.support.engine_helpers import fit_drafter, references
from tests.support.factories import drafter_for, qwen3_target

TARGET = qwen3_target(seed=8)
PROMPTS = [[5, 17, 33, 2, 61, 8], [40, 41, 9, 9, 12, 70], [3, 3, 71, 22, 8], [60, 1, 2, 3, 4, 5, 6], [11, 12]]
SUITE = Suite("r", "1", [Prompt(f"p{i}", ids=tuple(p)) for i, p in enumerate(PROMPTS)], chat_template=False,
              max_new_tokens=32)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ck")
    good = fit_drafter(TARGET, drafter_for(TARGET, block_size=6), references(TARGET, PROMPTS[:3], 32),
                       [6, 6, 5], steps=30)
    save_drafter(good, root / "good")
    save_drafter(drafter_for(TARGET, block_size=6, seed=3), root / "random")
    return root


@pytest.fixture(scope="module")
def ev(tmp_path_factory):
    return Evaluator(TARGET, tmp_path_factory.mktemp("cache"))  # references generated once for the module


@pytest.fixture(scope="module")
def result(ckpts, ev):
    return ev.evaluate(ckpts / "good", SUITE, baseline=ckpts / "random", options={"tree_budget": 8, "tree_spine": True})


def test_json_round_trip_and_schema(result):
    text = result.to_json()
    d = json.loads(text)
    assert d["schema"] == SCHEMA and list(d)[0] == "schema"
    for key in ("checkpoint", "target", "suite", "settings", "tau", "acceptance_histogram", "per_position",
                "mean_streak_all_anchors", "tree", "speedup", "baseline", "prompts", "diagnostics", "cache",
                "provenance"):
        assert key in d
    assert EvalResult.from_json(text).to_dict() == d
    with pytest.raises(ResultSchemaError, match="understands"):
        EvalResult.from_dict({**d, "schema": "dflash-eval-result/2"})
    del d["tau"]
    with pytest.raises(ResultSchemaError, match="missing \\['tau'\\]"):
        EvalResult.from_dict(d)


def test_numbers_agree_with_each_other(result):
    d = result.to_dict()
    B = d["settings"]["block_size"]
    steps = [x for p in d["prompts"] for x in p["accept_lengths"]]
    assert d["tau"]["num_steps"] == len(steps) == sum(d["acceptance_histogram"])
    assert d["tau"]["pooled"] == pytest.approx(np.mean(steps))
    assert d["tau"]["macro"] == pytest.approx(np.mean([p["tau"] for p in d["prompts"]]))
    lo, hi = d["tau"]["ci95"]
    assert lo <= d["tau"]["macro"] <= hi and lo < hi
    assert len(d["per_position"]["conditional_accept"]) == len(d["per_position"]["top1_accuracy"]) == B - 1
    assert d["tree"]["tau"] >= d["tau"]["macro"] and d["tree"]["blocks_below_top1"] == 0  # spine tree
    assert 1.0 < d["tau"]["macro"] <= B
    assert d["speedup"]["estimated"] > 0 and d["speedup"]["draft_verify_cost_ratio"] > 0
    for p in d["prompts"]:  # one char span per verify step, in order, inside the text
        spans = p["accepted_spans"]
        assert len(spans) == len(p["accept_lengths"])
        assert all(0 <= a <= b <= len(p["reference_text"]) for a, b in spans)
        assert all(spans[i][1] <= spans[i + 1][0] for i in range(len(spans) - 1))
    assert set(d["provenance"]["timings_s"]) >= {"load", "references", "features", "draft", "score", "total"}


def test_baseline_paired_delta(result, ckpts, ev):
    b = result.baseline
    taus = [p.tau for p in result.prompts]
    btaus = [p.baseline_tau for p in result.prompts]
    assert b["delta_tau"] == pytest.approx(np.mean(np.array(taus) - np.array(btaus)))
    assert b["delta_tau"] == pytest.approx(result.tau["macro"] - b["tau"])
    assert b["delta_ci95"][0] <= b["delta_tau"] <= b["delta_ci95"][1]
    assert b["delta_tau"] > 0  # fitted beats random on the prompts it saw
    same = ev.evaluate(ckpts / "good", SUITE, baseline=ckpts / "good", options={"measure_speed": False})
    assert same.baseline["delta_tau"] == 0 and same.baseline["delta_ci95"] == [0.0, 0.0]


def test_stride_mode_like_the_seeds_harness(ckpts, ev):
    res = ev.evaluate(ckpts / "good", SUITE, options={
        "mode": "stride", "max_blocks": 3, "num_prompts": 3, "measure_speed": False})
    assert res.settings["mode"] == "stride" and len(res.prompts) == 3
    assert all(len(p.accept_lengths) <= 3 for p in res.prompts)
    assert res.tau["macro"] == pytest.approx(res.stride["tau"])
    assert res.suite["num_prompts"] == 3 and res.suite["fingerprint"] != SUITE.fingerprint()


def test_leak_alarm_random_drafter_with_high_training_accuracy_is_a_gap_not_a_leak(ckpts, ev):
    """τ≈1 against a 0.75 training accuracy: without the probe's evidence of a leak that is a
    warning (shift, overfitting, a wrong checkpoint), not the error that fails `dflash-eval run`."""
    res = ev.evaluate(ckpts / "random", SUITE, train_metrics={"loss": 0.9, "accuracy": 0.75},
                      options={"measure_speed": False})
    assert res.tau["macro"] < 1.1 and res.errors() == []
    gap = [d for d in res.diagnostics if d.code == "TRAIN_EVAL_ACCURACY_GAP"]
    assert gap and "0.75" in gap[0].message and "TAU_NEAR_ONE" in res.diagnostic_codes()
    quiet = ev.evaluate(ckpts / "random", SUITE, train_metrics={"accuracy": 0.02}, options={"measure_speed": False})
    assert "TRAIN_EVAL_ACCURACY_GAP" not in quiet.diagnostic_codes() and "TAU_NEAR_ONE" in quiet.diagnostic_codes()


def test_dtype_and_last_layer_diagnostics(tmp_path, ev):
    d = drafter_for(TARGET, block_size=4, features=1)
    d.config.target_layer_ids = [TARGET.num_layers - 1]
    save_drafter(d, tmp_path / "d", dtype=torch.bfloat16)
    res = ev.evaluate(tmp_path / "d", SUITE, options={"measure_speed": False, "num_prompts": 1})
    codes = res.diagnostic_codes()
    assert "DTYPE_MISMATCH" in codes and "LAST_LAYER_AS_FEATURE" in codes


def test_layer_formula_fallback_is_named_in_the_result(tmp_path, ev):
    """A config.json without target_layer_ids: the result says the layers came from the published formula."""
    d = drafter_for(TARGET, block_size=4, layers=2, features=2)
    save_drafter(d, tmp_path / "d")
    cfg_path = tmp_path / "d" / "config.json"
    cfg = json.loads(cfg_path.read_text())
    del cfg["dflash_config"]["target_layer_ids"]
    cfg_path.write_text(json.dumps(cfg))
    opts = {"measure_speed": False, "num_prompts": 1, "tree_budget": 0}
    res = ev.evaluate(tmp_path / "d", SUITE, options=opts)
    assert res.settings["layer_ids"] == [1, 3] and "build_target_layer_ids" in res.settings["layer_ids_origin"]
    note = [x for x in res.diagnostics if x.code == "LAYER_IDS_FROM_FALLBACK"]
    assert note and "half to even" in note[0].message and note[0].severity == "info"
    save_drafter(d, tmp_path / "explicit")
    plain = ev.evaluate(tmp_path / "explicit", SUITE, options=opts)
    assert plain.settings["layer_ids_origin"] == "config" and "LAYER_IDS_FROM_FALLBACK" not in plain.diagnostic_codes()


# --- collapse: a degenerate reference is flagged ----------------------------------------------
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from eval_worker.engine.diagnostics import (  # noqa: E402
    COLLAPSE_MAX_LINES,
    COLLAPSE_MIN_TOKENS,
    Facts,
    diagnose,
    mostly_degenerate,
    reference_collapse,
)
from eval_worker.engine.references import LocalReferences, Reference  # noqa: E402

CODE = ("def binary_search(items, target):\n    lo, hi = 0, len(items) - 1\n    while lo <= hi:\n"
        "        mid = (lo + hi) // 2\n        if items[mid] == target:\n            return mid\n"
        "        if items[mid] < target:\n            lo = mid + 1\n        else:\n            hi = mid - 1\n"
        "    return -1\n")


@settings(max_examples=60, deadline=None)
@given(lines=st.lists(st.text("#ab ()=:", min_size=0, max_size=6), min_size=1, max_size=COLLAPSE_MAX_LINES,
                      unique=True),
       reps=st.integers(min_value=1, max_value=40))
def test_few_distinct_lines_in_a_long_response_is_degenerate(lines, reps):
    text = "\n".join(lines * reps)
    tokens = list(range(max(COLLAPSE_MIN_TOKENS, len(text))))  # many distinct tokens: the lines alone decide
    assert reference_collapse(tokens, text) is not None
    assert reference_collapse(tokens[:COLLAPSE_MIN_TOKENS - 1], text) is None  # a short answer that ended


def test_real_code_is_not_degenerate_and_repeated_tokens_are():
    assert reference_collapse(list(range(60)), CODE) is None
    assert "distinct token" in reference_collapse([7, 8] * 40, None)  # no tokenizer: tokens alone
    assert reference_collapse(list(range(80)), None) is None
    assert "1 distinct line" in reference_collapse([9] * 64, "import sys" * 64)
    facts = Facts(tau=2.0, block_size=8, eval_top1=[], degenerate={"p0": "2 distinct line(s) in 128 tokens"},
                  num_prompts=4)
    d = [x for x in diagnose(facts) if x.code == "DEGENERATE_REFERENCE"]
    assert d and d[0].severity == "warning" and "1 of 4" in d[0].message and "p0" in d[0].message
    assert "DEGENERATE_REFERENCE" not in [x.code for x in diagnose(Facts(tau=2.0, block_size=8, eval_top1=[]))]
    assert mostly_degenerate([{"name": "a", "degenerate": "x"}, {"name": "b", "degenerate": None}]) is None
    assert mostly_degenerate([{"name": "a", "degenerate": "x"}, {"name": "b", "degenerate": "y"},
                              {"name": "c"}]) == ["a", "b"]


class _Collapsing(LocalReferences):
    """The target's own references, except that p1's is constructed: one token repeated."""

    name = "collapsing"

    def identity(self):
        return {"kind": "collapsing"}

    def generate_many(self, requests, drafter=None, stats=None):
        # the engine decodes greedy references in batches through generate_many
        for batch in super().generate_many(requests, drafter=drafter, stats=stats):
            yield [(i, self._collapse(ref)) for i, ref in batch]

    @staticmethod
    def _collapse(ref):
        if ref.name != "p1":
            return ref
        n = len(ref.lookahead)
        return Reference(ref.name, ref.prompt_ids, [ref.tokens[0]] * 40, [ref.tokens[0]] * n, "length",
                         "collapsing", n)


def test_collapse_diagnostic_fires_on_a_constructed_degenerate_reference(ckpts, tmp_path):
    ev = Evaluator(TARGET, tmp_path / "cache", reference_source=_Collapsing(TARGET))
    suite = Suite("r", "1", [Prompt(f"p{i}", ids=tuple(p)) for i, p in enumerate(PROMPTS[:3])], chat_template=False,
                  max_new_tokens=40)
    res = ev.evaluate(ckpts / "good", suite, options={"measure_speed": False, "reference_mismatch": "measure"})
    flagged = {p.name: p.degenerate for p in res.prompts}
    assert flagged["p1"] == "1 distinct token(s) in 40"
    diag = [d for d in res.diagnostics if d.code == "DEGENERATE_REFERENCE"]
    assert diag and "p1: 1 distinct token(s) in 40" in diag[0].message
    again = EvalResult.from_json(res.to_json())
    assert {p.name: p.degenerate for p in again.prompts} == flagged
