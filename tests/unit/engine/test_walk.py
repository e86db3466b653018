"""Walk-driven drafting with the early-exit LM head == the all-anchor pass, number for number.

The property: on random drafters, references and settings, every walk-derived number (greedy
and tree walks, per-step accept lengths and spans, the full walk the validation replays, the
stride blocks, the tree-below-chain count, per-slot sample statistics and the summary built
from them) is the same whether the blocks come from `draft_anchors` at every anchor or from
`walk.Walker`, which drafts only what the walks visit and stops each block's head at its
first miss.

The references are built against the drafter so that every acceptance length can be forced:
at each step of the walk the block is drafted (the spec loop's own one-block path) and the
reference continues with the first `a` drafts, then a token the drafter did not propose. `a`
always B-1 gives τ = B (an accept-everything pair), always 0 gives τ = 1, random gives the rest
("mostly": a in B/2..B-1, a greedy walk well ahead of a flat drafter's plain tree; "low": a 1 in
about a third of the steps, τ ≈ 1.35, where the walk drafts a few blocks ahead and skips some).
"""
import json

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dflash_train.checkpoints.checkpoint import save_drafter
from eval_worker.engine.acceptance import Evaluator
from eval_worker.engine.drafting import anchors_per_pass, draft_anchors
from eval_worker.engine.scoring import sample_offsets, score_blocks, score_prompt, summarize
from eval_worker.engine.walk import Walker, WalkSeq, context_kv
from tests.support import engine_helpers
from tests.support.engine_helpers import fit_drafter, references
from tests.support.factories import VOCAB, drafter_for, qwen3_target

TARGET = qwen3_target(seed=5)
EMBED, HEAD = TARGET.parts.embed_tokens, TARGET.parts.lm_head
POLICIES = ("accept_all", "accept_none", "random", "low")


def forced_reference(drafter, feats, prompt, n, policy, rng):
    """A response of n tokens (+ B-1 lookahead) whose online walk accepts what `policy` says."""
    return engine_helpers.forced_reference(drafter, EMBED, HEAD, VOCAB, feats, prompt, n, policy, rng)


def both_paths(drafter, feats, prompt, ext, n, *, tree_budget, spine, max_blocks, counting, stop, sample, full_walk):
    B = drafter.config.block_size
    P = len(prompt)
    ids = torch.tensor(prompt + ext[:n])
    topk = tree_budget if tree_budget else 0
    drafts = draft_anchors(drafter, EMBED, HEAD, ids, feats, np.arange(P, P + n), topk=topk, topk_slots=tree_budget,
                           backend="sdpa")
    kw = dict(max_blocks=max_blocks, counting=counting, ends_with_stop=stop)
    old = score_prompt("p", ext, n, drafts, B, tree_budget=tree_budget, tree_spine=spine, sample=sample, **kw)
    walker = Walker(drafter, EMBED, HEAD, topk=topk, tree_budget=tree_budget, tree_spine=spine)
    seq = WalkSeq(ids, P, n, np.asarray(ext), full=sample, max_blocks=max_blocks,
                  greedy_steps=None if full_walk else max_blocks)
    got = walker.run([seq], [context_kv(drafter, feats[:max(P + n - 1, 1)])])[0]
    streaks = np.full(n, -1)
    streaks[list(got.streak)] = list(got.streak.values())
    arg = np.stack([got.argmax[o] for o in sample.tolist()]) if sample.size else np.zeros((0, B - 1), dtype=np.int64)
    new = score_blocks("p", ext, n, B, streaks, got.tree_streaks.__getitem__ if topk else None, sample, arg, **kw)
    return old, new, got


