"""dflash_train/core/cache_compat.py against the installed transformers: the one module that reads its cache
layers. `make test-newest` runs this file on the newest releases; a failure here names what a release changed."""
import pytest
import torch
import transformers
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dflash_train.core import cache_compat
from dflash_train.core.target import VerifyCache
from tests.support.factories import qwen3_5_vlm_target, qwen3_target

HYBRID = qwen3_5_vlm_target(seed=2)
PROMPT = [4, 9, 2, 7, 7, 1, 30, 11, 5]


def _held(layer) -> dict:
    """Every tensor a cache layer holds, by attribute (dicts of tensors flattened), cloned."""
    out = {}
    for name, value in vars(layer).items():
        if isinstance(value, torch.Tensor):
            out[name] = value.clone()
        elif isinstance(value, dict):
            out.update({f"{name}[{k}]": v.clone() for k, v in value.items() if isinstance(v, torch.Tensor)})
    return out


def test_hybrid_cache_has_the_layers_the_shim_names():
    cache = VerifyCache(HYBRID)
    assert cache.recurrent and cache.attention, transformers.__version__
    HYBRID.forward(torch.tensor([PROMPT]), [1], past_key_values=cache.kv, use_cache=True)
    for layer in cache.recurrent:
        for name in cache_compat.STATE_DICTS:
            assert getattr(layer, name), (name, transformers.__version__)


@pytest.mark.parametrize("extra", [1, 4])
def test_restore_puts_back_every_tensor_a_recurrent_layer_holds(extra):
    """Snapshot, run a verify pass, restore: every tensor of every linear-attention layer (whatever a release
    adds, such as 5.25's token count) is as before, and the cache's length is the committed one. A release that
    adds state the shim does not restore fails here."""
    cache = VerifyCache(HYBRID)
    HYBRID.forward(torch.tensor([PROMPT]), [1], past_key_values=cache.kv, use_cache=True)
    before = [_held(layer) for layer in cache.recurrent]
    cache.save()
    HYBRID.forward(torch.tensor([[3] * extra]), [1], past_key_values=cache.kv, use_cache=True)
    assert cache.length == len(PROMPT) + extra
    cache.restore(len(PROMPT))
    assert cache.length == len(PROMPT)
    for layer, held in zip(cache.recurrent, before, strict=True):
        after = _held(layer)
        assert after.keys() == held.keys()
        for name, t in held.items():
            assert torch.equal(after[name], t), (name, transformers.__version__)


def test_length_is_an_int_and_counts_positions_on_plain_and_hybrid_targets():
    for target in (qwen3_target(), HYBRID):
        cache = VerifyCache(target)
        target.forward(torch.tensor([PROMPT]), [1], past_key_values=cache.kv, use_cache=True)
        assert type(cache.length) is int and cache.length == len(PROMPT)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.sampled_from(["step", "crop", "select"]), st.integers(1, 40), st.integers(0, 2**16)),
                min_size=1, max_size=12))
def test_spare_room_holds_what_a_dynamic_cache_holds(ops):
    """Steps of 1-40 tokens (past the spare room, so it grows), crops and slot selections (the batched decoder's
    operations) in any order: a `spare_room` cache holds exactly the keys and values of a plain DynamicCache,
    the forward passes over it return the same logits, and its attention layers are `SpareLayer`s."""
    from transformers import DynamicCache

    target, rows = qwen3_target(layers=2), 3
    plain = DynamicCache(config=target.model.config)
    spare = cache_compat.spare_room(DynamicCache(config=target.model.config))
    assert all(type(layer) is cache_compat.SpareLayer for layer in spare.layers)
    gen = torch.Generator().manual_seed(7)
    for op, n, seed in [("step", 5, 0), *ops]:
        held = cache_compat.seq_length(plain)
        if op == "step" or not held:
            ids = torch.randint(0, 50, (rows, n), generator=gen)
            pos = held + torch.arange(n)[None].expand(rows, -1)
            got = [target.model(input_ids=ids, position_ids=pos, past_key_values=kv, use_cache=True).logits
                   for kv in (plain, spare)]
            assert torch.equal(got[0], got[1])
        elif op == "crop":
            for kv in (plain, spare):
                for layer in cache_compat.attention_layers(kv):
                    cache_compat.crop_attention(layer, max(held - n, 1))
        else:  # every row's slots in a seeded order (left in place: the positions they were rotated with)
            keep = sorted(torch.randperm(held, generator=torch.Generator().manual_seed(seed))[:max(held - n, 1)])
            index = torch.tensor([keep] * rows)
            for kv in (plain, spare):
                cache_compat.select_slots(kv, torch.arange(rows), index)
        for a, b in zip(cache_compat.attention_layers(plain), cache_compat.attention_layers(spare), strict=True):
            assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values), (op, n)
