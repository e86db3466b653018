"""τ under sampling: the engine's sampled references, replay, result, options, W&B keys and report.

The claim checked here is the one for greedy τ, carried over: with keyed draws the replay
along a sampled reference is the real loop's acceptance, step by step, for every prompt and
sample; and at temperature -> 0 the sampled path is the greedy one, to the last number.
"""
import numpy as np
import pytest
import torch

from dflash_train.checkpoints.checkpoint import save_drafter
from dflash_train.core.sampling import Sampler, SamplingParams
from dflash_train.core.speculative import speculative_generate
from eval_worker.engine import metrics
from eval_worker.engine.acceptance import Evaluator
from eval_worker.engine.options import EvalOptions, OptionsError
from eval_worker.engine.references import sample_continuation
from eval_worker.engine.suite import Prompt, Suite
from eval_worker.results.sinks.names import scalars
from tests.support.engine_helpers import fit_drafter
from tests.unit.engine.test_replay import _suite, fitted  # noqa: F401  (module fixture: random target + fitted drafter)

FAST = {"tree_budget": 0, "measure_speed": False, "leak_probe_anchors": 0}


def test_sampling_at_temperature_near_zero_reproduces_greedy_tau_exactly(fitted, tmp_path):  # noqa: F811
    target, drafter, ckpt, prompts = fitted
    res = Evaluator(target, tmp_path / "cache").evaluate(ckpt, _suite(prompts, 40), options={
        **FAST, "temperatures": [1e-6, 0.8], "num_samples": 2, "draft_verify_cost_ratio": 0.25})
    near = res.sampling["by_temperature"]["1e-06"]
    assert near["tau"]["macro"] == res.tau["macro"] and near["tau"]["pooled"] == res.tau["pooled"]
    assert near["tau"]["num_steps"] == 2 * res.tau["num_steps"]  # each sample is the greedy reference
    assert near["acceptance_histogram"] == [2 * c for c in res.acceptance_histogram]
    assert near["per_position"]["conditional_accept"] == res.per_position["conditional_accept"]
    assert [p["sample_taus"] for p in near["prompts"]] == [[p.tau, p.tau] for p in res.prompts]
    # not vacuous: at 0.8 the samples differ from greedy and from each other
    hot = res.sampling["by_temperature"]["0.8"]
    assert hot["tau"]["macro"] != res.tau["macro"]
    assert near["speedup_estimated"] == res.speedup["estimated"]  # the same step costs at τ_T
    assert hot["speedup_estimated"] == pytest.approx(hot["tau"]["macro"] / 1.25)
    assert any(len(set(p["sample_taus"])) > 1 for p in hot["prompts"])
    assert res.sampling["coupling"] == "keyed" and res.sampling["temperatures"] == [1e-6, 0.8]


@pytest.fixture(scope="module")
def tiny_sampled(tmp_path_factory):
    """The bundled tiny target, 3 code prefixes, K = 2 samples at temperature 0.7, and a drafter
    fitted to those very samples (a greedy-fitted drafter is almost never accepted under sampling)."""
    from dflash_train.core.target import Target
    from tests.conftest import TINY_TARGET
    from tests.unit.engine.test_tiny import CODE_PREFIXES, new_drafter

    tiny = Target.load(TINY_TARGET)
    suite = Suite("code", "1", [Prompt(f"c{i}", prompt=t) for i, t in enumerate(CODE_PREFIXES[:3])],
                  chat_template=False, max_new_tokens=24)
    prompts = suite.encode(tiny.tokenizer)
    eos = tiny.tokenizer.eos_token_id
    params = SamplingParams(0.7)
    seqs = [p.ids + sample_continuation(tiny, p.ids, Sampler.for_prompt(params, 3, p.ids, k), 24, None, 0)
            for p in prompts for k in range(2)]
    # 60 steps: the target's samples vary (it no longer repeats "#\n"), so 20 left drafts unaccepted
    drafter = fit_drafter(tiny, new_drafter(tiny, block_size=8), seqs, [len(p.ids) for p in prompts for _ in range(2)],
                          steps=60)
    ckpt = tmp_path_factory.mktemp("tiny_sampled")
    save_drafter(drafter, ckpt)
    return tiny, drafter, ckpt, suite, prompts, eos


