"""DDTree-style trees: best-first is optimal for its surrogate; the walk; tree vs top-1 chain."""
import itertools

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from eval_worker.engine.drafting import draft_anchors
from eval_worker.engine.metrics import leading_true, matches
from eval_worker.engine.tree import build_tree, tree_streak
from tests.support.engine_helpers import fit_drafter, references
from tests.support.factories import drafter_for, qwen3_target


@st.composite
def block(draw):
    D, K = draw(st.integers(1, 4)), draw(st.integers(1, 4))
    seed = draw(st.integers(0, 10_000))
    rng = np.random.default_rng(seed)
    logp = -np.sort(rng.exponential(1.0, size=(D, K)), axis=1)  # descending, continuous: no ties
    ids = np.stack([rng.permutation(6)[:K] for _ in range(D)])
    labels = rng.integers(0, 6, size=D)
    return logp, ids, labels, draw(st.integers(0, 12))


def prefixes(logp, ids):
    """Every prefix of rank choices with its score (brute force)."""
    D, K = logp.shape
    out = {}
    for d in range(1, D + 1):
        for ranks in itertools.product(range(K), repeat=d):
            toks = tuple(int(ids[i, r]) for i, r in enumerate(ranks))
            out[toks] = sum(logp[i, r] for i, r in enumerate(ranks))
    return out


def tree_paths(tree):
    def path(i):
        p = []
        while i != -1:
            p.append(tree.tokens[i])
            i = tree.parents[i]
        return tuple(reversed(p))
    return {path(i) for i in range(len(tree))}


@settings(max_examples=200, deadline=None)
@given(block())
def test_best_first_tree_is_the_top_budget_prefixes(case):
    logp, ids, _, budget = case
    tree = build_tree(logp, ids, budget)
    allp = prefixes(logp, ids)
    best = sorted(allp, key=allp.get, reverse=True)[:budget]
    assert tree_paths(tree) == set(best)
    assert len(tree) == min(budget, len(allp))
    for i, parent in enumerate(tree.parents):  # prefix-closed, depths consistent
        assert parent < i and tree.depths[i] == (1 if parent == -1 else tree.depths[parent] + 1)


@settings(max_examples=200, deadline=None)
@given(block())
def test_walk_and_dominance(case):
    logp, ids, labels, budget = case
    top1 = int(leading_true((ids[:, 0] == labels)[None])[0])
    plain = build_tree(logp, ids, budget)
    walked = tree_streak(plain, labels)
    # the walk reaches exactly the longest label prefix present in the tree
    present = [d for d in range(len(labels) + 1) if tuple(int(x) for x in labels[:d]) in tree_paths(plain) | {()}]
    assert walked == max(present)
    assert walked >= min(top1, plain.spine_depth)  # holds for every tree: the spine is a chain prefix
    spine = build_tree(logp, ids, budget, spine=True)
    assert tree_streak(spine, labels) >= top1  # with the chain kept, never worse than top-1
    assert tree_paths(plain) <= tree_paths(spine)  # the chain is added, nothing is lost
    assert tree_streak(spine, labels) >= walked
    assert len(spine) <= logp.shape[0] + budget
    labels_unknown = labels.copy()
    labels_unknown[0] = -1
    assert tree_streak(spine, labels_unknown) == 0


def test_plain_tree_can_fall_below_the_top1_chain():
    """Why `spine` exists: a flat first slot spends the whole budget on depth-1 siblings."""
    logp = np.log(np.array([[0.13] * 8, [0.99] + [0.01 / 7] * 7, [0.99] + [0.01 / 7] * 7]))
    ids = np.stack([np.arange(8), np.arange(8) + 10, np.arange(8) + 20])
    labels = np.array([0, 10, 20])  # the top-1 chain is right all the way
    assert tree_streak(build_tree(logp, ids, 8), labels) == 1
    assert tree_streak(build_tree(logp, ids, 8, spine=True), labels) == 3


def test_tree_on_real_drafts_never_below_top1_with_spine():
    """Every block of a fitted drafter: spine tree >= top-1 streak; plain tree >= it up to its spine."""
    target = qwen3_target(seed=3)
    prompts = [[5, 17, 33, 2, 61, 8], [40, 41, 9, 9, 12, 70]]
    seqs = references(target, prompts, 32)
    drafter = fit_drafter(target, drafter_for(target, block_size=6), seqs, [6, 6], steps=25)
    cfg = drafter.config
    checked = gained = 0
    for seq in seqs:
        ids = torch.tensor(seq)
        feats = target.forward(ids[None], cfg.target_layer_ids).features[0]
        d = draft_anchors(drafter, target.parts.embed_tokens, target.parts.lm_head, ids, feats,
                          np.arange(6, len(seq)), topk=8)
        offsets = np.arange(len(seq) - 6)
        ext = seq[6:]
        top1 = leading_true(matches(d.argmax, ext, offsets))
        for s in offsets:
            labels = [ext[s + k] if s + k < len(ext) else -1 for k in range(1, cfg.block_size)]
            spine = tree_streak(build_tree(d.topk_logp[s], d.topk_ids[s], 8, spine=True), labels)
            plain_tree = build_tree(d.topk_logp[s], d.topk_ids[s], 8)
            assert spine >= top1[s]
            assert tree_streak(plain_tree, labels) >= min(top1[s], plain_tree.spine_depth)
            checked += 1
            gained += spine > top1[s]
    assert checked > 50 and gained > 0  # the tree recovers tokens the chain misses
