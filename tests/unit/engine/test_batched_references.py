"""References decoded in batches across prompts, plainly or by greedy speculative decoding, equal the
target's greedy output one prompt at a time (issues 36 and 37), on the bundled tiny target and the
real-shape fixtures; a speculative reference the features pass disagrees with is decoded plainly."""
from functools import cache

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dflash_train.checkpoints.checkpoint import save_drafter
from dflash_train.core.speculative import greedy_generate
from dflash_train.core.target import Target
from eval_worker.engine.acceptance import Evaluator
from eval_worker.engine.decoding import DecodeStats, Row, decode, row_batchable
from eval_worker.engine.references import LocalReferences, Request
from eval_worker.engine.suite import Prompt, Suite
from tests.support.factories import drafter_for, qwen3_5_real_shape, qwen3_real_shape, real_shape_drafter

TINY = "dflash_train/assets/tiny_target"
TEXTS = ["def add(a, b):", "import os\n", "class Stack:\n    def push(self, x):", "for k in d:"]


@cache
def tiny() -> Target:
    return Target.load(TINY)


@cache
def shape(name: str) -> Target:
    return {"qwen3": qwen3_real_shape, "qwen3_5": qwen3_5_real_shape}[name](layers=8, hidden=64)


def prompts_of(target: Target) -> list[list[int]]:
    if target.tokenizer is not None and target.source:
        return [target.tokenizer(t)["input_ids"] for t in TEXTS]
    return [list(range(1000 + 37 * i, 1000 + 37 * i + 3 + 2 * i)) for i in range(len(TEXTS))]  # lengths differ


@cache
def one_at_a_time(which: str, n: int) -> tuple[list[int], ...]:
    """The target's greedy continuations, one prompt at a time through HF `generate` (what the engine did)."""
    target = tiny() if which == "tiny" else shape(which)
    return tuple(greedy_generate(target, p, n) for p in prompts_of(target))


def target_of(which: str) -> Target:
    return tiny() if which == "tiny" else shape(which)


N, L = 10, 3


@pytest.mark.parametrize("which", ["tiny", "qwen3", "qwen3_5"])
def test_batched_references_equal_one_at_a_time(which):
    """fp32 on the CPU: identical token for token, eos cutting rows at different steps (rows leave the
    batch, the cache is packed); the hybrid Qwen3.5 decodes one row at a time (its recurrent states)."""
    target = target_of(which)
    full = one_at_a_time(which, N + L)
    eos = full[1][4]  # the second prompt stops early; the others may or may not
    reqs = [Request(f"p{i}", p, N, eos, L) for i, p in enumerate(prompts_of(target))]
    stats = DecodeStats()
    got = {i: ref for batch in LocalReferences(target).generate_many(reqs, stats=stats) for i, ref in batch}
    for i, req in enumerate(reqs):
        want = req.served(list(full[i]))
        assert want is not None and got[i].ext == want.ext and got[i].tokens == want.tokens, i
        assert got[i].finish == want.finish
    assert got[1].finish == "eos" and len(got[1].tokens) == full[1].index(eos) + 1 <= 5
    assert row_batchable(target) == (which != "qwen3_5")
    steps = max(len(r.ext) for r in got.values()) - 1
    # batched: one target step per token of the longest row; one at a time: one per token of every row
    assert stats.target_steps == (steps if which != "qwen3_5" else sum(len(r.ext) - 1 for r in got.values()))


class NoisyOracle:
    """A drafter that knows the greedy continuation and proposes it with the slots `wrong` says corrupted:
    every acceptance pattern from τ = 1 (the first slot always wrong) to τ = B (never wrong)."""

    def __init__(self, truth, block_size: int, wrong, vocab: int):
        self.truth, self.block_size, self.wrong, self.vocab = truth, block_size, wrong, vocab
        self.layer_ids: list[int] = []
        self.calls = 0

    def propose(self, row: Row) -> list[int]:
        at = len(row.out)
        true = list(self.truth[row.index][at:at + self.block_size - 1])
        true += [7] * (self.block_size - 1 - len(true))
        bad = self.wrong[(row.index + self.calls) % len(self.wrong)]
        self.calls += 1
        return [(t + 1) % self.vocab if k in bad else t for k, t in enumerate(true)]


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(which=st.sampled_from(["tiny", "qwen3"]), block=st.integers(2, 8),
       wrong=st.lists(st.frozensets(st.integers(0, 7), max_size=3), min_size=1, max_size=4),
       rows=st.integers(1, 4))
def test_spec_references_equal_plain_greedy_for_any_drafter(which, block, wrong, rows):
    """Lossless: whatever a drafter proposes (τ from 1 to B), the speculative references are the plain
    greedy ones, token for token, batched across prompts in one target forward per step."""
    target = target_of(which)
    full = one_at_a_time(which, N + L)
    oracle = NoisyOracle(full, block, wrong, target.vocab_size)
    batch = [Row(i, p, lambda out: N + L) for i, p in enumerate(prompts_of(target))]
    stats = DecodeStats()
    for _ in decode(target, batch, oracle, max_rows=rows, stats=stats, adaptive=False):
        pass
    for r in batch:
        assert r.result() == list(full[r.index]), (r.index, r.accepts)
        assert all(1 <= a <= block for a in r.accepts)
    if not any(wrong):  # a perfect drafter: B tokens per verify step
        assert all(a == block for r in batch for a in r.accepts[:-1])