def assert_same(old, new, full_walk):
    for walk in ("online", "tree_online"):
        a, b = getattr(old, walk), getattr(new, walk)
        assert (a is None) == (b is None)
        if a is not None:
            assert (a.accept_lengths, a.anchors, a.spans) == (b.accept_lengths, b.anchors, b.spans)
    assert old.stride == new.stride and old.tree_stride == new.tree_stride
    assert old.tree_below_chain == new.tree_below_chain
    np.testing.assert_array_equal(old.match_sum, new.match_sum)
    np.testing.assert_array_equal(old.valid_sum, new.valid_sum)
    np.testing.assert_array_equal(old.sample_streaks, new.sample_streaks)
    visited = new.streaks >= 0  # where the walk path drafted, its streak is the all-anchor streak
    np.testing.assert_array_equal(old.streaks[visited], new.streaks[visited])
    if full_walk:
        assert old.full_walk().accept_lengths == new.full_walk().accept_lengths


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), B=st.integers(2, 9), layers=st.integers(1, 2), n=st.integers(1, 70),
       policy=st.sampled_from(POLICIES), tree_budget=st.sampled_from([0, 1, 3, 8]), spine=st.booleans(),
       max_blocks=st.sampled_from([None, 1, 3]), counting=st.sampled_from(["response", "published"]),
       stop=st.booleans(), quota=st.sampled_from([None, 0, 1, 5]), full_walk=st.booleans())
def test_walk_driven_early_exit_equals_all_anchor_path(seed, B, layers, n, policy, tree_budget, spine, max_blocks,
                                                       counting, stop, quota, full_walk):
    check_paths_equal(seed, B, layers, n, policy, tree_budget, spine, max_blocks, counting, stop, quota, full_walk)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), B=st.integers(2, 9), n=st.integers(1, 70), policy=st.sampled_from(POLICIES),
       tree_budget=st.sampled_from([0, 3, 8]), spine=st.booleans(), quota=st.sampled_from([None, 1]),
       tile=st.sampled_from([None, 1, 7, 100]), streamed=st.booleans())
def test_paths_equal_over_vocabulary_tiles_and_with_a_streamed_head(seed, B, n, policy, tree_budget, spine, quota,
                                                                   tile, streamed):
    """The same property with the LM head over several vocabulary tiles (down to one column each: the argmax,
    top-k and log-sum-exp combined across tiles, the same rule on both paths) and with the walk's calls filled
    as for a head read from memory on every call (`Walker._fill`: deeper slots per call, never other numbers)."""
    from unittest import mock

    from eval_worker.engine import drafting, walk
    with mock.patch.object(drafting, "VOCAB_TILE", tile or drafting.VOCAB_TILE), \
            mock.patch.object(walk, "VOCAB_TILE", tile or walk.VOCAB_TILE), \
            mock.patch.object(walk, "HEAD_STREAM_BYTES", 0 if streamed else walk.HEAD_STREAM_BYTES):
        check_paths_equal(seed, B, 1, n, policy, tree_budget, spine, None, "response", False, quota, True)


def check_paths_equal(seed, B, layers, n, policy, tree_budget, spine, max_blocks, counting, stop, quota, full_walk):
    rng = np.random.default_rng(seed)
    drafter = drafter_for(TARGET, block_size=B, layers=layers, seed=seed)
    prompt = rng.integers(0, VOCAB - 1, int(rng.integers(1, 8))).tolist()
    S = len(prompt) + n + B
    feats = torch.randn(S, drafter.config.num_features * TARGET.hidden_size,
                        generator=torch.Generator().manual_seed(seed))
    ext = forced_reference(drafter, feats, prompt, n, policy, rng)
    sample = sample_offsets(n, quota, seed, "p")
    old, new, got = both_paths(drafter, feats, prompt, ext, n, tree_budget=tree_budget, spine=spine,
                               max_blocks=max_blocks, counting=counting, stop=stop, sample=sample, full_walk=full_walk)
    assert_same(old, new, full_walk)
    if policy == "accept_all" and n > 1:  # the construction reaches the extremes it claims
        assert set(old.full_walk().accept_lengths) == {B}
    if policy == "accept_none" and n > 1:
        assert set(old.full_walk().accept_lengths) == {1}
    summ = [summarize([x], B, "online", tree_budget=tree_budget, tree_spine=spine, max_blocks=max_blocks,
                      n_resamples=50, seed=seed) for x in (old, new)]
    assert json.dumps(summ[0].__dict__, default=str) == json.dumps(summ[1].__dict__, default=str)


