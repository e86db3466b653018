"""The replayed online walk gives exactly the per-step acceptance of the real draft-verify loop.

This is the engine's central claim: τ from one cached target pass + batched drafting at
every anchor == τ that `speculative_generate` (real drafting with a KV cache, real
verification) produces, step by step, prompt by prompt.
"""
import pytest
import torch

from dflash_train.checkpoints.checkpoint import save_drafter
from dflash_train.core.speculative import speculative_generate
from eval_worker.engine.acceptance import Evaluator
from eval_worker.engine.suite import Prompt, Suite
from tests.support.engine_helpers import fit_drafter, references
from tests.support.factories import drafter_for, qwen3_5_vlm_target, qwen3_target


def _prompts(n, seed, length=6):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 90, (length + i % 3,), generator=g).tolist() for i in range(n)]


def _suite(prompts, max_new):
    return Suite("rand", "1", [Prompt(f"p{i}", ids=tuple(p)) for i, p in enumerate(prompts)],
                 chat_template=False, max_new_tokens=max_new)


def _fitted(seed, tmp_path_factory):
    """A random target and a drafter fitted to part of its greedy output (varied acceptance)."""
    target = qwen3_target(seed=seed)
    prompts = _prompts(5, seed)
    train = prompts[:3]  # two prompts the drafter never saw: lower, different acceptance
    fit_drafter(target, drafter := drafter_for(target, block_size=8, seed=seed),
                references(target, train, 40), [len(p) for p in train], steps=30)
    ckpt = tmp_path_factory.mktemp(f"ckpt{seed}")
    save_drafter(drafter, ckpt)
    return target, drafter, ckpt, prompts


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    return _fitted(0, tmp_path_factory)


@pytest.fixture(scope="module", params=[0, 1])
def fitted_each(request, fitted, tmp_path_factory):
    return fitted if request.param == 0 else _fitted(request.param, tmp_path_factory)


def test_replay_equals_real_loop_per_step(fitted_each, tmp_path):
    target, drafter, ckpt, prompts = fitted_each
    ev = Evaluator(target, tmp_path / "cache")
    res = ev.evaluate(ckpt, _suite(prompts, 40), options={"tree_budget": 0, "measure_speed": False})
    lengths_seen = set()
    for p, pr in zip(prompts, res.prompts, strict=False):
        real = speculative_generate(target, drafter, p, 40)
        assert pr.accept_lengths == real.accept_lengths, pr.name
        assert pr.tau == pytest.approx(real.tau)
        lengths_seen |= set(real.accept_lengths)
    assert len(lengths_seen) >= 3  # the comparison is not vacuous: acceptance varies
    assert res.tau["pooled"] > 1.2


