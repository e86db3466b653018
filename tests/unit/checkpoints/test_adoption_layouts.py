"""Drafter layouts of other trainers and engines (DeepSpec, speculators, vLLM/SGLang, Automodel):
the same weights written in each layout load to the same drafter and give the z-lab layout's τ,
prompt by prompt; what we cannot draft as its authors do is refused by field name before any
target loads. Sliding windows: the causality rule is named in every result."""
from __future__ import annotations

import json

import pytest
import torch

from dflash_train.checkpoints.checkpoint import load_drafter, save_drafter
from dflash_train.checkpoints.publication import CheckpointError
from dflash_train.core.config import ConfigError, DrafterConfig
from eval_worker.engine.acceptance import Evaluator
from eval_worker.engine.checkpoint_source import check_drafter_config
from eval_worker.engine.suite import Prompt, Suite
from tests.support import layouts
from tests.support.engine_helpers import fit_drafter, references
from tests.support.factories import drafter_for, qwen3_target

TARGET = qwen3_target(seed=8)
PROMPTS = [[5, 17, 33, 2, 61, 8], [40, 41, 9, 9, 12, 70], [3, 3, 71, 22, 8], [60, 1, 2, 3, 4, 5, 6]]
SUITE = Suite("adopt", "1", [Prompt(f"p{i}", ids=tuple(p)) for i, p in enumerate(PROMPTS)], chat_template=False,
              max_new_tokens=24)
OPTS = {"measure_speed": False, "tree_budget": 0, "leak_probe_anchors": 0, "bootstrap": 20}


@pytest.fixture(scope="module")
def zlab(tmp_path_factory):
    """A fitted drafter (τ well above 1, so equal τ means equal drafts), z-lab layout; it reads the
    embedding output (id -1, DeepSpec's convention) besides two decoder layers."""
    root = tmp_path_factory.mktemp("zlab")
    d = drafter_for(TARGET, block_size=6, layers=2, target_layer_ids=[-1, 1, 3])
    save_drafter(fit_drafter(TARGET, d, references(TARGET, PROMPTS[:3], 24), [6, 6, 5], steps=30), root / "d")
    return root / "d"