def test_early_exit_head_runs_only_to_the_first_miss():
    """τ = 1 and no tree: every block the walk drafts costs one head slot; only the sample pays B-1."""
    B, n = 8, 60
    rng = np.random.default_rng(0)
    drafter = drafter_for(TARGET, block_size=B, seed=2)
    prompt = [3, 4, 5]
    feats = torch.randn(len(prompt) + n + B, drafter.config.num_features * TARGET.hidden_size,
                        generator=torch.Generator().manual_seed(1))
    ext = forced_reference(drafter, feats, prompt, n, "accept_none", rng)
    sample = np.array([10])
    old, new, got = both_paths(drafter, feats, prompt, ext, n, tree_budget=0, spine=False, max_blocks=None,
                               counting="response", stop=False, sample=sample, full_walk=True)
    assert_same(old, new, True)
    assert got.head_slots == (got.blocks - 1) * 1 + (B - 1)
    assert got.blocks == len(set(range(n)) | set(range(0, n - 1, B)))  # τ = 1 visits every anchor once


def test_a_streamed_head_fills_its_calls_and_makes_fewer():
    """A head read from memory by every call (`HEAD_STREAM_BYTES`) gets deeper slots per call at high τ:
    fewer head calls for the same blocks and the same numbers, each call within `HEAD_FILL_ROWS` pairs
    where it was filled."""
    from unittest import mock

    from eval_worker.engine import walk
    B, n = 16, 120
    rng = np.random.default_rng(3)
    drafter = drafter_for(TARGET, block_size=B, seed=4)
    prompt = [3, 4, 5, 6]
    feats = torch.randn(len(prompt) + n + B, drafter.config.num_features * TARGET.hidden_size,
                        generator=torch.Generator().manual_seed(2))
    ext = forced_reference(drafter, feats, prompt, n, "mostly", rng)
    runs = {}
    for streamed in (False, True):
        calls = []
        real = walk.Walker._call

        def counted(self, slots, rows, cols, k, real=real, calls=calls):
            calls.append(len(rows))
            return real(self, slots, rows, cols, k)

        with mock.patch.object(walk.Walker, "_call", counted), \
                mock.patch.object(walk, "HEAD_STREAM_BYTES", 0 if streamed else walk.HEAD_STREAM_BYTES):
            old, new, got = both_paths(drafter, feats, prompt, ext, n, tree_budget=8, spine=False, max_blocks=None,
                                       counting="response", stop=False, sample=np.array([5]), full_walk=True)
        assert_same(old, new, True)
        runs[streamed] = (calls, got)
    (plain, g0), (filled, g1) = runs[False], runs[True]
    assert g0.blocks == g1.blocks and g0.streak == g1.streak and g0.tree_streaks == g1.tree_streaks
    assert len(filled) < len(plain), (plain, filled)
    assert g1.head_slots >= g0.head_slots  # the price: slots past a block's first miss


def test_walk_driven_blocks_are_the_visited_ones_at_tau_block_size():
    """τ = B: the walk drafts about n / B blocks (plus the stride blocks), not n."""
    B, n = 8, 64
    rng = np.random.default_rng(3)
    drafter = drafter_for(TARGET, block_size=B, seed=5)
    prompt = [7, 8]
    feats = torch.randn(len(prompt) + n + B, drafter.config.num_features * TARGET.hidden_size,
                        generator=torch.Generator().manual_seed(2))
    ext = forced_reference(drafter, feats, prompt, n, "accept_all", rng)
    old, new, got = both_paths(drafter, feats, prompt, ext, n, tree_budget=0, spine=False, max_blocks=None,
                               counting="response", stop=False, sample=np.zeros(0, dtype=np.int64), full_walk=True)
    assert_same(old, new, True)
    assert got.blocks == len(set(range(0, n, B)) | set(range(0, n - 1, B)))  # walk anchors 0, B, 2B ... = stride