@pytest.mark.slow  # ~10-25 s: CI's slow pass (the default suite stays under 10 min on 2 cores)
def test_sampling_replay_equals_real_loop_on_the_tiny_target_at_temperature_0_7(tiny_sampled, tmp_path):
    """Every prompt, every sample: the replayed accept lengths are the real loop's (run here with
    the same keyed sampler), and the loop's output is the sampled reference."""
    tiny, drafter, ckpt, suite, prompts, eos = tiny_sampled
    res = Evaluator(tiny, tmp_path / "cache", progress=False).evaluate(ckpt, suite, options={
        **FAST, "max_new_tokens": 24, "temperatures": [0.7], "num_samples": 2, "seed": 3})
    entry = res.sampling["by_temperature"]["0.7"]
    seen = set()
    for p, pr in zip(prompts, entry["prompts"], strict=False):
        assert pr["name"] == p.name and len(pr["sample_taus"]) == 2
        for k in range(2):
            real = speculative_generate(tiny, drafter, p.ids, 24, eos_token_id=eos,
                                        sampler=Sampler.for_prompt(SamplingParams(0.7), 3, p.ids, k))
            assert pr["sample_taus"][k] == pytest.approx(real.tau), (p.name, k)
            seen |= set(real.accept_lengths)
    steps = sum(entry["acceptance_histogram"])
    assert steps == entry["tau"]["num_steps"]
    assert max(seen) > 2 and entry["tau"]["macro"] > 1.1  # not vacuous: drafts do get accepted


@pytest.mark.slow  # ~10-25 s: CI's slow pass (the default suite stays under 10 min on 2 cores)
def test_sampling_validation_cache_and_seed(fitted, tmp_path):  # noqa: F811
    """`validate` runs the real loop per (prompt, sample) and agrees; a second evaluation reads every
    sampled reference and feature from the cache; another seed draws other samples."""
    target, drafter, ckpt, prompts = fitted
    ev = Evaluator(target, tmp_path / "cache", progress=False)
    opts = {**FAST, "temperatures": [0.7], "num_samples": 3, "validate": True, "top_p": 0.95, "top_k": 40}
    first = ev.evaluate(ckpt, _suite(prompts, 40), options=opts)
    val = first.sampling["by_temperature"]["0.7"]["validation"]
    assert val["ok"] and val["prompts_checked"] == 3 * len(prompts) and val["reference_differs_from_loop"] == []
    assert val["steps_checked"] == first.sampling["by_temperature"]["0.7"]["tau"]["num_steps"]
    again = Evaluator(target, tmp_path / "cache", progress=False).evaluate(ckpt, _suite(prompts, 40), options=opts)
    assert again.cache["references"] == "hit" and again.cache["features"] == "hit"
    assert again.sampling["by_temperature"] == first.sampling["by_temperature"]
    other = ev.evaluate(ckpt, _suite(prompts, 40), options={**opts, "seed": 1, "validate": False})
    # greedy τ does not depend on the seed (its bootstrap interval does: the seed keys that too)...
    assert [p.accept_lengths for p in other.prompts] == [p.accept_lengths for p in first.prompts]
    assert [p["sample_taus"] for p in other.sampling["by_temperature"]["0.7"]["prompts"]] != \
        [p["sample_taus"] for p in first.sampling["by_temperature"]["0.7"]["prompts"]]  # ...the samples do
    # W&B keys under the temperature, next to greedy τ
    keys = scalars(first.to_dict())
    assert keys["eval/t0.7/tau"] == first.sampling["by_temperature"]["0.7"]["tau"]["macro"]
    assert keys["eval/tau"] == first.tau["macro"]
    assert {"eval/t0.7/tau_ci_low", "eval/t0.7/tau_ci_high", "eval/t0.7/pos_accept/1"} <= set(keys)