@pytest.fixture(scope="module")
def ev(tmp_path_factory):
    return Evaluator(TARGET, tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def zlab_result(zlab, ev):
    res = ev.evaluate(zlab, SUITE, options=OPTS)
    assert res.tau["macro"] > 1.3, res.tau  # the comparison below means something
    return res


def _same_as_zlab(path, zlab, zlab_result, ev, layout):
    ours, theirs = load_drafter(zlab), load_drafter(path)
    theirs.config.bind_target(TARGET.num_layers)  # speculators: the depth is the verifier's
    assert theirs.config == ours.config and theirs.config.layout == layout
    assert all(torch.equal(theirs.state_dict()[k], v) for k, v in ours.state_dict().items())
    res = ev.evaluate(path, SUITE, options=OPTS)
    assert res.settings["layout"] == layout and res.settings["layer_ids"] == [-1, 1, 3]
    assert res.tau == zlab_result.tau
    assert [p.accept_lengths for p in res.prompts] == [p.accept_lengths for p in zlab_result.prompts]
    return res


def test_layout_deepspec_same_tau_and_own_vocab_checked(zlab, zlab_result, ev, tmp_path):
    path = layouts.deepspec(zlab, tmp_path / "step_100", TARGET)
    _same_as_zlab(path, zlab, zlab_result, ev, "deepspec")
    # its own embedding / LM head copies must be the target's: a drafter trained against another target is refused
    other = layouts.deepspec(zlab, tmp_path / "other", qwen3_target(seed=9))
    with pytest.raises(CheckpointError, match=r"own (embed_tokens|lm_head)\.weight differs from the target.s"):
        ev.evaluate(other, SUITE, options=OPTS)
    # DSpark proper (a Markov head) and a confidence head are refused by name, before a target
    for field, value in (("markov_rank", 2), ("use_confidence_head", True)):
        bad = layouts.deepspec(zlab, tmp_path / f"bad-{field}", TARGET, **{field: value})
        with pytest.raises(CheckpointError, match=field):
            check_drafter_config(bad)


def test_layout_speculators_same_tau_and_refusals(zlab, zlab_result, ev, tmp_path):
    path = layouts.speculators(zlab, tmp_path / "spec", TARGET)
    _same_as_zlab(path, zlab, zlab_result, ev, "speculators")
    bad = layouts.speculators(zlab, tmp_path / "mapped", TARGET, draft_vocab_size=64)
    with pytest.raises(CheckpointError, match="draft_vocab_size"):  # a mapped draft vocabulary (d2t)
        check_drafter_config(bad)
    cfg = json.loads((path / "config.json").read_text())
    with pytest.raises(ConfigError, match="speculators_model_type=\"eagle3\""):
        DrafterConfig.from_dict({**cfg, "speculators_model_type": "eagle3"})
    inner = cfg["transformer_layer_config"]
    DrafterConfig.from_dict({**cfg, "transformer_layer_config": {**inner, "use_qk_norm": True}})  # Qwen3's own
    with pytest.raises(ConfigError, match="use_qk_norm=false"):
        DrafterConfig.from_dict({**cfg, "transformer_layer_config": {**inner, "use_qk_norm": False}})


def test_layout_vllm_same_tau_and_refusals(zlab, zlab_result, ev, tmp_path):
    path = layouts.vllm(zlab, tmp_path / "vllm", TARGET)
    _same_as_zlab(path, zlab, zlab_result, ev, "vllm")
    cfg = json.loads((path / "config.json").read_text())
    # dspark_target_layer_ids, the same +1 convention
    ids = cfg.pop("eagle_aux_hidden_state_layer_ids")
    assert DrafterConfig.from_dict({**cfg, "dspark_target_layer_ids": ids}).target_layer_ids == [-1, 1, 3]
    with pytest.raises(ConfigError, match=r"eagle_aux_hidden_state_layer_ids.*\[-1, 1, 3\].*says \[0, 1, 2\]"):
        DrafterConfig.from_dict({**cfg, "eagle_aux_hidden_state_layer_ids": ids,
                                 "dflash_config": {**cfg["dflash_config"], "target_layer_ids": [0, 1, 2]}})
    for change, name in ((dict(dflash_config={**cfg["dflash_config"], "attention_sink_bias": True}),
                          "dflash_config.attention_sink_bias=true"),
                          (dict(is_neox_style=False), "is_neox_style=false")):
        with pytest.raises(ConfigError, match=name):
            DrafterConfig.from_dict({**cfg, "eagle_aux_hidden_state_layer_ids": ids, **change})


def test_layout_automodel_same_tau_window_and_projector(zlab, zlab_result, ev, tmp_path):
    path = layouts.automodel(zlab, tmp_path / "automodel", TARGET)
    _same_as_zlab(path, zlab, zlab_result, ev, "automodel")
    cfg = json.loads((path / "config.json").read_text())
    windowed = DrafterConfig.from_dict({**cfg, "draft_sliding_window": 4})
    assert windowed.layer_types == ["sliding_attention"] * 2 and windowed.sliding_window == 4
    causal = DrafterConfig.from_dict({**cfg, "draft_sliding_window": 4,
                                      "dflash_config": {**cfg["dflash_config"], "causal": True}})
    assert causal.attention() == [(4, True)] * 2 and not causal.sliding_implicit
    with pytest.raises(ConfigError, match="dflash_config.projector_type"):
        DrafterConfig.from_dict({**cfg, "dflash_config": {**cfg["dflash_config"], "projector_type": "mlp"}})


# --- sliding windows: the rule named, warned about when implicit, chosen by the job ------------

@pytest.fixture(scope="module")
def sliding(tmp_path_factory):
    """One sliding layer, window 3 (< block 6, so the rule bites inside the block), no causal flag."""
    root = tmp_path_factory.mktemp("sliding")
    d = drafter_for(TARGET, block_size=6, layers=2, features=2, layer_types=["sliding_attention", "full_attention"],
                    sliding_window=3)
    save_drafter(fit_drafter(TARGET, d, references(TARGET, PROMPTS[:3], 24), [6, 6, 5], steps=30), root / "implicit")
    for name, flag in (("causal_false", False),):
        cfg = json.loads((root / "implicit" / "config.json").read_text())
        cfg["dflash_config"]["causal"] = flag
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(cfg))
        (root / name / "model.safetensors").write_bytes((root / "implicit" / "model.safetensors").read_bytes())
    return root


