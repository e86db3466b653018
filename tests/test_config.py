import json

import pytest
from hypothesis import given, strategies as st

from dflash_train.config import LAYER_IDS_FALLBACK, ConfigError, DrafterConfig, default_target_layer_ids


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
    assert all(a < b for a, b in zip(ids, ids[1:]))


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
    assert back["dflash_config"] == ZLAB_QWEN3_8B["dflash_config"]
    assert back["auto_map"] == ZLAB_QWEN3_8B["auto_map"]  # unknown fields survive
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
    d = dict(ZLAB_QWEN3_8B, num_target_layers=L, num_hidden_layers=n, dflash_config={"mask_token_id": 5})
    assert DrafterConfig.from_dict(d).target_layer_ids == ids


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
    with pytest.raises(ConfigError, match="num_target_layers"):
        DrafterConfig.from_dict({k: v for k, v in ZLAB_QWEN3_8B.items() if k != "num_target_layers"})
    with pytest.raises(ConfigError, match="not found"):
        DrafterConfig.load(tmp_path)
    (tmp_path / "config.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        DrafterConfig.load(tmp_path)
