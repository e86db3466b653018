"""The drafter: no context leak, multi-block == one block at a time, checkpoint layout."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from dflash_train.checkpoints.checkpoint import load_drafter, save_drafter
from dflash_train.checkpoints.publication import CheckpointError
from dflash_train.core.model import DraftCache
from tests.support.factories import MASK_ID, drafter_for, qwen3_target

TARGET = qwen3_target()
DRAFTER = drafter_for(TARGET, block_size=4)
EMBED = TARGET.parts.embed_tokens
S = 24


def draft(ids, feats, anchors, drafter=DRAFTER):
    with torch.no_grad():
        return drafter.forward_blocks(EMBED, ids, feats, anchors, backend="sdpa")


@st.composite
def case(draw):
    N = draw(st.integers(1, 4))
    anchors = sorted(draw(st.lists(st.integers(1, S - 1), min_size=N, max_size=N)))
    seed = draw(st.integers(0, 10_000))
    j = draw(st.integers(0, N - 1))
    return torch.tensor([anchors]), seed, j


def inputs(seed):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, MASK_ID, (1, S), generator=g)
    feats = torch.randn(1, S, DRAFTER.fc.in_features, generator=g)
    return ids, feats, g


@settings(max_examples=30, deadline=None)
@given(case())
def test_no_leak_from_states_at_or_after_the_anchor(c):
    """Perturbing target states at or after a block's anchor never changes that block's draft."""
    anchors, seed, j = c
    ids, feats, g = inputs(seed)
    B, a = DRAFTER.config.block_size, int(anchors[0, j])
    base = draft(ids, feats, anchors)[:, j * B:(j + 1) * B]
    perturbed = feats.clone()
    perturbed[:, a:] += torch.randn(perturbed[:, a:].shape, generator=g)
    after = draft(ids, perturbed, anchors)[:, j * B:(j + 1) * B]
    torch.testing.assert_close(after, base, atol=1e-5, rtol=0)
    if a > 0:  # the property can fail: states before the anchor do matter
        moved = feats.clone()
        moved[:, a - 1] += 3.0
        assert not torch.allclose(draft(ids, moved, anchors)[:, j * B:(j + 1) * B], base, atol=1e-4)


@settings(max_examples=30, deadline=None)
@given(case())
def test_other_blocks_never_change_a_block(c):
    anchors, seed, j = c
    ids, feats, _ = inputs(seed)
    B, N = DRAFTER.config.block_size, anchors.shape[1]
    base = draft(ids, feats, anchors)[:, j * B:(j + 1) * B]
    for other in range(N):
        if other == j or anchors[0, other] == anchors[0, j]:
            continue
        moved = anchors.clone()
        moved[0, other] = (anchors[0, other] + 1) % S  # another anchor token, other positions
        changed_ids = ids.clone()
        changed_ids[0, int(anchors[0, other])] = (ids[0, int(anchors[0, other])] + 1) % MASK_ID
        for a2, i2 in ((moved, ids), (anchors, changed_ids)):
            if a2[0, j] != anchors[0, j] or i2[0, int(anchors[0, j])] != ids[0, int(anchors[0, j])]:
                continue
            out = draft(i2, feats, a2)[:, j * B:(j + 1) * B]
            torch.testing.assert_close(out, base, atol=1e-5, rtol=0)


# published drafters with windowed layers: mixed sliding/full (causal where sliding, the
# engines' default), all sliding, and a window narrower than the block
SLIDING = {
    "sliding_mixed": drafter_for(TARGET, layers=3, block_size=4, layer_types=["sliding_attention", "full_attention",
                                                                      "sliding_attention"], sliding_window=5),
    "sliding_all": drafter_for(TARGET, layers=2, block_size=4, layer_types=["sliding_attention"] * 2, sliding_window=6),
    "sliding_narrow_noncausal": drafter_for(TARGET, layers=2, block_size=4, layer_types=["sliding_attention"] * 2,
                                    sliding_window=2, causal=False),
}


@pytest.mark.parametrize("name", ["full", *SLIDING])
def test_multi_block_equals_one_block_with_cache(name):
    """The training/eval layout and the incremental spec-decode path give the same draft
    (for sliding drafters: the same windows and causality in both; test ids say `sliding`)."""
    drafter = DRAFTER if name == "full" else SLIDING[name]
    ids, feats, _ = inputs(7)
    feats = feats[..., : drafter.fc.in_features]
    B = drafter.config.block_size
    anchors = torch.tensor([[3, 9, 10, 17]])
    many = draft(ids, feats, anchors, drafter)
    for j, a in enumerate(anchors[0].tolist()):
        cache = DraftCache(drafter.config.num_hidden_layers)
        block = torch.full((1, B), MASK_ID)
        block[0, 0] = ids[0, a]
        with torch.no_grad():  # feed the context in two pieces, as the loop does
            cut = a // 2
            drafter(EMBED(block), torch.arange(a, a + B)[None], feats[:, :cut], torch.arange(cut)[None], cache=cache)
            one = drafter(EMBED(block), torch.arange(a, a + B)[None], feats[:, cut:a], torch.arange(cut, a)[None],
                          cache=cache)
        torch.testing.assert_close(one, many[:, j * B:(j + 1) * B], atol=1e-5, rtol=1e-5)
        with torch.no_grad():  # and without a cache (one block, whole context)
            plain = drafter(EMBED(block), torch.arange(a, a + B)[None], feats[:, :a], torch.arange(a)[None])
        torch.testing.assert_close(plain, many[:, j * B:(j + 1) * B], atol=1e-5, rtol=1e-5)


@settings(max_examples=20, deadline=None)
@given(case(), st.sampled_from(sorted(SLIDING)))
def test_sliding_no_leak_and_nothing_beyond_the_window(c, name):
    """With windows: states at or after the anchor never matter; for an all-sliding drafter
    neither do states W or more positions before the anchor (slot 0 sees no further back)."""
    drafter = SLIDING[name]
    anchors, seed, j = c
    ids, feats, g = inputs(seed)
    feats = feats[..., : drafter.fc.in_features]
    B, a = drafter.config.block_size, int(anchors[0, j])
    base = draft(ids, feats, anchors, drafter)[:, j * B:(j + 1) * B]
    later = feats.clone()
    later[:, a:] += torch.randn(later[:, a:].shape, generator=g)
    torch.testing.assert_close(draft(ids, later, anchors, drafter)[:, j * B:(j + 1) * B], base, atol=1e-5, rtol=0)
    W = drafter.config.sliding_window
    if all(w is not None for w, _ in drafter.config.attention()):
        far = feats.clone()
        far[:, : max(a - W + 1, 0)] += 5.0  # positions <= a - W
        torch.testing.assert_close(draft(ids, far, anchors, drafter)[:, j * B:(j + 1) * B], base, atol=1e-5, rtol=0)
        if a - W + 1 >= 0:  # the property can fail: position a - W + 1 is inside slot 0's window
            near = feats.clone()
            near[:, a - W + 1] += 5.0
            assert not torch.allclose(draft(ids, near, anchors, drafter)[:, j * B:(j + 1) * B], base, atol=1e-4)


def test_padding_blocks_output_zero_attention_and_do_not_disturb_valid_ones():
    ids, feats, _ = inputs(3)
    anchors, B = torch.tensor([[4, 11]]), DRAFTER.config.block_size
    with torch.no_grad():
        both = DRAFTER.forward_blocks(EMBED, ids, feats, anchors, torch.tensor([[True, False]]), backend="sdpa")
    assert torch.isfinite(both).all()
    torch.testing.assert_close(both[:, :B], draft(ids, feats, anchors[:, :1]), atol=1e-5, rtol=0)


def test_checkpoint_layout_and_round_trip(tmp_path):
    save_drafter(DRAFTER, tmp_path)
    keys = set(load_file(str(tmp_path / "model.safetensors")))
    L = DRAFTER.config.num_hidden_layers
    expected = {"fc.weight", "hidden_norm.weight", "norm.weight"}
    for i in range(L):
        expected |= {f"layers.{i}.self_attn.{p}.weight" for p in ("q_proj", "k_proj", "v_proj", "o_proj", "q_norm",
                                                                  "k_norm")}
        expected |= {f"layers.{i}.mlp.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")}
        expected |= {f"layers.{i}.input_layernorm.weight", f"layers.{i}.post_attention_layernorm.weight"}
    assert keys == expected
    back = load_drafter(tmp_path)
    ids, feats, _ = inputs(1)
    anchors = torch.tensor([[5, 12]])
    torch.testing.assert_close(draft(ids, feats, anchors, back), draft(ids, feats, anchors))


def test_bf16_checkpoint_keeps_its_dtype(tmp_path):
    save_drafter(DRAFTER, tmp_path, dtype=torch.bfloat16)
    assert load_drafter(tmp_path).fc.weight.dtype == torch.bfloat16
    assert load_drafter(tmp_path, dtype=torch.float32).fc.weight.dtype == torch.float32


def test_broken_checkpoints_give_clear_errors(tmp_path):
    save_drafter(DRAFTER, tmp_path)
    weights = tmp_path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        load_drafter(tmp_path)
    weights.write_bytes(b"\xff" * 16)
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        load_drafter(tmp_path)
    weights.unlink()
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_drafter(tmp_path)
    with pytest.raises(CheckpointError, match="not a directory"):
        load_drafter(tmp_path / "nope")


def test_shape_mismatch_is_named(tmp_path):
    save_drafter(DRAFTER, tmp_path)
    bigger = drafter_for(TARGET, features=2, block_size=4)  # fc is narrower
    save_drafter(bigger, tmp_path / "b")
    (tmp_path / "b" / "config.json").write_bytes((tmp_path / "config.json").read_bytes())
    with pytest.raises(CheckpointError, match="fc.weight"):
        load_drafter(tmp_path / "b")