def test_sampling_options_schema():
    ok = EvalOptions.from_dict({"temperatures": [0.6, 1], "top_p": 0.9, "top_k": 20, "num_samples": 4})
    assert ok.temperatures == [0.6, 1.0] and ok.identity()["temperatures"] == [0.6, 1.0]
    assert "temperatures" not in EvalOptions.from_dict({}).identity()  # greedy jobs keep their ids
    for bad, says in [({"temperatures": [0]}, "greater than 0"), ({"temperatures": [0.5, 0.5]}, "repeat"),
                      ({"top_p": 0.9}, "top_p applies to sampled"), ({"num_samples": 4, "top_k": 3}, "apply"),
                      ({"temperatures": ["0.7"]}, "number"), ({"temperatures": [0.7], "num_samples": 0}, "num_samples"),
                      ({"temperatures": [0.7], "top_p": 1.5}, "top_p")]:
        with pytest.raises(OptionsError, match=says):
            EvalOptions.from_dict(bad)


def test_sampling_nested_bootstrap_interval():
    """Prompts, then samples within each: constant data gives a point; more spread within prompts
    (same prompt means) gives a wider interval; missing samples are skipped, not zeros."""
    assert metrics.nested_bootstrap_ci([[2.0, 2.0], [2.0]]) == (2.0, 2.0)
    assert metrics.nested_bootstrap_ci([[None], []]) is None
    means = [1.5, 2.0, 2.5, 3.0]
    tight = metrics.nested_bootstrap_ci([[m - 0.1, m + 0.1] for m in means], seed=1)
    wide = metrics.nested_bootstrap_ci([[m - 1.0, m + 1.0] for m in means], seed=1)
    assert tight[0] <= np.mean(means) <= tight[1] and wide[1] - wide[0] > tight[1] - tight[0]
    with_gap = metrics.nested_bootstrap_ci([[1.0, None, 1.0], [3.0]], seed=0)
    assert 1.0 <= with_gap[0] <= with_gap[1] <= 3.0


def test_sampling_flags_in_run_help(capsys):
    from eval_worker.cli import main

    with pytest.raises(SystemExit):
        main(["run", "--help"])
    out = capsys.readouterr().out
    for flag in ("--temperature", "--top-p", "--top-k", "--num-samples", "--seed"):
        assert flag in out


def test_sampling_from_a_server_says_the_coupling_is_not_guaranteed(tmp_path):
    """A server samples with its own generator: the request carries the sampling settings and a
    seed per (seed, prompt, sample); the result measures τ on its samples and says they are not the
    keyed draws (no step-by-step validation is claimed for them)."""
    from eval_worker.engine.references import ServerReferences
    from tests.support.engine_helpers import CannedServer
    from tests.support.factories import drafter_for, qwen3_target

    target = qwen3_target(seed=6)

    def respond(body):
        if body["temperature"] == 0:
            return 200, {"choices": [{"token_ids": speculative_generate(target, drafter, body["prompt"],
                                                                        body["max_tokens"]).tokens}]}
        g = torch.Generator().manual_seed(body["seed"])  # the server's own generator
        return 200, {"choices": [{"token_ids": torch.randint(0, 90, (body["max_tokens"],), generator=g).tolist()}]}

    drafter = drafter_for(target, block_size=4)
    save_drafter(drafter, tmp_path / "ck")
    suite = Suite("srv", "1", [Prompt("a", ids=(4, 8, 15, 16)), Prompt("b", ids=(9, 9, 2, 31))],
                  chat_template=False, max_new_tokens=12)
    with CannedServer(respond) as srv:
        ev = Evaluator(target, tmp_path / "cache", reference_source=ServerReferences(srv.url), progress=False)
        res = ev.evaluate(tmp_path / "ck", suite, options={**FAST, "validate": True, "temperatures": [0.7],
                                                         "num_samples": 2, "top_p": 0.9, "top_k": 5})
    sampled = [b for _, b in srv.requests if b["temperature"] > 0]
    assert len(sampled) == 4 and {(b["top_p"], b["top_k"]) for b in sampled} == {(0.9, 5)}
    assert len({b["seed"] for b in sampled}) == 4  # one seed per (prompt, sample)
    assert res.sampling["coupling"] == "none" and "not on the keyed draws" in res.sampling["coupling_note"]
    entry = res.sampling["by_temperature"]["0.7"]
    assert entry["validation"] is None and entry["tau"]["num_pairs"] == 4
    assert res.validation["ok"]  # the greedy part is checked as before


