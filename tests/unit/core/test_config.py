import json

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dflash_train.core.config import LAYER_IDS_FALLBACK, ConfigError, DrafterConfig, default_target_layer_ids


def test_published_layer_ids():
    assert default_target_layer_ids(36, 5) == [1, 9, 17, 25, 33]  # Qwen3-8B
    assert default_target_layer_ids(64, 5) == [1, 16, 31, 46, 61]  # Qwen3.6-27B
    assert default_target_layer_ids(40, 5) == [1, 10, 19, 28, 37]  # Qwen3.5-35B-A3B config
    assert default_target_layer_ids(36, 1) == [18]
    with pytest.raises(ConfigError, match="too shallow"):
        default_target_layer_ids(6, 4)


@given(L=st.integers(6, 128), n=st.integers(2, 8))
def test_layer_ids_spread_from_1_to_L_minus_3(L, n):
    if n > L - 3:
        return
    ids = default_target_layer_ids(L, n)
    assert ids[0] == 1 and ids[-1] == L - 3 and len(ids) == n
    assert all(a < b for a, b in zip(ids, ids[1:], strict=False))


ZLAB_QWEN3_8B = {  # the fields of a published z-lab drafter config.json
    "architectures": ["DFlashDraftModel"], "auto_map": {"AutoModel": "dflash.DFlashDraftModel"},
    "model_type": "qwen3", "block_size": 16, "num_target_layers": 36, "num_hidden_layers": 5,
    "hidden_size": 4096, "intermediate_size": 12288, "num_attention_heads": 32, "num_key_value_heads": 8,
    "head_dim": 128, "vocab_size": 151936, "rope_theta": 1000000, "rms_norm_eps": 1e-6,
    "max_position_embeddings": 40960, "layer_types": ["full_attention"] * 5, "use_sliding_window": False,
    "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17, 25, 33]}, "torch_dtype": "bfloat16",
}


def test_published_config_round_trip(tmp_path):
    cfg = DrafterConfig.from_dict(ZLAB_QWEN3_8B)
    assert cfg.target_layer_ids == [1, 9, 17, 25, 33] and cfg.mask_token_id == 151669 and cfg.block_size == 16
    cfg.save(tmp_path)
    back = json.loads((tmp_path / "config.json").read_text())
    # both layouts: z-lab reads block_size at the top, SGLang/vLLM prefer dflash_config.block_size
    assert back["dflash_config"] == {**ZLAB_QWEN3_8B["dflash_config"], "block_size": 16}
    assert back["block_size"] == 16 and back["layer_types"] == ["full_attention"] * 5
    assert back["auto_map"] == ZLAB_QWEN3_8B["auto_map"]  # metadata survives
    assert back["num_target_layers"] == 36 and back["architectures"] == ["DFlashDraftModel"]
    assert DrafterConfig.load(tmp_path) == cfg


def test_missing_layer_ids_fall_back_to_formula():
    d = dict(ZLAB_QWEN3_8B, dflash_config={"mask_token_id": 151669})
    cfg = DrafterConfig.from_dict(d)
    assert cfg.target_layer_ids == [1, 9, 17, 25, 33]
    assert cfg.layer_ids_origin == LAYER_IDS_FALLBACK and "half to even" in cfg.layer_ids_origin
    assert DrafterConfig.from_dict(ZLAB_QWEN3_8B).layer_ids_origin == "config"