def lookahead_case(policy, B, n, seed):
    """One prompt, no tree, no sample: the all-anchor result, and a fresh walk's result with its drafter
    passes (blocks per pass) and head calls counted."""
    rng = np.random.default_rng(seed)
    drafter = drafter_for(TARGET, block_size=B, seed=seed)
    prompt = rng.integers(0, VOCAB - 1, 5).tolist()
    feats = torch.randn(len(prompt) + n + B, drafter.config.num_features * TARGET.hidden_size,
                        generator=torch.Generator().manual_seed(seed))
    ext = forced_reference(drafter, feats, prompt, n, policy, rng)
    none = np.zeros(0, dtype=np.int64)
    old, new, _ = both_paths(drafter, feats, prompt, ext, n, tree_budget=0, spine=False, max_blocks=None,
                             counting="response", stop=False, sample=none, full_walk=True)
    assert_same(old, new, True)
    counter, head_calls = CountingDrafter(drafter), []
    hook = HEAD.register_forward_hook(lambda *_: head_calls.append(1))
    try:
        seq = WalkSeq(torch.tensor(prompt + ext[:n]), len(prompt), n, np.asarray(ext), full=none)
        got = Walker(drafter, EMBED, HEAD).run([seq], [context_kv(drafter, feats[:len(prompt) + n - 1])])[0]
    finally:
        hook.remove()
    walk, s = [], 0  # the walker's greedy walk, to the end of the reference, on the all-anchor streaks
    while s < n:
        walk.append(s)
        s += int(old.streaks[s]) + 1
    assert set(old.full_walk().anchors) <= set(walk)
    visited = set(walk) | set(range(0, n - 1, B))
    return old, got, counter.calls[1:], len(head_calls), visited  # calls[0]: the stride blocks' pass


def test_lookahead_at_tau_1_serves_many_steps_per_pass():
    """τ = 1 (a fresh drafter): a waiting cursor drafts the next offsets too, each one a block the walk
    then visits, so the walk's n steps take a few drafter passes and head calls, not n of each."""
    B, n = 8, 96
    old, got, passes, head_calls, visited = lookahead_case("accept_none", B, n, seed=4)
    steps = len(old.full_walk().accept_lengths)
    assert steps >= n - 1  # one token per step
    assert len(passes) <= steps // 8 and head_calls <= steps // 4, (len(passes), head_calls)
    assert got.lookahead == 0 and set(got.need) == visited and got.blocks == n  # nothing drafted in vain


@pytest.mark.parametrize("tree_budget", [0, 8])
def test_lookahead_stops_at_the_walks_step_limit(tree_budget):
    """τ = 1 with `max_blocks` 3: the walks take 3 steps each, so nothing is drafted beyond them."""
    B, n, rng = 8, 60, np.random.default_rng(2)
    drafter = drafter_for(TARGET, block_size=B, seed=3)
    prompt = [9, 10, 11]
    feats = torch.randn(len(prompt) + n + B, drafter.config.num_features * TARGET.hidden_size,
                        generator=torch.Generator().manual_seed(3))
    ext = forced_reference(drafter, feats, prompt, n, "accept_none", rng)
    old, new, got = both_paths(drafter, feats, prompt, ext, n, tree_budget=tree_budget, spine=False, max_blocks=3,
                               counting="response", stop=False, sample=np.zeros(0, dtype=np.int64), full_walk=False)
    assert_same(old, new, False)
    stride = list(range(0, n - 1, B))  # the tree's stride streaks are all counted, the greedy's first 3
    assert got.lookahead == 0 and set(got.need) == {0, 1, 2} | set(stride if tree_budget else stride[:3])