def test_sampling_validation_catches_references_that_are_not_the_keyed_draws(fitted, tmp_path):  # noqa: F811
    """Validation under sampling is a real check: sampled references swapped between samples 0 and 1
    of each prompt (planted in the cache under valid keys) are samples of the target, but not the
    draws the real loop makes with those keys: the loop disagrees and the result says so."""
    import json

    target, drafter, ckpt, prompts = fitted
    suite = _suite(prompts[:2], 30)
    opts = {**FAST, "validate": True, "temperatures": [0.7], "num_samples": 2}
    good = Evaluator(target, tmp_path / "cache", progress=False).evaluate(ckpt, suite, options=opts)
    assert good.sampling["by_temperature"]["0.7"]["validation"]["ok"] and not good.errors()
    files = {}
    for f in (tmp_path / "cache" / "references").glob("*.json"):
        data = json.loads(f.read_text())
        if data["value"].get("sample") is not None:
            files[(data["value"]["name"], data["value"]["sample"])] = (f, data)
    assert len(files) == 4
    for name in ("p0", "p1"):
        (f0, d0), (f1, d1) = files[(name, 0)], files[(name, 1)]
        for k in ("tokens", "lookahead", "finish"):
            d0["value"][k], d1["value"][k] = d1["value"][k], d0["value"][k]
        f0.write_text(json.dumps(d0))
        f1.write_text(json.dumps(d1))
    bad = Evaluator(target, tmp_path / "cache", progress=False).evaluate(ckpt, suite, options=opts)
    assert bad.cache["references"] == "hit"  # the keys matched: only validation can notice
    val = bad.sampling["by_temperature"]["0.7"]["validation"]
    assert not val["ok"] and set(val["reference_differs_from_loop"]) == {"p0#0", "p0#1", "p1#0", "p1#1"}
    assert any(d.code == "VALIDATION_MISMATCH" and "temperature 0.7" in d.message for d in bad.errors())


def test_sampling_report_plots_tau_vs_step_per_temperature(tmp_path):
    """Results with a `sampling` block get the τ-per-temperature figure (greedy plus each temperature);
    a run without one does not."""
    import re

    from eval_worker.results.report import build_report
    from tests.support.eval_results import make_result, write_ledger

    for step, p in ((100, 0.4), (200, 0.6)):
        res = make_result("run-s", step, p=p)
        t = res["tau"]["macro"]
        res["sampling"] = {"temperatures": [0.6, 1.0], "top_p": 1.0, "top_k": 0, "num_samples": 2, "seed": 0,
                           "coupling": "keyed", "by_temperature": {
                               k: {"temperature": float(k), "tau": {"macro": t - d, "pooled": t - d,
                                                                   "ci95": [t - d - 0.2, t - d + 0.2], "num_steps": 9}}
                               for k, d in (("0.6", 0.5), ("1", 1.0))}}
        write_ledger(tmp_path / "results", res)
    html = build_report("run-s", results_dir=tmp_path / "results", out_dir=tmp_path / "out").read_text()
    assert "τ under sampling" in html and (tmp_path / "out" / "tau_by_temperature.png").stat().st_size > 5000
    write_ledger(tmp_path / "plain", make_result("run-g", 100))
    plain = build_report("run-g", results_dir=tmp_path / "plain", out_dir=tmp_path / "out2").read_text()
    assert "τ under sampling" not in plain and not (tmp_path / "out2" / "tau_by_temperature.png").exists()
    figures = lambda page: len(re.findall(r'src="data:image/png;base64,', page))  # noqa: E731
    assert figures(html) == figures(plain) + 1
