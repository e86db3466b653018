"""The walk's peak memory is no higher than the all-anchor pass's (issue 26), by the deterministic
peak of live tensor bytes (tests/support/tensor_peak.py) of the drafting run (`Evaluator._run`:
cached features, drafting, leak probe, scoring), on the same checkpoint, suite and options.

The walk holds a group of prompts' context keys/values at once; the all-anchor pass one prompt's
context, one layer at a time, and its LM head's logits. At a small vocabulary the drafter's layers
set both peaks, so any copy of the group's keys in a walk pass (stacked per pass, concatenated with
the blocks' in a layer's attention) or a group larger than the all-anchor pass's layer shows here.
"""
import pytest

from dflash_train.checkpoints.checkpoint import save_drafter
from eval_worker.engine.acceptance import Evaluator
from tests.support.factories import drafter_for, qwen3_target
from tests.support.tensor_peak import marked, peak_live_bytes, tensor_events_during

TARGET = qwen3_target(seed=5)
PROMPTS = [[5, 17, 33, 2, 61, 8], [40, 41, 9, 9, 12, 70], [3, 3, 71, 22, 8], [60, 1, 2, 3, 4, 5, 6], [11, 12],
           [7, 8, 9], [20, 30, 40, 50], [90, 1, 90, 2]]


def run_peak(ev, ckpt, suite, options) -> int:
    """Peak live tensor bytes of the drafting run (`Evaluator._run`) above its start."""
    marks: list[int] = []
    ev._run = marked(Evaluator._run.__get__(ev), marks)
    try:
        _, events = tensor_events_during(lambda: ev.evaluate(ckpt, suite, options=options))
    finally:
        del ev._run
    return peak_live_bytes(events, marks[0], marks[-1])


@pytest.mark.parametrize("block_size,max_new,options", [
    (8, 64, {"tree_budget": 8}),  # a flat (random) drafter, plain tree: the forced flat row's setting
    (6, 40, {"tree_budget": 4, "tree_spine": True, "anchor_sample": 40, "leak_probe_anchors": 10}),
    (16, 96, {"tree_budget": 0}),
])
def test_walk_peak_is_no_higher_than_the_all_anchor_pass(tmp_path, block_size, max_new, options):
    from eval_worker.engine.suite import Prompt, Suite

    suite = Suite("m", "1", [Prompt(f"p{i}", ids=tuple(p)) for i, p in enumerate(PROMPTS)], chat_template=False,
                  max_new_tokens=max_new)
    save_drafter(drafter_for(TARGET, block_size=block_size, seed=3), tmp_path / "d")
    ev = Evaluator(TARGET, tmp_path / "cache", progress=False)
    opts = {**options, "measure_speed": False}
    ev.evaluate(tmp_path / "d", suite, options={**opts, "drafting": "walk"})  # references and features cached
    peaks = {path: run_peak(ev, tmp_path / "d", suite, {**opts, "drafting": path}) for path in ("all", "walk")}
    assert peaks["walk"] <= peaks["all"], peaks


def test_block_keys_joined_in_place_give_the_concatenations_hidden_states_bit_for_bit():
    """`GroupKV` writes a layer's block keys/values right after the pass's context (`model.join_kv`)
    instead of `torch.cat`: the drafter's outputs are identical, and the group's buffers hold their
    context again afterwards (for every pass shape: rows with no block in between, several blocks per
    prompt, and a pass too long for the room after the context, which concatenates)."""
    import numpy as np
    import torch

    from eval_worker.engine.walk import GroupKV, Walker, WalkSeq, context_kv
    from tests.support.factories import VOCAB

    drafter = drafter_for(TARGET, block_size=6, seed=2)
    rng = np.random.default_rng(0)
    seqs, kvs = [], []
    for j, (P, n) in enumerate([(5, 30), (12, 20), (3, 41)]):
        ids = torch.tensor(rng.integers(0, VOCAB - 1, P + n))
        feats = torch.randn(P + n, drafter.config.num_features * TARGET.hidden_size,
                            generator=torch.Generator().manual_seed(j))
        seqs.append(WalkSeq(ids, P, n, np.zeros(n + 5, dtype=np.int64)))
        kvs.append(context_kv(drafter, feats[:P + n - 1]))
    walker = Walker(drafter, TARGET.parts.embed_tokens, TARGET.parts.lm_head)
    for rows in ([(0, 3), (2, 17)], [(1, 0), (1, 6), (1, 19)], [(0, 29), (1, 19), (2, 40)],
                 [(2, o) for o in range(0, 40, 4)]):
        group = GroupKV.of(drafter, kvs)
        before = [t.clone() for t in group.keys + group.values]
        got = walker._blocks(seqs, group, rows)
        assert all(torch.equal(a, b) for a, b in zip(before, group.keys + group.values, strict=True))
        copied = GroupKV.of(drafter, kvs)
        copied.size = 0  # no room after any context: every layer concatenates
        assert torch.equal(got, walker._blocks(seqs, copied, rows)), rows


def test_walk_peak_is_no_higher_than_the_all_anchor_pass_at_a_4096_vocabulary(tmp_path):
    """The bundled tiny target (vocab 4,096, where the all-anchor pass peaks at its LM head's logits):
    a random drafter (τ ≈ 1: the walk drafts ahead of its cursors, several head rounds per step) with
    a plain tree, the anchor sample and the leak probe, as `bench/walk_cost.py`'s demo row."""
    import numpy as np

    from dflash_train.core.target import Target
    from eval_worker.engine.suite import Prompt, Suite
    from tests.conftest import TINY_TARGET

    if not (TINY_TARGET / "config.json").is_file():
        pytest.skip(f"bundled tiny target missing: {TINY_TARGET}")
    target = Target.load(TINY_TARGET)
    rng = np.random.default_rng(0)
    prompts = [Prompt(f"p{i}", ids=tuple(int(x) for x in rng.integers(10, 4000, 24))) for i in range(6)]
    suite = Suite("t", "1", prompts, chat_template=False, max_new_tokens=96)
    save_drafter(drafter_for(target, block_size=16, seed=1), tmp_path / "d")
    ev = Evaluator(target, tmp_path / "cache", progress=False)
    opts = {"tree_budget": 8, "anchor_sample": 12, "leak_probe_anchors": 8, "measure_speed": False}
    ev.evaluate(tmp_path / "d", suite, options={**opts, "drafting": "walk"})
    peaks = {path: run_peak(ev, tmp_path / "d", suite, {**opts, "drafting": path}) for path in ("all", "walk")}
    assert peaks["walk"] <= peaks["all"], peaks