def test_no_lookahead_at_high_tau():
    """τ near B: one block per waiting cursor per pass, as without lookahead (its blocks would be wasted)."""
    B, n = 8, 96
    old, got, passes, _, visited = lookahead_case("mostly", B, n, seed=6)
    assert old.online.tau > 5
    assert passes and all(p == (1, 1) for p in passes)
    assert got.lookahead == 0 and set(got.need) == visited and got.blocks == len(visited)


def test_need_counts_only_the_visited_blocks_not_the_lookahead():
    """τ ≈ 1.35: lookahead drafts blocks the walk skips; the FLOP bound's `need` holds only the visited
    ones, `lookahead` counts the others."""
    B, n = 8, 120
    old, got, passes, _, visited = lookahead_case("low", B, n, seed=7)
    assert 1.2 < old.online.tau < 1.5
    assert got.lookahead > 0 and set(got.need) == visited
    assert got.blocks == len(visited) + got.lookahead
    assert any(p[1] > 1 for p in passes)  # some pass drafted ahead


class CountingDrafter:
    """Counts the blocks each drafter call runs through the layers, per (batch row's prompt, anchor)."""

    def __init__(self, drafter):
        self.drafted: list[tuple[int, int]] = []  # (prompt, anchor position) per block through the layers
        self.calls: list[tuple[int, int]] = []  # (batch rows, blocks per row) per call
        B = drafter.config.block_size

        def hook(module, args, kwargs):
            pos = args[1][:, ::B]  # block positions: each block starts at its anchor
            self.calls.append(tuple(pos.shape))
            for row in pos.tolist():
                self.drafted += [a for a in row if a > 0]  # anchor 0: a padding block (every prompt is longer)

        drafter.register_forward_pre_hook(hook, with_kwargs=True)


@pytest.mark.parametrize("policy,B,seed", [("accept_all", 8, 0), ("mostly", 8, 1), ("mostly", 6, 2)])
def test_walk_drafts_each_block_through_the_layers_once_with_a_plain_tree(policy, B, seed):
    """τ near B, a flat drafter's plain tree (its walk far behind the greedy one, visiting anchors the
    greedy walk drafted without top-k, and the sample's): every anchor goes through the drafter layers
    at most once per run (the tree's visit runs the head on the kept slot hiddens), the results equal
    the all-anchor pass's, and no pass holds more blocks than the all-anchor pass."""
    n, rng = 96, np.random.default_rng(seed)
    drafter = drafter_for(TARGET, block_size=B, seed=seed)
    counter = CountingDrafter(drafter)
    seqs, kvs, olds = [], [], []
    for j in range(3):
        prompt = rng.integers(0, VOCAB - 1, 3 + 100 * j).tolist()  # anchor positions apart: a repeat is a redraft
        feats = torch.randn(len(prompt) + n + B, drafter.config.num_features * TARGET.hidden_size,
                            generator=torch.Generator().manual_seed(seed * 10 + j))
        ext = forced_reference(drafter, feats, prompt, n, policy, rng)
        sample = sample_offsets(n, 6, seed, f"p{j}")
        old, _, _ = both_paths(drafter, feats, prompt, ext, n, tree_budget=8, spine=False, max_blocks=None,
                               counting="response", stop=False, sample=sample, full_walk=True)
        olds.append((old, sample))
        seqs.append(WalkSeq(torch.tensor(prompt + ext[:n]), len(prompt), n, np.asarray(ext), full=sample))
        kvs.append(context_kv(drafter, feats[:len(prompt) + n - 1]))
    counter.drafted.clear(), counter.calls.clear()
    got = Walker(drafter, EMBED, HEAD, topk=8, tree_budget=8).run(seqs, kvs)
    assert len(counter.drafted) == len(set(counter.drafted)), "a block went through the layers twice"
    # each block through the layers is one the walks read (`need`) or one drafted ahead that they did not
    assert sum(g.blocks for g in got) == len(counter.drafted) == sum(len(g.need) + g.lookahead for g in got)
    revisits = 0
    for (old, sample), seq, g in zip(olds, seqs, got, strict=True):
        assert_same(old, score_walked(seq, g, sample, B, n), True)
        # the tree walk's visits to blocks drafted first without its top-k (greedy walk, sample)
        first_plain = (set(old.online.anchors) | set(sample.tolist())) - set(range(0, n - 1, B))
        revisits += len(set(old.tree_online.anchors) & first_plain)
    assert revisits > 0, "the case never sent the tree walk to a block drafted without its top-k"
    cap = anchors_per_pass(B, context_len=seqs[-1].prompt_len + n, heads=drafter.config.num_attention_heads,
                           dense=True)
    assert all(rows * blocks <= cap for rows, blocks in counter.calls)