def _published_layer_ids(L: int, n: int) -> list[int]:
    """z-lab `build_target_layer_ids` (round(1 + i*(L-4)/(n-1)), Python round = half to even),
    written again in integer arithmetic: no float, no `round`, so it is a second opinion."""
    if n == 1:
        return [L // 2]
    d = n - 1
    out = []
    for i in range(n):
        q, r = divmod(d + i * (L - 4), d)  # 1 + i*(L-4)/d == q + r/d, 0 <= r < d
        if 2 * r > d or (2 * r == d and q % 2 == 1):
            q += 1
        out.append(q)
    return out


def test_layer_formula_matches_published_on_every_pair():
    """All (target layers 1..128, features 1..8): the published value where it is usable,
    a clear error where the published formula would give duplicate or out-of-range layers."""
    differs_from_half_up = 0
    for L in range(1, 129):
        for n in range(1, 9):
            want = _published_layer_ids(L, n)
            if len(set(want)) == n and all(0 <= i < L for i in want):
                assert default_target_layer_ids(L, n) == want, (L, n)
                half_up = [1 + (2 * i * (L - 4) + n - 1) // (2 * (n - 1)) for i in range(n)] if n > 1 else want
                differs_from_half_up += want != half_up
            else:
                with pytest.raises(ConfigError, match="too shallow"):
                    default_target_layer_ids(L, n)
    assert differs_from_half_up == 131  # the pairs where rounding halves up would read another layer


@pytest.mark.parametrize("L, n, ids", [(94, 5, [1, 24, 46, 68, 91]), (10, 5, [1, 2, 4, 6, 7]),
                                       (3, 2, [1, 0]), (36, 5, [1, 9, 17, 25, 33])])
def test_layer_formula_half_to_even_examples(L, n, ids):
    assert default_target_layer_ids(L, n) == ids
    d = dict(ZLAB_QWEN3_8B, num_target_layers=L, num_hidden_layers=n, layer_types=["full_attention"] * n,
             dflash_config={"mask_token_id": 5})
    assert DrafterConfig.from_dict(d).target_layer_ids == ids


def test_block_size_inside_dflash_config_and_target_depth_from_the_target():
    """The SGLang/vLLM layout (z-lab's newer releases): block_size in dflash_config, no num_target_layers."""
    d = {k: v for k, v in ZLAB_QWEN3_8B.items() if k not in ("block_size", "num_target_layers")}
    d["dflash_config"] = {"mask_token_id": 151669, "block_size": 10}
    cfg = DrafterConfig.from_dict(d)
    assert cfg.block_size == 10 and cfg.num_target_layers is None and cfg.target_layer_ids is None
    assert cfg.num_features == 5  # one feature per drafter layer, as the published formula has it
    cfg.bind_target(36)
    assert cfg.num_target_layers == 36 and cfg.target_layer_ids == [1, 9, 17, 25, 33]
    with_ids = dict(d, dflash_config={**d["dflash_config"], "target_layer_ids": [2, 4]})
    assert DrafterConfig.from_dict(with_ids).num_features == 2
    with pytest.raises(ConfigError, match="block_size is 16 at the top level but 10 in dflash_config"):
        DrafterConfig.from_dict({**d, "block_size": 16})


def test_zero_attention_heads_is_a_config_error_not_a_crash():
    """Found by the checkpoint-config fuzzer: with no head_dim, its default divided by zero heads."""
    d = {k: v for k, v in ZLAB_QWEN3_8B.items() if k != "head_dim"}
    with pytest.raises(ConfigError, match="num_attention_heads must be at least 1"):
        DrafterConfig.from_dict({**d, "num_attention_heads": 0})


def test_unsupported_fields_are_all_named_not_ignored():
    d = {**ZLAB_QWEN3_8B, "attention_bias": True, "quantization_config": {"quant_algo": "FP8"},
         "hidden_act": "gelu", "dflash_config": {**ZLAB_QWEN3_8B["dflash_config"], "projector_type": "domino",
                                                 "attention_sink_bias": True}}
    with pytest.raises(ConfigError) as e:
        DrafterConfig.from_dict(d)
    for name in ("attention_bias=true", "quantization_config", 'hidden_act="gelu"', "dflash_config.projector_type",
                 "dflash_config.attention_sink_bias=true"):
        assert name in str(e.value)
    with pytest.raises(ConfigError, match="architectures"):
        DrafterConfig.from_dict({**ZLAB_QWEN3_8B, "architectures": ["DFlash2DraftModel"]})
    with pytest.raises(ConfigError, match="rope_parameters.partial_rotary_factor"):
        DrafterConfig.from_dict({**ZLAB_QWEN3_8B, "rope_parameters": {"rope_type": "default", "rope_theta": 1000000,
                                                                      "partial_rotary_factor": 0.25}})
    # metadata that cannot change a draft is fine, and neutral values of the knobs above too
    DrafterConfig.from_dict({**ZLAB_QWEN3_8B, "attention_bias": False, "initializer_range": 0.02,
                             "dflash_config": {**ZLAB_QWEN3_8B["dflash_config"], "attention_sink_bias": False}})


def _rotary(cfg, positions):
    from dflash_train.core.model import DFlashDrafter

    rot = DFlashDrafter(cfg).rotary_emb
    x = torch.zeros(1, positions.shape[1], cfg.head_dim)
    return rot(x, positions)


def test_yarn_rope_in_either_layout_matches_transformers():
    from transformers import Qwen3Config
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    small = {**ZLAB_QWEN3_8B, "hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 1,
             "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 200000,
             "layer_types": ["full_attention"], "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1]}}
    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}
    old = DrafterConfig.from_dict({**small, "rope_theta": 1e7, "rope_scaling": yarn, "max_position_embeddings": 131072})
    v5 = {k: v for k, v in small.items() if k != "rope_theta"}
    new = DrafterConfig.from_dict({**v5, "rope_parameters": {**yarn, "rope_theta": 1e7},
                                   "max_position_embeddings": 131072})
    assert old == new and old.rope_scaling["rope_type"] == "yarn"
    pos = torch.tensor([[0, 5, 40000, 100000]])
    cos, sin = _rotary(old, pos)
    ref = Qwen3RotaryEmbedding(Qwen3Config(head_dim=16, hidden_size=64, num_attention_heads=4,
                                           max_position_embeddings=131072, rope_parameters={**yarn, "rope_theta": 1e7}))
    rcos, rsin = ref(torch.zeros(1, 4, 16), pos)
    torch.testing.assert_close(cos, rcos)
    torch.testing.assert_close(sin, rsin)
    plain_cos, _ = _rotary(DrafterConfig.from_dict({**small, "rope_theta": 1e7}), pos)
    assert not torch.allclose(cos, plain_cos)  # the scaling is applied, not dropped
    with pytest.raises(ConfigError, match="rope_parameters.rope_theta"):
        DrafterConfig.from_dict({**small, "rope_parameters": {**yarn, "rope_theta": 1e7}})
    with pytest.raises(ConfigError, match="rope type 'dynamic' is not supported"):
        DrafterConfig.from_dict({**small, "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}})


def test_sliding_layers_from_each_published_layout():
    base = {**ZLAB_QWEN3_8B, "num_hidden_layers": 3, "layer_types": None,
            "dflash_config": {"mask_token_id": 151669, "target_layer_ids": [1, 9, 17]}}
    explicit = DrafterConfig.from_dict({**base, "layer_types": ["sliding_attention", "full_attention",
                                                                "sliding_attention"], "sliding_window": 2048})
    assert explicit.attention() == [(2048, True), (None, False), (2048, True)]  # engines: sliding layers are causal
    noncausal = DrafterConfig.from_dict({**base, "layer_types": ["sliding_attention"] * 3, "sliding_window": 64,
                                         "dflash_config": {**base["dflash_config"], "causal": False}})
    assert noncausal.attention() == [(64, False)] * 3
    swa = DrafterConfig.from_dict({**base, "dflash_config": {**base["dflash_config"], "use_swa": True,
                                                             "swa_window_size": 1024}})
    assert swa.attention() == [(1024, True)] * 3
    # transformers' Qwen3 rule: use_sliding_window, layers from max_window_layers on
    hf = DrafterConfig.from_dict({**base, "use_sliding_window": True, "sliding_window": 4096, "max_window_layers": 1})
    assert hf.attention() == [(None, False), (4096, True), (4096, True)]
    assert DrafterConfig.from_dict({**base, "use_sliding_window": True, "sliding_window": 4096}).attention() == [
        (None, False)] * 3  # default max_window_layers 28: a 3-layer drafter has no sliding layer
    assert DrafterConfig.from_dict(explicit.to_dict()) == explicit
    with pytest.raises(ConfigError, match="need sliding_window"):
        DrafterConfig.from_dict({**base, "layer_types": ["sliding_attention"] * 3})
    with pytest.raises(ConfigError, match="3 layers"):
        DrafterConfig.from_dict({**base, "layer_types": ["full_attention"] * 2})
    with pytest.raises(ConfigError, match="chunked_attention"):
        DrafterConfig.from_dict({**base, "layer_types": ["chunked_attention"] * 3})


@pytest.mark.parametrize("change, message", [
    ({"dflash_config": {"mask_token_id": 999999, "target_layer_ids": [1, 9]}}, "mask_token_id"),
    ({"dflash_config": {"mask_token_id": 5, "target_layer_ids": [1, 40]}}, "outside the target"),
    ({"dflash_config": {"mask_token_id": 5, "target_layer_ids": [1, 1]}}, "duplicates"),
    ({"block_size": 1}, "block_size"),
    ({"num_attention_heads": 30}, "multiple"),
    ({"hidden_size": "wide"}, "wrong type"),
])
def test_bad_configs_are_named(change, message):
    with pytest.raises(ConfigError, match=message):
        DrafterConfig.from_dict({**ZLAB_QWEN3_8B, **change})


def test_missing_fields_are_listed(tmp_path):
    with pytest.raises(ConfigError, match="block_size"):
        DrafterConfig.from_dict({k: v for k, v in ZLAB_QWEN3_8B.items() if k != "block_size"})
    with pytest.raises(ConfigError, match="not found"):
        DrafterConfig.load(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        DrafterConfig.load(tmp_path)