def test_sliding_rule_named_warned_and_chosen(sliding, ev, tmp_path):
    serving = ev.evaluate(sliding / "implicit", SUITE, options=OPTS)
    reference = ev.evaluate(sliding / "implicit", SUITE, options={**OPTS, "sliding_rule": "reference"})
    explicit = ev.evaluate(sliding / "causal_false", SUITE, options=OPTS)
    assert serving.settings["sliding_rule"].startswith("serving (implicit")
    assert reference.settings["sliding_rule"].startswith("reference (implicit")
    assert explicit.settings["sliding_rule"].startswith("config: causal=false")
    for res in (serving, reference):
        warning = [x for x in res.diagnostics if x.code == "SLIDING_RULE_IMPLICIT"]
        assert warning and warning[0].severity == "warning" and res.settings["sliding_rule"] in warning[0].message
    assert "SLIDING_RULE_IMPLICIT" not in explicit.diagnostic_codes()
    # the reference loop's rule is the explicit non-causal config, draft for draft; the serving rule differs
    assert [p.accept_lengths for p in reference.prompts] == [p.accept_lengths for p in explicit.prompts]
    assert [p.accept_lengths for p in serving.prompts] != [p.accept_lengths for p in reference.prompts]
    # an explicit config is not moved by the option
    again = ev.evaluate(sliding / "causal_false", SUITE, options={**OPTS, "sliding_rule": "serving"})
    assert [p.accept_lengths for p in again.prompts] == [p.accept_lengths for p in explicit.prompts]


def test_sliding_rule_stated_by_each_layout():
    base = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 8, "vocab_size": 96, "block_size": 6,
            "layer_types": ["sliding_attention", "full_attention"], "sliding_window": 3,
            "dflash_config": {"mask_token_id": 95, "target_layer_ids": [1, 3]}}
    implicit = DrafterConfig.from_dict(base)
    assert implicit.sliding_implicit and implicit.attention() == [(3, True), (None, False)]
    implicit.sliding_rule = "reference"
    assert implicit.attention() == [(3, False), (None, False)]
    spec = {"speculators_model_type": "dflash", "transformer_layer_config": {
        k: v for k, v in base.items() if k not in ("block_size", "dflash_config")}, "block_size": 6,
        "mask_token_id": 95, "aux_hidden_state_layer_ids": [2, 4]}
    for flag, attention in ((True, [(3, False), (None, False)]), (False, [(3, True), (None, False)])):
        cfg = DrafterConfig.from_dict({**spec, "sliding_window_non_causal": flag})
        assert not cfg.sliding_implicit and cfg.attention() == attention and cfg.attention_rule().startswith("config")
        cfg.sliding_rule = "reference" if not flag else "serving"  # the job's rule does not move a stated one
        assert cfg.attention() == attention
        assert DrafterConfig.from_dict(cfg.to_dict()).attention() == attention  # written so it reads back
    with pytest.raises(ConfigError, match="unknown sliding rule"):
        DrafterConfig.from_dict(base).__class__(**{**DrafterConfig.from_dict(base).__dict__,
                                                   "sliding_rule": "sdpa"}).attention()


def test_layout_vllm_mask_token_string_resolved_by_the_tokenizer(zlab, ev, tmp_path):
    """SGLang's dflash_config.mask_token ("<|MASK|>"): the id comes from the target's tokenizer."""
    from tests.support.factories import QWEN3_SPECIALS, byte_level_tokenizer

    cfg = json.loads((zlab / "config.json").read_text())
    dc = {k: v for k, v in cfg["dflash_config"].items() if k != "mask_token_id"}
    named = DrafterConfig.from_dict({**cfg, "vocab_size": 151936, "dflash_config": {**dc, "mask_token": "<|MASK|>"}})
    assert named.mask_token_id is None and named.mask_token == "<|MASK|>"
    tok = byte_level_tokenizer(tuple(QWEN3_SPECIALS.items()))
    named.resolve_mask_token(tok)
    assert named.mask_token_id == 151669
    for token, given, message in (("<|NOPE|>", None, "not a token of the target's tokenizer"),
                                  ("<|MASK|>", 151643,
                                   "is id 151669 in the target's tokenizer but mask_token_id says")):
        c = DrafterConfig.from_dict({**cfg, "vocab_size": 151936, "dflash_config": {
            **dc, "mask_token": token, **({"mask_token_id": given} if given is not None else {})}})
        with pytest.raises(ConfigError, match=message):
            c.resolve_mask_token(tok)
    # a target without a tokenizer cannot resolve it: said before drafting
    d = tmp_path / "named"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({**cfg, "dflash_config": {**dc, "mask_token": "<|MASK|>"}}))
    (d / "model.safetensors").write_bytes((zlab / "model.safetensors").read_bytes())
    with pytest.raises(CheckpointError, match="needs the target's tokenizer"):
        ev.evaluate(d, SUITE, options=OPTS)