def score_walked(seq, got, sample, B, n):
    streaks = np.full(n, -1)
    streaks[list(got.streak)] = list(got.streak.values())
    arg = np.stack([got.argmax[o] for o in sample.tolist()])
    return score_blocks("p", seq.ext.tolist(), n, B, streaks, got.tree_streaks.__getitem__, sample, arg,
                        max_blocks=None, counting="response", ends_with_stop=False)


# --- the engine: whole results equal ------------------------------------------------------------

PROMPTS = [[5, 17, 33, 2, 61, 8], [40, 41, 9, 9, 12, 70], [3, 3, 71, 22, 8], [60, 1, 2, 3, 4, 5, 6], [11, 12]]


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from eval_worker.engine.suite import Prompt, Suite

    root = tmp_path_factory.mktemp("walk")
    suite = Suite("w", "1", [Prompt(f"p{i}", ids=tuple(p)) for i, p in enumerate(PROMPTS)], chat_template=False,
                  max_new_tokens=40)
    good = fit_drafter(TARGET, drafter_for(TARGET, block_size=6), references(TARGET, PROMPTS[:3], 40), [6, 6, 5],
                       steps=40)
    save_drafter(good, root / "good")
    save_drafter(drafter_for(TARGET, block_size=6, seed=3), root / "random")
    return Evaluator(TARGET, root / "cache", progress=False), root, suite


def _comparable(result) -> dict:
    d = json.loads(result.to_json())
    d.pop("provenance"), d.pop("cache")
    return d


@pytest.mark.parametrize("options", [
    {"tree_budget": 4, "tree_spine": True, "validate": True, "anchor_sample": 40},
    {"tree_budget": 8, "max_blocks": 3, "counting": "published", "leak_probe_anchors": 20},
    {"mode": "stride", "tree_budget": 2, "anchor_sample": 5, "temperatures": [0.8], "num_samples": 2},
])
def test_walk_driven_early_exit_evaluator_results_equal(engine, options):
    """Every field of the result (τ, CIs, histograms, trees, baseline Δ, validation, leak probe,
    sampled τ, the anchor sample) is the same on both paths; only provenance says which ran."""
    ev, root, suite = engine
    opts = {**options, "measure_speed": False}
    a = ev.evaluate(root / "good", suite, baseline=root / "random", options={**opts, "drafting": "all"})
    b = ev.evaluate(root / "good", suite, baseline=root / "random", options={**opts, "drafting": "walk"})
    assert a.provenance["drafting"]["path"] == "all" and b.provenance["drafting"]["path"] == "walk"
    assert _comparable(a) == _comparable(b)
    if options.get("validate"):
        assert b.validation["ok"] and b.validation["steps_checked"] > 0
    sample = b.settings["anchor_sample"]
    assert sample["seed"] == 0 and sample["anchors"] <= sample["of"] and "mean_streak_all_anchors" in sample["stats"]