@pytest.mark.parametrize("which", ["tiny", "qwen3", "qwen3_5"])
def test_spec_references_with_a_dflash_drafter(which):
    """A real (random) DFlash drafter drafting the blocks: the same references as plain decoding; on the
    hybrid target through the incremental verify, one row at a time."""
    target = target_of(which)
    drafter = (drafter_for(target, block_size=4)
               if which == "tiny" else real_shape_drafter(target, block_size=4))
    full = one_at_a_time(which, N + L)
    reqs = [Request(f"p{i}", p, N, None, L) for i, p in enumerate(prompts_of(target))]
    got = {i: ref for b in LocalReferences(target).generate_many(reqs, drafter=drafter) for i, ref in b}
    assert [got[i].ext for i in range(len(reqs))] == [list(f) for f in full]


def _suite():
    return Suite("specsuite", "1", [Prompt(f"p{i}", ids=tuple(p)) for i, p in enumerate(prompts_of(tiny()))],
                 chat_template=False, max_new_tokens=N)


def test_spec_references_in_the_engine_equal_plain_ones(tmp_path):
    target = tiny()
    save_drafter(drafter_for(target, block_size=4), tmp_path / "ck")
    opts = {"measure_speed": False, "leak_probe_anchors": 0, "tree_budget": 0}
    spec = Evaluator(target, None).evaluate(tmp_path / "ck", _suite(), options=opts)
    plain = Evaluator(target, None).evaluate(tmp_path / "ck", _suite(), options={**opts, "reference_drafter": "none"})
    assert [p.reference_text for p in spec.prompts] == [p.reference_text for p in plain.prompts]
    assert spec.tau == plain.tau
    notes = spec.provenance["references"]
    assert notes["decoding"] == "speculative" and notes["fallback_plain"] == []
    assert plain.provenance["references"]["decoding"] == "plain"
    assert all(p.reference_agrees_with_target for p in spec.prompts)


class FlippedSpeculative(LocalReferences):
    """Speculative references with one token changed on prompt p1, as a numerics flip between the verify
    pass and the features pass would leave it; plain ones untouched."""

    def generate_many(self, requests, drafter=None, stats=None):
        for batch in super().generate_many(requests, drafter=drafter, stats=stats):
            for _, ref in batch:
                if drafter is not None and ref.name == "p1":
                    ref.tokens[2] = (ref.tokens[2] + 1) % 4000
            yield batch


def test_references_fallback_plain(tmp_path):
    target = tiny()
    save_drafter(drafter_for(target, block_size=4), tmp_path / "ck")
    opts = {"measure_speed": False, "leak_probe_anchors": 0, "tree_budget": 0}
    ev = Evaluator(target, tmp_path / "cache", reference_source=FlippedSpeculative(target))
    res = ev.evaluate(tmp_path / "ck", _suite(), options=opts)
    assert res.provenance["references"]["fallback_plain"] == ["p1"]
    assert all(p.reference_agrees_with_target for p in res.prompts)
    assert "REFERENCE_NOT_TARGET_GREEDY" not in res.diagnostic_codes()
    want = one_at_a_time("tiny", N + L)
    assert [len(p.reference_text) > 0 for p in res.prompts] == [True] * len(TEXTS)
    again = Evaluator(target, tmp_path / "cache").evaluate(tmp_path / "ck", _suite(), options=opts)
    assert again.cache["references"] == "hit"  # what was cached is the plain one, the target's greedy output
    assert [p.reference_text for p in again.prompts] == [p.reference_text for p in res.prompts]
    assert target.tokenizer.decode(want[1][:N]) == res.prompts[1].reference_text


def test_flipped_reference_is_caught_only_by_the_check(tmp_path):
    """Without the fallback the flip would stand: the check is what removes it (reference_drafter=none
    decodes plainly, and the features pass agrees)."""
    target = tiny()
    reqs = [Request("p1", prompts_of(target)[1], N, None, L)]
    drafter = drafter_for(target, block_size=4)
    flipped = next(iter(FlippedSpeculative(target).generate_many(reqs, drafter=drafter)))[0][1]
    assert flipped.ext != list(one_at_a_time("tiny", N + L)[1])
    assert torch.equal(torch.tensor(flipped.ext[:2]), torch.tensor(one_at_a_time("tiny", N + L)[1][:2]))


@pytest.mark.parametrize("sliding", [False, True])
def test_spec_references_drafts_batched_across_rows(sliding):
    """One drafter forward drafts every row's block (caches stacked, left-padded, masked): the same drafts as
    one call per row, at the first step and after new context, full and sliding-window drafter layers."""
    from eval_worker.engine.decoding import DrafterProposer

    target = tiny()
    kw = {"sliding_window": 3, "layer_types": ["sliding_attention", "full_attention"]} if sliding else {}
    drafter = drafter_for(target, block_size=6, **kw)
    proposer = DrafterProposer(drafter, target)
    rows = [[Row(i, list(p), lambda out: N, out=[5 + i]) for i, p in enumerate(prompts_of(target))] for _ in (0, 1)]
    for step in range(2):
        for one, many in zip(*rows, strict=True):
            seq = one.context + one.out
            feats = target.forward(torch.tensor([seq]), drafter.config.target_layer_ids).features
            new = feats[:, one.dcache.length if one.dcache else 0: len(seq) - 1]
            one.feats, many.feats = new, new.clone()
        assert proposer.propose_many(rows[1]) == [proposer.propose(r) for r in rows[0]], step
        for one, many in zip(*rows, strict=True):
            one.out += [7, 9 + step]
            many.out += [7, 9 + step]
