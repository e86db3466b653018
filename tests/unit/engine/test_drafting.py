"""Batched all-anchor drafting == one block per forward; chunked LM head == unchunked.

Tolerance: argmax and top-k ids equal exactly; top-k log-probs within 1e-5 (the batched
pass reduces attention over a longer, masked key list, so sums are ordered differently;
the head alone differs by <= 1e-6 when a chunk is a single row).
"""
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_train.core.config import DrafterConfig
from dflash_train.core.model import DFlashDrafter
from dflash_train.core.target import Target
from eval_worker.engine.drafting import draft_anchors, draft_one_block, head_topk
from tests.support.factories import drafter_for, qwen3_target

TARGET = qwen3_target(seed=4)
DRAFTER = drafter_for(TARGET, block_size=6, seed=4)
EMBED, HEAD = TARGET.parts.embed_tokens, TARGET.parts.lm_head
IDS = torch.randint(0, 90, (48,), generator=torch.Generator().manual_seed(0))
FEATS = TARGET.forward(IDS[None], DRAFTER.config.target_layer_ids).features[0]


def one_by_one(drafter, embed, head, ids, feats, anchors, k):
    outs = [draft_one_block(drafter, embed, head, ids, feats, int(a), topk=k) for a in anchors]
    return (np.stack([o[0].numpy() for o in outs]), np.stack([o[1].numpy() for o in outs]),
            np.stack([o[2].numpy() for o in outs]))


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(1, 47), min_size=1, max_size=20), st.integers(1, 9))
def test_batched_equals_one_block_at_a_time(anchors, per_chunk):
    anchors = sorted(anchors)
    got = draft_anchors(DRAFTER, EMBED, HEAD, IDS, FEATS, anchors, topk=4, anchors_per_chunk=per_chunk,
                        backend="sdpa")
    arg, ids, logp = one_by_one(DRAFTER, EMBED, HEAD, IDS, FEATS, anchors, 4)
    np.testing.assert_array_equal(got.argmax, arg)
    np.testing.assert_array_equal(got.topk_ids, ids)
    np.testing.assert_allclose(got.topk_logp, logp, atol=1e-5, rtol=0)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_layout_with_padded_chunks_matches_sdpa():
    """The padded, fixed-shape chunks used with flex_attention give the same drafts."""
    anchors = np.arange(3, 40)
    a = draft_anchors(DRAFTER, EMBED, HEAD, IDS, FEATS, anchors, topk=3, anchors_per_chunk=16, backend="sdpa")
    b = draft_anchors(DRAFTER, EMBED, HEAD, IDS, FEATS, anchors, topk=3, anchors_per_chunk=16, backend="flex")
    np.testing.assert_array_equal(a.argmax, b.argmax)
    np.testing.assert_allclose(a.topk_logp, b.topk_logp, atol=1e-5, rtol=0)


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 70), st.integers(1, 8), st.integers(0, 1000))
def test_chunked_head_equals_unchunked(rows_per_chunk, k, seed):
    hidden = torch.randn(61, TARGET.hidden_size, generator=torch.Generator().manual_seed(seed))
    arg, ids, logp = head_topk(HEAD, hidden, k, rows_per_chunk)
    full = torch.log_softmax(HEAD(hidden).float(), -1)
    assert torch.equal(arg, HEAD(hidden).argmax(-1))
    v, i = full.topk(k, -1)
    assert torch.equal(ids, i)
    torch.testing.assert_close(logp, v, atol=1e-6, rtol=0)  # a 1-row GEMM may round differently


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 70), st.integers(1, 8), st.integers(0, 1000), st.sampled_from([1, 3, 64, 1000]),
       st.integers(0, 61), st.booleans())
def test_head_over_vocabulary_tiles_is_the_whole_products_rule(rows_per_chunk, k, seed, tile, topk_rows, plain):
    """Whatever the tile width: the argmax is the whole product's (first index of the largest), the top-k
    values are its top-k values, the log-probs its log-softmax's within float32 rounding; top-k only for the
    first `topk_rows` rows. A head that is not a bias-free Linear gets the same rule on its own output."""
    from unittest import mock

    from eval_worker.engine import drafting
    head = HEAD if plain else torch.nn.Linear(HEAD.in_features, HEAD.out_features, bias=True)
    if not plain:
        with torch.no_grad():
            head.weight.copy_(HEAD.weight)
            head.bias.normal_(generator=torch.Generator().manual_seed(seed))
    hidden = torch.randn(61, TARGET.hidden_size, generator=torch.Generator().manual_seed(seed))
    with mock.patch.object(drafting, "VOCAB_TILE", tile):
        arg, ids, logp = head_topk(head, hidden, k, rows_per_chunk, topk_rows=topk_rows)
    with torch.no_grad():
        logits = head(hidden)
    assert torch.equal(arg, logits.argmax(-1))
    assert ids.shape == (topk_rows, k) and logp.shape == (topk_rows, k)
    v, _ = logits[:topk_rows].topk(k, -1)
    assert torch.equal(logits[:topk_rows].gather(1, ids), v)
    torch.testing.assert_close(logp, torch.log_softmax(logits[:topk_rows].float(), -1).gather(1, ids),
                               atol=1e-5, rtol=0)


def test_bf16_drafter_on_fp32_target():
    """A bf16 checkpoint drafts in bf16 (embeddings cast), like the spec loop does."""
    bf = drafter_for(TARGET, block_size=6, seed=4).to(torch.bfloat16)
    got = draft_anchors(bf, EMBED, HEAD, IDS, FEATS, [10, 20, 30], backend="sdpa")
    arg, _, _ = one_by_one(bf, EMBED, HEAD, IDS, FEATS, [10, 20, 30], 1)
    assert (got.argmax == arg).mean() > 0.95  # bf16 sums differ in order; near-ties may flip


def test_tiny_target_batched_equals_one_block(tiny_target_path):
    torch.manual_seed(0)
    target = Target.load(tiny_target_path)
    cfg = DrafterConfig.for_target(target.model.config, mask_token_id=target.mask_token_id(), num_hidden_layers=1,
                                   block_size=16)
    drafter = DFlashDrafter(cfg).eval()
    ids = torch.tensor(target.tokenizer("def fizzbuzz(n):\n    for i in range(1, n + 1):\n")["input_ids"] * 3)
    feats = target.forward(ids[None], cfg.target_layer_ids).features[0]
    anchors = np.arange(1, len(ids))
    got = draft_anchors(drafter, target.parts.embed_tokens, target.parts.lm_head, ids, feats, anchors, topk=8,
                        anchors_per_chunk=24)
    arg, tid, logp = one_by_one(drafter, target.parts.embed_tokens, target.parts.lm_head, ids, feats, anchors, 8)
    np.testing.assert_array_equal(got.argmax, arg)
    np.testing.assert_allclose(got.topk_logp, logp, atol=1e-4, rtol=0)


def test_bad_anchor_is_an_error():
    with pytest.raises(ValueError, match="anchors must lie"):
        draft_anchors(DRAFTER, EMBED, HEAD, IDS, FEATS, [48])
