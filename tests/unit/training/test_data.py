"""Training data: sharded deterministic batches, record parsing, cached regeneration, builtin sources."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_train.training.data import (
    BatchPlan,
    DataError,
    Example,
    encode_record,
    load_records,
    regenerate,
    stdlib_code_prompts,
    stdlib_instruct_prompts,
)
from tests.support.train_helpers import target_and_examples


def _examples(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        p = int(torch.randint(2, 12, (1,), generator=g))
        r = int(torch.randint(2, 30, (1,), generator=g))
        out.append(Example(torch.randint(4, 90, (p + r,), generator=g).tolist(), p, f"e{i}"))
    return out


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 4), st.integers(1, 3), st.integers(0, 30), st.integers(0, 99))
def test_ranks_partition_the_global_batch(world, per_rank, position, seed):
    G = world * per_rank
    exs = _examples(G * 3 + 1, seed)
    whole = BatchPlan(exs, G, seed=seed, max_seq_len=64, seq_multiple=8).batch(position)
    parts = [BatchPlan(exs, G, seed=seed, rank=r, world_size=world, max_seq_len=64, seq_multiple=8).batch(position)
             for r in range(world)]
    assert sum((p.sample_ids for p in parts), []) == whole.sample_ids
    assert sum((p.row_seeds for p in parts), []) == whole.row_seeds
    for p in parts:
        for r, sid in enumerate(p.sample_ids):
            ex = exs[sid]
            n = len(ex.ids)
            assert p.ids[r, :n].tolist() == ex.ids
            assert p.loss_mask[r].nonzero().squeeze(1).tolist() == list(range(ex.prompt_len, n))
        assert p.ids.shape[1] % 8 == 0


def test_each_epoch_visits_every_example_once():
    exs = _examples(10)
    plan = BatchPlan(exs, 3, seed=5)
    assert plan.batches_per_epoch == 3
    for epoch in range(3):
        seen = sum((plan.batch(epoch * 3 + i).sample_ids for i in range(3)), [])
        assert len(set(seen)) == 9  # 9 of 10 (the remainder is dropped), none twice
    assert plan.batch(0).sample_ids != plan.batch(3).sample_ids  # reshuffled per epoch
    assert plan.batch(4).sample_ids == BatchPlan(exs, 3, seed=5).batch(4).sample_ids  # resumable by position


def test_long_examples_keep_the_prompt_end_and_fit():
    ex = Example(list(range(100, 200)) + list(range(300, 340)), 100)
    b = BatchPlan([ex], 1, max_seq_len=64, seq_multiple=0).batch(0)
    assert b.ids.shape == (1, 64)
    assert b.ids[0, :32].tolist() == list(range(168, 200))  # the prompt's last 32 tokens
    assert b.loss_mask[0].sum() == 32


def test_bad_batches_and_records(tmp_path):
    with pytest.raises(DataError, match="divisible"):
        BatchPlan(_examples(8), 3, world_size=2)
    with pytest.raises(DataError, match="fewer than one global batch"):
        BatchPlan(_examples(2), 4)
    p = tmp_path / "d.jsonl"
    p.write_text('{"prompt": "a"}\n\n{"prompt": broken\n')
    with pytest.raises(DataError, match=r"d.jsonl:3: not JSON"):
        load_records(p)
    p.write_text('{"question": "a"}\n')
    with pytest.raises(DataError, match="'prompt', 'messages' or 'text'"):
        load_records(p)
    with pytest.raises(DataError, match="not found"):
        load_records(tmp_path / "missing.jsonl")


def test_regeneration_is_cached_and_equals_greedy(tmp_path):
    target, examples = target_and_examples()
    prompts = [ex.ids[:ex.prompt_len] for ex in examples[:4]] + [examples[5].ids[:7]]  # mixed lengths
    calls = []
    real = target.model.generate

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    target.model.generate = counting
    try:
        first = regenerate(target, prompts, 10, cache_dir=tmp_path, batch_size=8)
        n = len(calls)
        again = regenerate(target, prompts, 10, cache_dir=tmp_path, batch_size=8)
    finally:
        target.model.generate = real
    assert again == first and len(calls) == n == 1  # one batch (left-padded); nothing rerun from cache
    # equals the target's own greedy decode, prompt by prompt (padded one too)
    for p, r in zip(prompts, first, strict=False):
        ids = torch.tensor([p])
        ref = real(ids, attention_mask=torch.ones_like(ids), max_new_tokens=10, do_sample=False, pad_token_id=0)
        assert r == ref[0, len(p):].tolist()
    assert len(list(tmp_path.glob("regen-*.json"))) == 1


def test_builtin_sources_and_templates(tiny_target_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_target_path, local_files_only=True)
    code = stdlib_code_prompts(tok, 6, 48, "train")
    held = stdlib_code_prompts(tok, 6, 48, "heldout")
    assert len(code) == 6 and all(len(e.ids) == 48 for e in code)
    assert tok.decode(code[0].ids).rstrip().endswith(":")  # cut right after a def line
    assert {tuple(e.ids) for e in code}.isdisjoint({tuple(e.ids) for e in held})
    ins = stdlib_instruct_prompts(tok, 5, "train")
    text = tok.decode(ins[0].ids)
    assert text.startswith("<|im_start|>user\n") and text.endswith("<|im_start|>assistant\n")
    assert "Python" in text or "python" in text
    raw, _ = encode_record(tok, {"prompt": "x = 1"}, "never")
    assert tok.decode(raw) == "x = 1"
    prompt, resp = encode_record(tok, {"messages": [{"role": "user", "content": "hi"},
                                                    {"role": "assistant", "content": "ok"}]}, "auto")
    assert tok.decode(prompt).endswith("assistant\n") and tok.decode(resp) == "ok"
    with pytest.raises(DataError, match="unknown split"):
        stdlib_code_prompts(tok, 1, 8, "test")


@pytest.mark.slow  # ~10-25 s: CI's slow pass (the default suite stays under 10 min on 2 cores)
def test_builtin_training_prompts_are_held_out_from_the_suite_and_the_targets_pairs(tiny_target_path):
    """The demo drafter's requests (builtin:stdlib-mix) are not the eval suite's prompts, and
    not chat pairs the target trained on: the target writes them a fresh answer."""
    from transformers import AutoTokenizer

    from dflash_train.training.corpus import collect_chat_pairs
    from eval_worker.engine.suite import load_suite

    tok = AutoTokenizer.from_pretrained(tiny_target_path, local_files_only=True)
    pairs = collect_chat_pairs()
    ins = stdlib_instruct_prompts(tok, 192, "train")
    names = {e.name.removeprefix("train-instruct-") for e in ins}
    assert len(names) == 192 and names <= {p.qualname for p in pairs["spare"]}
    assert names.isdisjoint({p.qualname for p in pairs["train"]})
    suite = load_suite("coding")
    suite_texts = {p.prompt for p in suite.prompts if p.prompt}
    assert len(suite_texts) == len(suite.prompts)
    asks = {tok.decode(e.ids) for e in ins}
    assert not any(s in a for s in suite_texts for a in asks)
    held = stdlib_instruct_prompts(tok, 5, "heldout")
    assert {tuple(e.ids) for e in held}.isdisjoint({tuple(e.ids) for e in ins})
