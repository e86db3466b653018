"""Metric arithmetic: the walk mirrors the real loop's control flow; intervals, histograms, deltas."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eval_worker.engine import metrics
from eval_worker.engine.drafting import AnchorDrafts
from eval_worker.engine.scoring import score_prompt


def loop_like(ext, drafts, num_tokens, max_new, eos):
    """The control flow of `speculative_generate` on plain lists (drafts[s] = block drafted at s)."""
    seq, accepts = [ext[0]], []
    while len(seq) < max_new and seq[-1] != eos:
        s = len(seq) - 1
        posterior = ext[s + 1:s + len(drafts[s]) + 1]
        n = 0
        while n < len(drafts[s]) and n < len(posterior) and drafts[s][n] == posterior[n]:
            n += 1
        new = list(drafts[s][:n]) + [ext[s + n + 1]]
        if eos is not None and eos in new:
            new = new[:new.index(eos) + 1]
        seq += new
        accepts.append(n + 1)
    return accepts, seq[:max_new]


@st.composite
def reference_case(draw):
    B = draw(st.integers(2, 6))
    alphabet = draw(st.integers(2, 4))  # few symbols: drafts often match
    max_new = draw(st.integers(1, 30))
    eos = draw(st.sampled_from([None, 0]))
    raw = draw(st.lists(st.integers(0, alphabet - 1), min_size=max_new + B, max_size=max_new + B))
    tokens = raw[:max_new]
    if eos is not None and eos in tokens:
        tokens = tokens[:tokens.index(eos) + 1]
    ext = tokens + raw[len(tokens):len(tokens) + B - 1]
    drafts = draw(st.lists(st.lists(st.integers(0, alphabet - 1), min_size=B - 1, max_size=B - 1),
                           min_size=len(tokens), max_size=len(tokens)))
    return B, max_new, eos, tokens, ext, drafts


@settings(max_examples=300, deadline=None)
@given(reference_case())
def test_walk_reproduces_the_loop_control_flow(case):
    B, max_new, eos, tokens, ext, drafts = case
    expected, committed = loop_like(ext, drafts, len(tokens), max_new, eos)
    assert committed == tokens  # the reference is what the loop commits
    sc = score_prompt("x", ext, len(tokens),
                      AnchorDrafts(np.arange(len(tokens)), np.array(drafts).reshape(len(tokens), B - 1)), B)
    assert sc.online.accept_lengths == expected
    # spans tile the response after the prefill token
    starts, ends = [a for a, _ in sc.online.spans], [b for _, b in sc.online.spans]
    assert starts == ([1] + ends[:-1] if ends else [])
    assert ends[-1:] == ([len(tokens)] if len(tokens) > 1 else [])


def dflash_generate_like(ext, drafts, max_new, eos):
    """z-lab `dflash_generate`'s control flow on plain lists: an output buffer, `while start <
    max_length`, the stop-token check after each step, then cut to min(start+1, max_length)
    and to the first stop token. posterior[i] = ext[start+i+1] holds along the accepted prefix."""
    B = len(drafts[0]) + 1
    out = [None] * (max_new + B + 1)
    out[0], start, accepts = ext[0], 0, []
    while start < max_new:
        block = [out[start]] + list(drafts[start])
        posterior = [ext[i] if i < len(ext) else None for i in range(start + 1, start + B + 1)]
        a = 0
        while a < B - 1 and block[a + 1] == posterior[a]:
            a += 1
        out[start:start + a + 1] = block[:a + 1]
        out[start + a + 1] = posterior[a]
        start += a + 1
        accepts.append(a + 1)
        if eos is not None and eos in out[:start + 1]:
            break
    gen = out[:min(start + 1, max_new)]
    if eos is not None and eos in gen:
        gen = gen[:gen.index(eos) + 1]
    return accepts, gen


@settings(max_examples=300, deadline=None)
@given(reference_case(), st.booleans())
def test_counting_published_walk_reproduces_dflash_generate(case, eos_first):
    B, max_new, eos, tokens, ext, drafts = case
    if eos_first and eos is not None:  # the first generated token is the stop token
        tokens, ext, drafts = [eos], [eos] + ext[1:B], drafts[:1]
    expected, committed = dflash_generate_like(ext, drafts, max_new, eos)
    assert committed == tokens  # same tokens as the response rule; only the steps counted differ
    arr = np.array(drafts).reshape(len(tokens), B - 1)
    sc = score_prompt("x", ext, len(tokens), AnchorDrafts(np.arange(len(tokens)), arr), B, counting="published",
                      ends_with_stop=eos is not None and tokens[-1] == eos)
    assert sc.online.accept_lengths == expected
    ours = score_prompt("x", ext, len(tokens), AnchorDrafts(np.arange(len(tokens)), arr), B).online.accept_lengths
    # the published loop adds at most one step: past an eos first token, or when the steps sum to N - 1
    extra = expected[len(ours):]
    assert expected[:len(ours)] == ours and len(extra) <= 1
    ends_by_length = len(tokens) == max_new and tokens[-1] != eos
    assert bool(extra) == (tokens == [eos] or (ends_by_length and sum(ours) == max_new - 1))
    assert all(b - a >= 0 for a, b in sc.online.spans) and sc.online.spans[len(ours):] in ([], [(len(tokens),) * 2])


def test_counting_rules_on_a_worked_example():
    """N = 6: steps 2 + 3 commit 1 + 5 = 6 tokens; the published loop drafts once more."""
    streaks = {0: 1, 2: 2, 5: 3}
    walk = lambda counting, **kw: metrics.online_walk(streaks.get, 6, counting=counting, **kw).accept_lengths  # noqa: E731
    assert walk("response") == [2, 3]
    assert walk("published") == [2, 3, 4]
    assert walk("published", ends_with_stop=True) == [2, 3]  # the 6th token was eos: stop checked first
    assert metrics.online_walk(lambda s: 0, 1).accept_lengths == []  # eos first: no step to count ...
    assert metrics.online_walk(lambda s: 0, 1, counting="published", ends_with_stop=True).accept_lengths == [1]
    with pytest.raises(ValueError, match="counting"):
        metrics.online_walk(lambda s: 0, 4, counting="mine")


def test_leading_true_and_matches():
    m = metrics.matches(np.array([[5, 6, 9], [8, 9, 9]]), [4, 5, 6, 7, 8], [0, 3])
    assert m.tolist() == [[True, True, False], [True, False, False]]  # past the end counts as a miss
    assert metrics.leading_true(m).tolist() == [2, 1]


def test_histogram_conditional_and_stride():
    acc = [1, 3, 4, 4, 2, 1]
    assert metrics.histogram(acc, 4) == [2, 1, 1, 2]
    cond = metrics.conditional_accept(acc, 4)
    # P(length >= k+1) is the product of the conditional rates up to slot k
    for k in range(1, 4):
        assert np.prod(cond[:k]) == pytest.approx(np.mean(np.array(acc) >= k + 1))
    with pytest.raises(ValueError):
        metrics.histogram([5], 4)
    streaks = np.array([0, 1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert metrics.stride_blocks(streaks, 10, 4) == [1, 5, 9]
    assert metrics.stride_blocks(streaks, 10, 4, max_blocks=2) == [1, 5]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.floats(1.0, 16.0), min_size=1, max_size=40), st.integers(0, 1000))
def test_bootstrap_interval_contains_the_mean(values, seed):
    lo, hi = metrics.bootstrap_ci(values, n_resamples=500, seed=seed)
    mean = float(np.mean(values))
    assert lo <= mean + 1e-9 and mean - 1e-9 <= hi
    assert min(values) - 1e-9 <= lo <= hi <= max(values) + 1e-9


def test_bootstrap_interval_shrinks_with_more_prompts():
    rng = np.random.default_rng(0)
    small = metrics.bootstrap_ci(rng.uniform(1, 5, 8), seed=1)
    large = metrics.bootstrap_ci(rng.uniform(1, 5, 800), seed=1)
    assert large[1] - large[0] < (small[1] - small[0]) / 4


def test_paired_delta():
    a, b = [3.0, 4.0, None, 5.0], [2.0, 3.5, 1.0, 4.0]
    d = metrics.paired_delta(a, b, seed=0)
    assert d["num_pairs"] == 3 and d["delta"] == pytest.approx((1 + 0.5 + 1) / 3)
    assert d["ci95"][0] <= d["delta"] <= d["ci95"][1]
    same = metrics.paired_delta(a, a)
    assert same["delta"] == 0 and same["ci95"] == [0.0, 0.0]


def test_macro_vs_pooled_and_speedup():
    macro, pooled, n = metrics.macro_pooled([[1, 1], [4], []])
    assert (macro, pooled, n) == (2.5, 2.0, 3)  # the two averages differ: both are reported
    assert metrics.estimated_speedup(3.0, draft_s=0.1, verify_s=0.2, ar_s=0.15) == pytest.approx(1.5)
    assert metrics.estimated_speedup(3.0, cost_ratio=0.5) == pytest.approx(2.0)
    assert metrics.estimated_speedup(None, cost_ratio=0.5) is None
