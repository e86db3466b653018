"""One extraction path for plain and wrapped targets; drafter/target fit checks."""
import pytest
import torch

from dflash_train.core.config import DrafterConfig
from dflash_train.core.target import Target, TargetError, locate_parts
from tests.support.factories import MASK_ID, VOCAB, drafter_for, qwen3_5_vlm_target, qwen3_target


@pytest.mark.parametrize("make", [qwen3_target, qwen3_5_vlm_target], ids=["qwen3", "qwen3_5_vlm"])
def test_features_are_hf_hidden_states_id_plus_one(make):
    target = make()
    L = target.num_layers
    ids = torch.randint(0, VOCAB, (2, 11))
    with torch.no_grad():
        hs = target.model(input_ids=ids, output_hidden_states=True).hidden_states
    assert len(hs) == L + 1
    layer_ids = list(range(L))  # every layer, the last (post-norm in HF) included
    out = target.forward(ids, layer_ids)
    H = target.hidden_size
    for n, i in enumerate(layer_ids):
        torch.testing.assert_close(out.features[..., n * H:(n + 1) * H], hs[i + 1])
    logits = target.model(input_ids=ids).logits
    torch.testing.assert_close(target.logits(out.last_hidden), logits, atol=1e-5, rtol=1e-5)
    assert torch.equal(target.greedy_tokens(out.last_hidden, chunk=5), logits.argmax(-1))


def test_wrapped_target_uses_the_language_model_stack():
    target = qwen3_5_vlm_target()
    assert target.parts.text_model is target.model.model.language_model
    assert target.parts.embed_tokens is target.model.model.language_model.embed_tokens
    assert target.num_layers == 4


def test_unknown_layout_is_a_clear_error():
    with pytest.raises(TargetError, match="cannot find the decoder stack"):
        locate_parts(torch.nn.Linear(3, 3))


def test_drafter_fit_checks():
    target = qwen3_target()
    good = drafter_for(target).config
    target.check_drafter(good)

    def changed(**kw):
        d = good.to_dict()
        d.update(kw)
        return DrafterConfig.from_dict(d)

    with pytest.raises(TargetError, match="hidden_size"):
        target.check_drafter(changed(hidden_size=64, head_dim=16))
    with pytest.raises(TargetError, match="beyond the target's 6 layers"):
        target.check_drafter(changed(num_target_layers=12,
                                     dflash_config={"mask_token_id": MASK_ID, "target_layer_ids": [1, 9]}))
    with pytest.raises(TargetError, match="mask_token_id"):
        target.check_drafter(changed(vocab_size=VOCAB * 2,
                                     dflash_config={"mask_token_id": VOCAB + 5, "target_layer_ids": [1, 2]}))
    with pytest.raises(TargetError, match="6 layers"):
        target.forward(torch.zeros(1, 3, dtype=torch.long), [7])


def test_fingerprint_tracks_weights_and_config():
    a, b = qwen3_target(seed=0), qwen3_target(seed=0)
    assert a.fingerprint() == b.fingerprint()
    with torch.no_grad():
        b.parts.layers[2].mlp.up_proj.weight[0, 0] += 1e-3
    c = qwen3_target(seed=0)
    assert Target(b.model).fingerprint() != a.fingerprint()
    assert qwen3_target(layers=5).fingerprint() != c.fingerprint()


def test_load_refuses_non_model_directory(tmp_path):
    with pytest.raises(TargetError, match="no config.json"):
        Target.load(tmp_path)