def test_replay_equals_real_loop_with_eos_inside_the_reference(fitted, tmp_path):
    """eos truncation: the real loop stops mid-block; the reference ends at eos; lookahead covers the rest."""
    target, drafter, ckpt, prompts = fitted
    real0 = speculative_generate(target, drafter, prompts[0], 40)
    eos = real0.tokens[len(real0.tokens) // 2]  # a token that does occur in the first reference
    ev = Evaluator(target, tmp_path / "cache")
    res = ev.evaluate(ckpt, _suite(prompts, 40), options={"eos_token_id": eos, "validate": True,
                                                          "tree_budget": 0, "measure_speed": False})
    assert res.validation["ok"], res.validation["mismatched_prompts"]
    assert res.validation["reference_differs_from_loop"] == []
    assert any(p.finish == "eos" for p in res.prompts)
    assert res.validation["steps_checked"] == res.tau["num_steps"]  # every step compared


def test_validation_catches_features_from_the_wrong_positions(fitted, tmp_path):
    """Validation is a real check: features shifted by one position (the seeds' position bug),
    planted in the cache under a valid key, make the replay disagree with the real loop."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    target, drafter, ckpt, prompts = fitted
    suite = _suite(prompts[:2], 40)
    opts = {"tree_budget": 0, "measure_speed": False, "validate": True}
    good = Evaluator(target, tmp_path / "cache").evaluate(ckpt, suite, options=opts)
    assert good.validation["ok"] and not good.errors()
    for f in (tmp_path / "cache" / "features").glob("*.safetensors"):
        with safe_open(str(f), framework="pt") as h:
            meta, t = h.metadata(), {k: h.get_tensor(k) for k in h.keys()}
        t["features"] = torch.roll(t["features"], 1, dims=0)  # state of p-1 served as p
        save_file(t, str(f), metadata=meta)
    bad = Evaluator(target, tmp_path / "cache").evaluate(ckpt, suite, options=opts)
    assert bad.cache["features"] == "hit"  # the key matched: only validation can notice
    assert not bad.validation["ok"]
    assert {m["name"] for m in bad.validation["mismatched_prompts"]} <= {"p0", "p1"}
    assert "VALIDATION_MISMATCH" in [d.code for d in bad.errors()]


def test_replay_on_wrapped_linear_attention_target(tmp_path):
    """Qwen3.5 wrapper (text stack under model.language_model, recurrent layers): same exactness."""
    target = qwen3_5_vlm_target()
    drafter = drafter_for(target, features=1, block_size=4)
    prompts = _prompts(2, 5)
    fit_drafter(target, drafter, references(target, prompts, 24), [len(p) for p in prompts], steps=20)
    save_drafter(drafter, tmp_path / "ck")
    res = Evaluator(target, tmp_path / "cache").evaluate(tmp_path / "ck", _suite(prompts, 24),
                                                         options={"validate": True, "tree_budget": 4})
    assert res.validation["ok"], res.validation["mismatched_prompts"]
    assert res.validation["steps_checked"] == res.tau["num_steps"]
    # the real loop verified incrementally (recurrent states rolled back after partial
    # acceptance): step for step the same as re-running the whole sequence every step
    accepts = [n for p in res.prompts for n in p.accept_lengths]
    assert 1 in accepts and max(accepts) > 1  # rejections and acceptances both exercised
    for p in prompts:
        inc = speculative_generate(target, drafter, p, 24)
        full = speculative_generate(target, drafter, p, 24, use_cache=False)
        assert inc.accept_lengths == full.accept_lengths and inc.tokens == full.tokens
    assert res.speedup["estimated"] is not None  # measured with the rollback the loop does


def test_counting_published_replay_equals_the_published_loop(fitted, tmp_path):
    """counting="published": the replay equals `speculative_generate(counting="published")` step by
    step, including the two places the rules differ (steps summing to N - 1, an eos first token)."""
    target, drafter, ckpt, prompts = fitted
    eos = speculative_generate(target, drafter, prompts[1], 1).tokens[0]  # prompt 1 answers eos at once
    first = speculative_generate(target, drafter, prompts[0], 40, eos_token_id=eos)
    assert eos not in first.tokens and len(first.accept_lengths) >= 3
    N = 1 + sum(first.accept_lengths[:2])  # prompt 0: two steps commit exactly N tokens
    suite = _suite(prompts, N)
    ev = Evaluator(target, tmp_path / "cache")
    opts = {"eos_token_id": eos, "tree_budget": 4, "measure_speed": False, "validate": True}
    ours = ev.evaluate(ckpt, suite, options=opts)
    pub = ev.evaluate(ckpt, suite, options={**opts, "counting": "published"})
    assert pub.validation["ok"], pub.validation["mismatched_prompts"]
    assert ours.validation["ok"], ours.validation["mismatched_prompts"]
    assert pub.validation["steps_checked"] == pub.tau["num_steps"]
    assert (ours.settings["counting"], pub.settings["counting"]) == ("response", "published")
    assert ours.prompts[0].accept_lengths == first.accept_lengths[:2]
    assert pub.prompts[0].accept_lengths[:2] == first.accept_lengths[:2] and len(pub.prompts[0].accept_lengths) == 3
    assert ours.prompts[1].accept_lengths == [] and len(pub.prompts[1].accept_lengths) == 1
    assert "EMPTY_REFERENCE" in ours.diagnostic_codes() and "EMPTY_REFERENCE" not in pub.diagnostic_codes()
    assert ours.prompts[1].tree_tau is None and pub.prompts[1].tree_tau is not None  # tree walk: same rule
    with pytest.raises(ValueError, match="counting"):
        ev.evaluate(ckpt, suite, options={"counting": "mine"})


@pytest.mark.parametrize("counting", ["deepspec", "vllm", "sglang"])
def test_counting_deepspec_engine_replay_equals_the_loop(fitted, tmp_path, counting):
    """The other projects' rules: the replay equals `speculative_generate(counting=...)` step by step
    (validated by the engine), on prompts ending by length and at an eos first token."""
    target, drafter, ckpt, prompts = fitted
    eos = speculative_generate(target, drafter, prompts[1], 1).tokens[0]
    suite = _suite(prompts, 12)
    opts = {"eos_token_id": eos, "tree_budget": 0, "measure_speed": False, "validate": True, "counting": counting}
    res = Evaluator(target, tmp_path / "cache").evaluate(ckpt, suite, options=opts)
    assert res.validation["ok"], res.validation["mismatched_prompts"]
    assert res.validation["steps_checked"] == res.tau["num_steps"] > 0
    assert res.settings["counting"] == counting
    loop = [speculative_generate(target, drafter, p, 12, eos_token_id=eos, counting=counting).accept_lengths
            for p in prompts]
    assert [p.accept_lengths for p in res.prompts] == loop
