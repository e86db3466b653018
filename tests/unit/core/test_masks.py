"""The multi-block mask: its rules, and flex_attention == dense SDPA."""
import warnings

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_train.core.masks import BlockLayout, cached_block_mask, dense_mask, flex_block_mask
from dflash_train.core.model import _attend


def reference_mask(anchors, valid, S, B, window=None, causal=False):
    """The rules, written out with loops (independent of masks.py)."""
    n_rows, N = anchors.shape
    out = torch.zeros(n_rows, 1, N * B, S + N * B, dtype=torch.bool)
    near = (lambda d: True) if window is None else (lambda d: abs(d) < window)  # noqa: E731
    for b in range(n_rows):
        for j in range(N):
            if not valid[b, j]:
                continue
            a = int(anchors[b, j])
            for k in range(B):
                q = j * B + k
                for p in range(a):  # context strictly before the anchor (and within the window)
                    out[b, 0, q, p] = near(a + k - p)
                for m in range(B):  # own block (within the window; up to itself when causal)
                    out[b, 0, q, S + j * B + m] = near(k - m) and (m <= k or not causal)
    return out


@st.composite
def layouts(draw, windows=False):
    rows, N, B = draw(st.integers(1, 3)), draw(st.integers(1, 4)), draw(st.sampled_from([2, 4, 8]))
    S = draw(st.integers(2, 40))
    anchors = torch.tensor([[draw(st.integers(0, S - 1)) for _ in range(N)] for _ in range(rows)])
    valid = torch.tensor([[draw(st.booleans()) for _ in range(N)] for _ in range(rows)])
    window = draw(st.sampled_from([None, 1, 2, 3, 5, 9, 64])) if windows else None
    causal = draw(st.booleans()) if windows else False
    return BlockLayout(anchors.sort(dim=1).values, valid, S, B, window, causal)


@given(layouts())
def test_dense_mask_follows_the_rules(layout):
    expected = reference_mask(layout.anchors, layout.valid, layout.context_len, layout.block_size)
    assert torch.equal(dense_mask(layout), expected)


@given(layouts(windows=True))
def test_sliding_window_and_causal_masks_follow_the_rules(layout):
    expected = reference_mask(layout.anchors, layout.valid, layout.context_len, layout.block_size,
                              layout.window, layout.causal)
    assert torch.equal(dense_mask(layout), expected)


@given(st.integers(0, 40), st.sampled_from([2, 4, 8, 16]), st.sampled_from([None, 1, 3, 8, 20]), st.booleans())
def test_sliding_cached_block_mask_is_the_one_block_layout(S, B, window, causal):
    """Cached drafting (one block right after its context) uses the same rules."""
    pos = torch.arange(S, S + B)[None]
    cached = cached_block_mask(pos, torch.arange(S)[None], window, causal)
    layout = BlockLayout(torch.tensor([[S]]), torch.tensor([[True]]), S, B, window, causal)
    full = dense_mask(layout)
    assert full.all() if cached is None else torch.equal(cached, full)


def test_sliding_window_never_shows_keys_beyond_it():
    layout = BlockLayout(torch.tensor([[20]]), torch.tensor([[True]]), 30, 4, window=6, causal=True)
    m = dense_mask(layout)[0, 0]
    # slot k (position 20 + k) sees context 15 + k .. 19 and block slots 0..k
    for k in range(4):
        assert m[k, :30].nonzero().flatten().tolist() == list(range(15 + k, 20))
        assert m[k, 30:].nonzero().flatten().tolist() == list(range(0, k + 1))


def test_anchor_itself_is_never_visible():
    layout = BlockLayout(torch.tensor([[3, 7]]), torch.tensor([[True, True]]), 10, 4)
    m = dense_mask(layout)[0, 0]
    assert not m[:4, 3].any() and m[:4, 2].all()  # block 0: positions 0..2 only
    assert not m[4:, 7].any() and m[4:, 6].all()
    assert not m[:4, 10 + 4:].any()  # block 0 never sees block 1


@settings(max_examples=25, deadline=None)
@given(layouts(), st.integers(0, 10_000))
def test_flex_attention_equals_dense_sdpa(layout, seed):
    _flex_equals_dense(layout, seed)


@settings(max_examples=25, deadline=None)
@given(layouts(windows=True), st.integers(0, 10_000))
def test_sliding_flex_attention_equals_dense_sdpa(layout, seed):
    _flex_equals_dense(layout, seed)


def _flex_equals_dense(layout, seed):
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
