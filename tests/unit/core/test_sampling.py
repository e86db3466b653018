"""Keyed sampling (dflash_train/core/sampling.py) and the real draft-verify loop at temperature > 0.

The loop's losslessness is checked against the target's own distribution computed exactly
(enumerated from its logits), not against our sampler: a chi-square goodness-of-fit test on
the first token and on the first three tokens, fixed seed, failing at p < 1e-3.
"""
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy import stats

from dflash_train.core.sampling import Sampler, SamplingParams, filtered_probs, prompt_key, sample_tokens, uniform
from dflash_train.core.speculative import greedy_generate, speculative_generate
from eval_worker.engine.references import sample_continuation, sample_continuations
from tests.support.engine_helpers import fit_on_target_predictions
from tests.support.factories import drafter_for, qwen3_5_vlm_target, qwen3_target

P_FAIL = 1e-3  # chi-square p-value below which the loop's samples are not the target's distribution
DRAWS = 1000  # loop runs (about 10 ms each on one CPU thread)


def test_sampling_keyed_draws_are_uniform_and_depend_on_every_key_part():
    u = np.array([uniform(7, "p", 0, t) for t in range(20000)])
    assert stats.kstest(u, "uniform").pvalue > P_FAIL and (0 <= u).all() and (u < 1).all()
    base = uniform(7, "p", 0, 5)
    assert len({base, uniform(8, "p", 0, 5), uniform(7, "q", 0, 5), uniform(7, "p", 1, 5), uniform(7, "p", 0, 6)}) == 5
    assert uniform(7, "p", 0, 5) == base  # no state: the same key draws the same u, anywhere
    assert prompt_key([1, 2, 3]) != prompt_key([1, 2, 4]) and prompt_key([1, 2]) != prompt_key([2, 1])


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31), st.floats(0.05, 3.0), st.integers(0, 40), st.floats(0.05, 1.0))
def test_sampling_filter_keeps_exactly_top_k_then_the_smallest_top_p_set(seed, temperature, top_k, top_p):
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(seed)) * 3
    params = SamplingParams(temperature, top_p, top_k)
    probs = filtered_probs(logits, params)
    torch.testing.assert_close(probs.sum(-1), torch.ones(3, dtype=torch.float64))
    for row, p in zip(logits, probs, strict=True):
        kept = (p > 0).nonzero()[:, 0]
        order = row.argsort(descending=True)
        # the kept tokens are the most likely ones, in order
        assert set(kept.tolist()) == set(order[: len(kept)].tolist())
        if top_k:
            assert len(kept) <= top_k
        # top-p: the kept set reaches top_p of the top-k mass, and one token fewer would not
        full = torch.softmax(row.double() / temperature, -1)
        if top_k:
            full = torch.where(torch.isin(torch.arange(40), order[:top_k]), full, 0.0)
            full = full / full.sum()
        mass = full[order].cumsum(0)
        n = len(kept)
        assert n == (top_k or 40) or mass[n - 1] >= top_p - 1e-12
        assert n == 1 or top_p == 1.0 or mass[n - 2] < top_p
        # a sampled token always has mass, whatever u
        tok = sample_tokens(row[None], params, [uniform(seed, "x", 0, 0)])
        assert p[tok] > 0


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 2**31), st.integers(1, 12))
def test_sampling_a_block_draws_as_position_by_position(seed, n):
    """The coupling: the verify pass samples a block of rows at once, the reference generator one
    row at a time; row i at position t0 + i draws the same token either way."""
    logits = torch.randn(n, 50, generator=torch.Generator().manual_seed(seed)) * 2
    s = Sampler.for_prompt(SamplingParams(0.7, 0.9, 20), seed, [1, 2, 3], sample=seed % 5)
    block = s.tokens(logits, 100)
    assert block.tolist() == [int(s.tokens(logits[i:i + 1], 100 + i)[0]) for i in range(n)]


def test_sampling_temperature_near_zero_is_argmax():
    logits = torch.randn(64, 300, generator=torch.Generator().manual_seed(0))
    draws = [uniform(0, "z", 0, t) for t in range(64)]
    assert torch.equal(sample_tokens(logits, SamplingParams(1e-6), draws), logits.argmax(-1))
    assert torch.equal(sample_tokens(logits, SamplingParams(0.0), draws), logits.argmax(-1))


def test_sampling_loop_at_temperature_zero_is_the_greedy_loop():
    target = qwen3_target()
    drafter = drafter_for(target)
    prompt = [3, 14, 15, 9, 26, 5]
    sampler = Sampler.for_prompt(SamplingParams(0.0), 0, prompt)
    res = speculative_generate(target, drafter, prompt, 40, sampler=sampler)
    assert res.tokens == greedy_generate(target, prompt, 40)
    assert res.accept_lengths == speculative_generate(target, drafter, prompt, 40).accept_lengths


@pytest.fixture(scope="module")
def peaked():
    """A random target sharpened to a peaked next-token distribution (top token ~50%), and a
    drafter fitted to its samples: verify steps accept 0..B-1 drafts, so the loop's accept and
    bonus paths both carry the sampled tokens."""
    torch.manual_seed(0)
    target = qwen3_target()
    with torch.no_grad():
        target.parts.lm_head.weight.mul_(40.0)
    prompt = [3, 14, 15]
    rows = torch.tensor([prompt + sample_continuation(target, prompt,
                                                      Sampler.for_prompt(SamplingParams(1.0), 1, prompt, k),
                                                      13, None, 0) for k in range(64)])
    drafter, _ = fit_on_target_predictions(target, drafter_for(target, block_size=4), rows, steps=150)
    return target, drafter, prompt


