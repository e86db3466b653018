"""Bad input gives one clear error naming the problem (and nothing is evaluated)."""
import json

import pytest
from safetensors.torch import load_file, save_file

from dflash_train.checkpoints.checkpoint import publish_checkpoint, save_drafter
from dflash_train.checkpoints.publication import CheckpointError
from dflash_train.core.config import DrafterConfig
from dflash_train.core.model import DFlashDrafter
from dflash_train.core.target import TargetError
from eval_worker.engine.acceptance import Evaluator
from eval_worker.engine.suite import Prompt, Suite, SuiteError
from tests.support.factories import MASK_ID, drafter_for, qwen3_target

TARGET = qwen3_target(seed=7)
SUITE = Suite("e", "1", [Prompt("a", ids=(1, 2, 3, 4))], chat_template=False, max_new_tokens=8)
OPTS = {"measure_speed": False}


@pytest.fixture
def ev():
    return Evaluator(TARGET, None)


@pytest.fixture
def good(tmp_path):
    save_drafter(drafter_for(TARGET, block_size=4), tmp_path / "good")
    return tmp_path / "good"


def test_missing_and_partial_checkpoints(ev, good, tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        ev.evaluate(tmp_path / "nope", SUITE, options=OPTS)
    tmp = tmp_path / ".step-00000100.tmp-123"
    tmp.mkdir()
    with pytest.raises(CheckpointError, match="temporary publish directory"):
        ev.evaluate(tmp, SUITE, options=OPTS)
    step = tmp_path / "run" / "step-00000100"
    save_drafter(drafter_for(TARGET, block_size=4), step)  # renamed into place, marker never written
    with pytest.raises(CheckpointError, match="without COMPLETE.json"):
        ev.evaluate(step, SUITE, options=OPTS)
    (tmp_path / "cfg_only").mkdir()
    (tmp_path / "cfg_only" / "config.json").write_text((good / "config.json").read_text())
    with pytest.raises(CheckpointError, match="missing model.safetensors"):
        ev.evaluate(tmp_path / "cfg_only", SUITE, options=OPTS)
    (tmp_path / "file").write_text("x")
    with pytest.raises(CheckpointError, match="not a directory"):
        ev.evaluate(tmp_path / "file", SUITE, options=OPTS)


def test_published_checkpoint_is_verified(ev, tmp_path):
    path = publish_checkpoint(drafter_for(TARGET, block_size=4), tmp_path / "ckpts", "run1", 100,
                              train_metrics={"accuracy": 0.1})
    res = ev.evaluate(path, SUITE, options=OPTS)
    manifest = json.loads((path / "COMPLETE.json").read_text())
    assert res.checkpoint == {"path": str(path.resolve()), "digest": manifest["digest"], "run_id": "run1", "step": 100}
    t = load_file(str(path / "model.safetensors"))
    t["fc.weight"] = t["fc.weight"] + 1
    save_file(t, str(path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="digest"):
        ev.evaluate(path, SUITE, options=OPTS)


def test_wrong_shapes_and_truncated_weights(ev, good, tmp_path):
    t = load_file(str(good / "model.safetensors"))
    t["fc.weight"] = t["fc.weight"][:, :-1].contiguous()
    save_file(t, str(good / "model.safetensors"))
    with pytest.raises(CheckpointError, match="wrong shapes: fc.weight"):
        ev.evaluate(good, SUITE, options=OPTS)
    data = (good / "model.safetensors").read_bytes()
    (good / "model.safetensors").write_bytes(data[: len(data) // 3])
    with pytest.raises(CheckpointError, match="corrupt or truncated"):
        ev.evaluate(good, SUITE, options=OPTS)


def test_drafter_for_another_target(ev, tmp_path):
    other = qwen3_target(layers=4, hidden=32)
    save_drafter(drafter_for(other, block_size=4, features=1), tmp_path / "d")
    with pytest.raises(TargetError, match="built for a 4-layer target, this one has 6"):
        ev.evaluate(tmp_path / "d", SUITE, options=OPTS)


def test_mask_token_outside_the_vocabulary(ev, tmp_path):
    cfg = DrafterConfig.for_target(TARGET.model.config, mask_token_id=MASK_ID, num_hidden_layers=1, block_size=4)
    cfg.vocab_size, cfg.mask_token_id = cfg.vocab_size + 10, cfg.vocab_size + 5  # a mask row the target lacks
    save_drafter(DFlashDrafter(cfg), tmp_path / "d")
    with pytest.raises(TargetError, match="mask_token_id 101 is outside the target's embedding"):
        ev.evaluate(tmp_path / "d", SUITE, options=OPTS)
    conf = json.loads((tmp_path / "d" / "config.json").read_text())
    conf["dflash_config"]["mask_token_id"] = 500
    (tmp_path / "d" / "config.json").write_text(json.dumps(conf))
    with pytest.raises(CheckpointError, match="mask_token_id 500 outside the vocabulary"):
        ev.evaluate(tmp_path / "d", SUITE, options=OPTS)


def test_empty_suite_bad_prompt_ids_and_options(ev, good, tmp_path):
    f = tmp_path / "empty.jsonl"
    f.write_text(json.dumps({"suite": "empty"}) + "\n")
    with pytest.raises(SuiteError, match="empty"):
        ev.evaluate(good, str(f), options=OPTS)
    with pytest.raises(SuiteError, match=r"token ids \[500\] outside the vocabulary"):
        ev.evaluate(good, Suite("e", "1", [Prompt("a", ids=(1, 500))]), options=OPTS)
    with pytest.raises(ValueError, match="unknown eval options \\['max_new'\\]"):
        ev.evaluate(good, SUITE, options={"max_new": 3})
    with pytest.raises(ValueError, match="mode must be"):
        ev.evaluate(good, SUITE, options={"mode": "greedy"})
    with pytest.raises(SuiteError, match="no tokenizer"):
        ev.evaluate(good, Suite("t", "1", [Prompt("a", prompt="text")]), options=OPTS)


def test_cli_reports_errors_without_a_traceback(good, tmp_path, capsys):
    from eval_worker.cli import main

    rc = main(["run", "--checkpoint", str(good), "--target", str(tmp_path / "no_target"), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "error:" in err and "no_target" in err and "Traceback" not in err
    rc = main(["run", "--checkpoint", str(tmp_path / "nope"), "--target", str(tmp_path / "no_target"),
               "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "nope" in err and "does not exist" in err  # the drafter is checked first


def test_drafter_config_is_validated_completely_before_the_target_loads(good, tmp_path, capsys, monkeypatch):
    from dflash_train.core.target import Target
    from eval_worker.cli import main

    cfg = json.loads((good / "config.json").read_text())
    cfg["attention_bias"] = True
    cfg["dflash_config"]["projector_type"] = "domino"
    (good / "config.json").write_text(json.dumps(cfg))
    loads = []
    monkeypatch.setattr(Target, "load", classmethod(lambda cls, *a, **k: loads.append(a) or TARGET))
    rc = main(["run", "--checkpoint", str(good), "--target", str(tmp_path / "some_target"), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "attention_bias=true" in err and "dflash_config.projector_type" in err
    assert loads == []  # refused before any target was loaded


def test_non_finite_drafter_weights_are_refused(ev, tmp_path):
    import torch

    bad = drafter_for(TARGET, block_size=4)
    with torch.no_grad():
        bad.layers[0].mlp.up_proj.weight[3, 1] = float("nan")
        bad.fc.weight[0, 0] = float("inf")
    save_drafter(bad, tmp_path / "nan")
    with pytest.raises(CheckpointError, match=r"non-finite weights \(NaN/Inf\) in 2 tensor\(s\): fc.weight \(1 of "
                                              r"\d+\), layers.0.mlp.up_proj.weight \(1 of \d+\)"):
        ev.evaluate(tmp_path / "nan", SUITE, options=OPTS)
