"""The multi-block mask: its rules, and flex_attention == dense SDPA."""
import warnings

import torch
from hypothesis import given, settings, strategies as st

from dflash_train.masks import BlockLayout, dense_mask, flex_block_mask
from dflash_train.model import _attend


def reference_mask(anchors, valid, S, B):
    """The rules, written out with loops (independent of masks.py)."""
    n_rows, N = anchors.shape
    out = torch.zeros(n_rows, 1, N * B, S + N * B, dtype=torch.bool)
    for b in range(n_rows):
        for j in range(N):
            if not valid[b, j]:
                continue
            for k in range(B):
                q = j * B + k
                out[b, 0, q, : int(anchors[b, j])] = True  # context strictly before the anchor
                out[b, 0, q, S + j * B: S + (j + 1) * B] = True  # own block
    return out


@st.composite
def layouts(draw):
    rows, N, B = draw(st.integers(1, 3)), draw(st.integers(1, 4)), draw(st.sampled_from([2, 4, 8]))
    S = draw(st.integers(2, 40))
    anchors = torch.tensor([[draw(st.integers(0, S - 1)) for _ in range(N)] for _ in range(rows)])
    valid = torch.tensor([[draw(st.booleans()) for _ in range(N)] for _ in range(rows)])
    return BlockLayout(anchors.sort(dim=1).values, valid, S, B)


@given(layouts())
def test_dense_mask_follows_the_rules(layout):
    expected = reference_mask(layout.anchors, layout.valid, layout.context_len, layout.block_size)
    assert torch.equal(dense_mask(layout), expected)


def test_anchor_itself_is_never_visible():
    layout = BlockLayout(torch.tensor([[3, 7]]), torch.tensor([[True, True]]), 10, 4)
    m = dense_mask(layout)[0, 0]
    assert not m[:4, 3].any() and m[:4, 2].all()  # block 0: positions 0..2 only
    assert not m[4:, 7].any() and m[4:, 6].all()
    assert not m[:4, 10 + 4:].any()  # block 0 never sees block 1


@settings(max_examples=25, deadline=None)
@given(layouts(), st.integers(0, 10_000))
def test_flex_attention_equals_dense_sdpa(layout, seed):
    g = torch.Generator().manual_seed(seed)
    rows, heads, kv_heads, d = layout.anchors.shape[0], 4, 2, 16
    q = torch.randn(rows, heads, layout.q_len, d, generator=g)
    k = torch.randn(rows, kv_heads, layout.kv_len, d, generator=g)
    v = torch.randn(rows, kv_heads, layout.kv_len, d, generator=g)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        flex = _attend(q, k, v, flex_block_mask(layout, compile=False))
    dense = _attend(q, k, v, dense_mask(layout))
    torch.testing.assert_close(flex, dense, atol=1e-5, rtol=1e-5)