@pytest.mark.parametrize("sample,probe", [(40, 20), (200, 100), (5, 20)])
def test_leak_probe_anchors_come_from_the_anchor_sample(engine, sample, probe):
    """Where the anchor sample holds the probe's quota, the probe's anchors are sample anchors, so the walk drafts
    no block for the probe's strict view (the same blocks with the probe as without); where it does not, the probe
    takes evenly spread anchors of its own, and the walk drafts them too."""
    from eval_worker.engine.leak_probe import LeakProbe, probe_offsets
    from eval_worker.engine.scoring import sample_offsets

    ev, root, suite = engine
    opts = {"measure_speed": False, "drafting": "walk", "anchor_sample": sample, "tree_budget": 0}
    on = ev.evaluate(root / "good", suite, options={**opts, "leak_probe_anchors": probe})
    off = ev.evaluate(root / "good", suite, options={**opts, "leak_probe_anchors": 0})
    quota, probe_quota = -(-sample // len(PROMPTS)), LeakProbe(6, probe, len(PROMPTS)).quota
    inside = True
    for q in on.to_dict()["prompts"]:
        n = q["num_tokens"]
        drawn = sample_offsets(n, quota, 0, q["name"])
        probed = probe_offsets(n, probe_quota, drawn)
        assert len(probed) == min(probe_quota, n)
        inside &= bool(np.isin(probed, drawn).all())
    assert inside == (quota >= probe_quota)
    blocks = on.provenance["drafting"]["blocks"], off.provenance["drafting"]["blocks"]
    assert (blocks[0] == blocks[1]) if inside else (blocks[0] > blocks[1]), blocks
    assert on.leak_probe["anchors"] == sum(min(probe_quota, q["num_tokens"]) for q in on.to_dict()["prompts"])


def test_auto_measures_both_paths_then_takes_the_cheaper(engine):
    ev, root, suite = engine
    ev._draft_costs.clear()
    ev._auto_runs.clear()
    opts = {"measure_speed": False, "leak_probe_anchors": 0, "anchor_sample": 5}
    paths = [ev.evaluate(root / "good", suite, options=opts).provenance["drafting"] for _ in range(3)]
    assert [p["path"] for p in paths[:2]] == ["walk", "all"]
    costs = paths[1]["draft_s_per_token"]
    assert paths[2]["path"] == min(costs, key=costs.get) and paths[2]["chosen"] == "auto"


@settings(max_examples=200, deadline=None)
@given(seed=st.integers(0, 10_000), D=st.integers(1, 15), K=st.integers(1, 8), budget=st.integers(1, 40),
       k=st.integers(1, 15), flat=st.floats(0.05, 5.0))
def test_early_exit_tree_on_the_depths_it_read_is_the_whole_tree(seed, D, K, budget, k, flat):
    """The walk's top-k stops at depth k when a tree built on k depths never popped a node at depth k:
    that tree is then the tree of all D depths (same nodes, same walk for any labels)."""
    from eval_worker.engine.tree import build_tree

    rng = np.random.default_rng(seed)
    logp = -np.sort(rng.exponential(flat, (D, K)), axis=1)
    ids = np.stack([rng.choice(VOCAB, K, replace=False) for _ in range(D)])
    k = min(k, D)
    part, whole = build_tree(logp[:k], ids[:k], budget), build_tree(logp, ids, budget)
    if part.read_depth < k or k == D:
        assert (part.tokens, part.parents, part.depths) == (whole.tokens, whole.parents, whole.depths)
    assert whole.read_depth <= D and part.read_depth <= k


@settings(max_examples=300, deadline=None)
@given(seed=st.integers(0, 2**31), rows=st.integers(1, 40),
       vocab=st.sampled_from([2, 7, 4096, 16_384, 40_000, 151_936]),
       scale=st.floats(0.01, 400.0), dtype=st.sampled_from([torch.float32, torch.bfloat16]),
       special=st.sampled_from([None, "inf", "-inf", "row_-inf", "tile_-inf"]))
def test_logsumexp_is_torchs_bit_for_bit_on_one_tile_within_ulps_over_several(seed, rows, vocab, scale, dtype, special):
    """The top-k rule's log-sum-exp clamps exp's underflowing inputs (its slow path, where a peaked
    drafter puts most of the vocabulary): with one vocabulary tile the log-probs stay torch.logsumexp's,
    bit for bit; over several tiles (each tile's max and sum of exp, combined) within float32 rounding of
    them. The argmax is torch's first index of the largest in both; the top-k values are torch's."""
    from eval_worker.engine.drafting import VOCAB_TILE, logits_topk

    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=g) * scale).to(dtype)
    if special == "inf":
        logits[0, 0] = float("inf")
    elif special == "-inf":
        logits[0, : vocab // 2] = -float("inf")
    elif special == "row_-inf":
        logits[0] = -float("inf")
    elif special == "tile_-inf":  # a whole tile below the row's max adds nothing
        logits[0, : min(vocab - 1, VOCAB_TILE)] = -float("inf")
    k = min(8, vocab)
    a, logp, ids = logits_topk(logits, k)
    v, i = logits.topk(k, dim=-1)
    want = v.float() - torch.logsumexp(logits.float(), dim=-1, keepdim=True)
    assert torch.equal(a, logits.argmax(-1))
    if vocab <= VOCAB_TILE:
        torch.testing.assert_close(logp, want, rtol=0, atol=0, equal_nan=True)
        assert torch.equal(ids, i)
        return
    assert torch.equal(logits.gather(1, ids), v)  # the same values (ids may differ among equal ones)
    lse = torch.logsumexp(logits.float(), dim=-1, keepdim=True)
    finite = torch.isfinite(want)
    assert torch.equal(finite, torch.isfinite(logp)) and torch.equal(want[~finite].isnan(), logp[~finite].isnan())
    ulps = 4 * torch.finfo(torch.float32).eps * lse.abs().clamp(min=1).expand_as(want)  # a few ulps of the sum's log
    assert ((logp - want).abs()[finite] <= ulps[finite]).all()


def test_auto_drafting_device_starts_with_the_path_the_device_favours_and_times_the_other_once():
    """On CUDA "auto" starts with the all-anchor pass (4-6x cheaper than the walk at τ ≈ 1 on an H200), on a CPU
    with the walk; the other path is timed once, then the cheaper is taken, the dearer re-timed one time in
    AUTO_RETIME_EVERY: timing never costs more than one slower evaluation in eight after the first two."""
    from eval_worker.engine.walk import AUTO_RETIME_EVERY, auto_path

    for device, true_costs in (("cuda", {"walk": 5.0, "all": 1.0}), ("cpu", {"walk": 1.0, "all": 3.0}),
                               ("cuda", {"walk": 1.0, "all": 2.0})):
        costs: dict = {"walk": None, "all": None}
        chosen = []
        for runs in range(40):
            path = auto_path(device, costs, runs)
            chosen.append(path)
            costs[path] = true_costs[path]
        assert chosen[0] == ("all" if device == "cuda" else "walk")
        assert set(chosen[:2]) == {"walk", "all"}
        cheaper = min(true_costs, key=true_costs.get)
        dearer_runs = [i for i, p in enumerate(chosen[2:], start=2) if p != cheaper]
        assert dearer_runs == [i for i in range(2, 40) if i % AUTO_RETIME_EVERY == 0]


def test_auto_drafting_device_reads_the_costs_the_evaluations_timed(engine):
    """On this CPU the first evaluation walks and times it; the next takes the all-anchor pass once that is timed
    cheaper (here: set so), without timing the walk again."""
    ev, root, suite = engine
    ev._draft_costs.clear()
    ev._auto_runs.clear()
    opts = {"measure_speed": False, "leak_probe_anchors": 0, "anchor_sample": 5}
    ev.evaluate(root / "good", suite, options=opts)
    (key,) = ev._draft_costs
    assert ev._draft_costs[key]["walk"] is not None and ev._draft_costs[key]["all"] is None
    walk = ev._draft_costs[key]["walk"]
    ev._draft_costs[key]["all"] = 0.0  # as if timed, and cheaper
    second = ev.evaluate(root / "good", suite, options=opts).provenance["drafting"]
    assert second["path"] == "all" and second["chosen"] == "auto"
    assert ev._draft_costs[key]["walk"] == walk  # the walk was not run (nor timed) again