def _exact_prefix_probs(target, prompt, params, depth, min_prob):
    """P(first `depth` tokens = s) under the target's own filtered distribution, for every s whose
    probability is at least min_prob (the rest is pooled by the caller)."""
    out, frontier = {}, [((), 1.0)]
    for _ in range(depth):
        nxt = []
        for prefix, p in frontier:
            last = target.forward(torch.tensor([prompt + list(prefix)]), []).last_hidden[0, -1:]
            probs = filtered_probs(target.logits(last), params)[0]
            for tok in (probs * p >= min_prob).nonzero()[:, 0].tolist():
                nxt.append((prefix + (tok,), p * float(probs[tok])))
        frontier = nxt
    for prefix, p in frontier:
        out[prefix] = p
    return out


def _chi_square(counts: dict, exact: dict, n: int) -> float:
    keys = list(exact)
    observed = [counts.get(k, 0) for k in keys]
    expected = [exact[k] * n for k in keys]
    observed.append(n - sum(observed))  # everything else, pooled
    expected.append(n - sum(expected))
    return stats.chisquare(observed, expected).pvalue


@pytest.mark.slow  # ~10-25 s: CI's slow pass (the default suite stays under 10 min on 2 cores)
def test_sampling_loop_is_lossless_at_temperature_one(peaked):
    """The real loop's first token and first three tokens follow the target's own distribution at
    temperature 1 (chi-square, categories with expected count >= 5, the rest pooled), while the
    drafts it verifies are accepted 0..B-1 at a time. The same counts against temperature 0.8
    fail: the test tells neighbouring distributions apart at this many draws."""
    target, drafter, prompt = peaked
    params = SamplingParams(1.0)
    firsts, triples, accepts = {}, {}, []
    for k in range(DRAWS):
        res = speculative_generate(target, drafter, prompt, 3, sampler=Sampler.for_prompt(params, 2024, prompt, k))
        assert len(res.tokens) == 3
        firsts[res.tokens[0]] = firsts.get(res.tokens[0], 0) + 1
        triples[tuple(res.tokens)] = triples.get(tuple(res.tokens), 0) + 1
        accepts += res.accept_lengths
    assert {1, 2, 3, 4} <= set(accepts)  # rejections, partial and full acceptances all happen
    min_prob = 5 / DRAWS
    exact1 = {k[0]: v for k, v in _exact_prefix_probs(target, prompt, params, 1, min_prob).items()}
    exact3 = _exact_prefix_probs(target, prompt, params, 3, min_prob)
    assert len(exact1) >= 3 and len(exact3) >= 10
    assert _chi_square(firsts, exact1, DRAWS) > P_FAIL
    assert _chi_square(triples, exact3, DRAWS) > P_FAIL
    colder = _exact_prefix_probs(target, prompt, SamplingParams(0.8), 3, min_prob)
    assert _chi_square(triples, colder, DRAWS) < P_FAIL


@pytest.mark.parametrize("params", [SamplingParams(0.7), SamplingParams(1.0, top_p=0.8, top_k=5)],
                         ids=["temperature_0.7", "temperature_1_top_p_top_k"])
def test_sampling_loop_emits_the_keyed_reference_sample(peaked, params):
    """With the same keyed draws, the real loop commits exactly the reference generator's sample
    (the coupling the engine's replay relies on), for every sample index, eos inside included."""
    target, drafter, prompt = peaked
    for k in range(12):
        sampler = Sampler.for_prompt(params, 5, prompt, k)
        ref = sample_continuation(target, prompt, sampler, 20, None, 0)
        eos = ref[7]
        res = speculative_generate(target, drafter, prompt, 20, sampler=sampler)
        assert res.tokens == ref, k
        with_eos = speculative_generate(target, drafter, prompt, 20, eos_token_id=eos, sampler=sampler)
        assert with_eos.tokens == ref[: ref.index(eos) + 1]


@pytest.mark.parametrize("make", [qwen3_target, qwen3_5_vlm_target], ids=["qwen3", "hybrid_qwen3_5"])
def test_sampling_a_prompts_samples_decoded_as_one_batch_equal_one_by_one(make):
    """The engine decodes a prompt's K samples as rows of one batch; each row is the sample that
    one sampler alone draws (eos at different places included: each row keeps its own end)."""
    target = make()
    prompt = [5, 17, 33, 2, 8]
    samplers = [Sampler.for_prompt(SamplingParams(1.3, top_k=30), 9, prompt, k) for k in range(5)]
    alone = [sample_continuation(target, prompt, s, 16, None, 3) for s in samplers]
    assert len({tuple(a) for a in alone}) == 5 and all(len(a) == 19 for a in alone)
    assert sample_continuations(target, prompt, samplers, 16, None, 3) == alone
    eos = alone[2][4]  # a token some rows draw early, others late or never
    with_eos = [sample_continuation(target, prompt, s, 16, eos, 3) for s in samplers]
    assert sample_continuations(target, prompt, samplers, 16, eos, 3) == with_eos
    assert len({len(r) for r in with_eos}) > 1
