"""dflash_train/core/cache_compat.py against the installed transformers: the one module that reads its cache
layers. `make test-newest` runs this file on the newest releases; a failure here names what a release changed."""
import pytest
import torch
import transformers

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
