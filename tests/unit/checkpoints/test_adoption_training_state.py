"""Training-state files of other trainers, imported as they are written and evaluated: a hand-written
loop's `.pt` (model_state_dict + optimizer), SpecForge's training_state.pt, HF Trainer's checkpoint-N/,
DeepSpec's step_N/; read with torch.load(weights_only=True, mmap=True) only: a pickle with code is refused."""
from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_train.checkpoints.publication import CheckpointError, read_manifest, verify_checkpoint
from dflash_train.checkpoints.training_state import import_checkpoint, load_pt, step_from_name
from eval_worker.cli import main as cli
from tests.support import layouts
from tests.unit.checkpoints.test_adoption_layouts import OPTS, SUITE, TARGET, ev, zlab  # noqa: F401 - the fixtures too


@pytest.fixture(scope="module")
def zlab_tau(zlab, ev):
    res = ev.evaluate(zlab, SUITE, options=OPTS)
    assert res.tau["macro"] > 1.3
    return [p.accept_lengths for p in res.prompts]


def _adam_state(tensors: dict) -> dict:
    return {"state": {i: {"step": torch.tensor(7.0), "exp_avg": torch.randn_like(t), "exp_avg_sq": torch.rand_like(t)}
                      for i, t in enumerate(tensors.values())},
            "param_groups": [{"lr": 1e-4, "betas": (0.9, 0.95), "params": list(range(len(tensors)))}]}


def _import(tmp_path, source, *extra) -> dict:
    into = tmp_path / "records"
    rc = cli(["import", str(source), "--into", str(into), "--checkpoint-root", str(tmp_path), "--json", *extra])
    return rc


def _evaluated(ev, record, zlab_tau):
    res = ev.evaluate(record, SUITE, options=OPTS)
    assert [p.accept_lengths for p in res.prompts] == zlab_tau
    return res


def test_training_state_hand_written_pt_with_optimizer(zlab, ev, zlab_tau, tmp_path, capsys):
    sd = load_file(str(zlab / "model.safetensors"))
    state = {"model_state_dict": {f"module.{k}": v for k, v in sd.items()}, "optimizer_state_dict": _adam_state(sd),
             "scheduler_state_dict": {"last_epoch": 20000}, "step": 20000, "epoch": 3, "loss": 1.25,
             "args": {"lr": 1e-4, "name": "run-a"}}
    pt = tmp_path / "run-a" / "checkpoint_step20k.pt"
    pt.parent.mkdir()
    torch.save(state, pt)
    assert step_from_name(pt.name) == 20000
    # no config in the file and none given: named, not guessed
    assert _import(tmp_path, pt) == 2
    assert "--config" in capsys.readouterr().err
    assert _import(tmp_path, pt, "--config", str(zlab / "config.json")) == 0
    rec = json.loads(capsys.readouterr().out)["records"][0]
    assert rec["step"] == 20000 and rec["run_id"] == "run-a" and rec["created"]
    m = verify_checkpoint(rec["record"])
    assert m["imported_from"]["kind"] == "pt" and m["imported_from"]["path"] == str(pt)
    _evaluated(ev, rec["record"], zlab_tau)
    # again: the same record, nothing written
    assert _import(tmp_path, pt, "--config", str(zlab / "config.json")) == 0
    assert json.loads(capsys.readouterr().out)["records"][0]["created"] is False


def test_training_state_specforge_training_state_pt(zlab, ev, zlab_tau, tmp_path, capsys):
    sd = load_file(str(zlab / "model.safetensors"))
    d = tmp_path / "out" / "myrun-step40"
    d.mkdir(parents=True)
    torch.save({"model": {f"draft_model.{k}": v for k, v in sd.items()}, "optimizer": _adam_state(sd),
                "scheduler": {"last_epoch": 40}, "global_step": 40, "epoch": 0}, d / "training_state.pt")
    assert _import(tmp_path, d, "--config", str(zlab / "config.json")) == 0
    rec = json.loads(capsys.readouterr().out)["records"][0]
    assert rec["step"] == 40 and read_manifest(rec["record"])["imported_from"]["kind"] == "training_state"
    _evaluated(ev, rec["record"], zlab_tau)


def test_trainer_checkpoint_hf_checkpoint_n(zlab, ev, zlab_tau, tmp_path, capsys):
    """HF Trainer's checkpoint-N/: model.safetensors of the wrapper it trained, trainer_state.json, no config.json."""
    sd = load_file(str(zlab / "model.safetensors"))
    ck = tmp_path / "hf-out" / "checkpoint-10"
    ck.mkdir(parents=True)
    save_file({f"drafter.{k}": v for k, v in sd.items()}, str(ck / "model.safetensors"))
    (ck / "trainer_state.json").write_text(json.dumps({"global_step": 10, "log_history": []}))
    torch.save(_adam_state(sd), ck / "optimizer.pt")
    assert _import(tmp_path, ck) == 2
    err = capsys.readouterr().err
    assert "not in this checkpoint" in err and "--config" in err
    assert _import(tmp_path, ck, "--config", str(zlab / "config.json")) == 0
    rec = json.loads(capsys.readouterr().out)["records"][0]
    assert rec["step"] == 10 and rec["run_id"] == "hf-out"
    _evaluated(ev, rec["record"], zlab_tau)


def test_trainer_checkpoint_deepspec_step_dir(zlab, ev, zlab_tau, tmp_path):
    step = layouts.deepspec(zlab, tmp_path / "exp" / "step_300", TARGET)
    torch.save({"optimizer": _adam_state(load_file(str(zlab / "model.safetensors"))), "step": 300},
               step / "training_state.rank0.pt")
    record, created, facts = import_checkpoint(tmp_path / "records", "exp", None, step)
    assert created and facts["kind"] == "drafter_dir" and read_manifest(record)["step"] == 300
    _evaluated(ev, record, zlab_tau)


class Opaque:  # a config object pickled with the weights, as some loops do
    def __init__(self):
        self.lr = 1e-4


class Payload:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def test_training_state_pickle_with_code_is_refused(zlab, tmp_path, monkeypatch):
    sd = load_file(str(zlab / "model.safetensors"))
    monkeypatch.chdir(tmp_path)
    for name, extra in (("object.pt", Opaque()), ("payload.pt", Payload())):
        torch.save({"model_state_dict": sd, "config": extra}, tmp_path / name)
        with pytest.raises(CheckpointError, match="refused: reading it would run code"):
            load_pt(tmp_path / name)
        with pytest.raises(CheckpointError, match="refused"):
            import_checkpoint(tmp_path / "records", "r", 1, tmp_path / name, config=zlab / "config.json")
    assert not (tmp_path / "PWNED").exists()  # nothing ran
    assert not (tmp_path / "records").exists() or not any((tmp_path / "records").rglob("COMPLETE.json"))
    (tmp_path / "junk.pt").write_bytes(b"not a zip")
    with pytest.raises(CheckpointError, match="not a readable torch zip checkpoint"):
        load_pt(tmp_path / "junk.pt")


def test_trainer_checkpoint_deepspec_converted_keeps_its_vocab_check(zlab, ev, tmp_path):
    """A DeepSpec step_N/ converted (what watch and the DeepSpec hook do) still carries its own embedding /
    LM head, so a drafter trained against another target is still refused at eval time."""
    from tests.support.factories import qwen3_target

    other = layouts.deepspec(zlab, tmp_path / "exp" / "step_5", qwen3_target(seed=9))
    record, created, _ = import_checkpoint(tmp_path / "records", "exp", None, other, config=other / "config.json")
    assert created and read_manifest(record)["imported_from"]["kind"] == "drafter_dir"
    with pytest.raises(CheckpointError, match=r"own (embed_tokens|lm_head)\.weight differs from the target's"):
        ev.evaluate(record, SUITE, options=OPTS)


def test_trainer_checkpoint_wrapper_holding_the_target_needs_prefix(zlab, ev, zlab_tau, tmp_path, capsys):
    """An HF checkpoint of a wrapper that also saved the frozen target: the extra tensors are named,
    and --prefix takes the drafter's sub-tree."""
    sd = load_file(str(zlab / "model.safetensors"))
    ck = tmp_path / "wrap" / "checkpoint-7"
    ck.mkdir(parents=True)
    target_sd = {f"target.{k}": v.contiguous() for k, v in TARGET.model.state_dict().items()}
    save_file({**{f"draft_model.{k}": v for k, v in sd.items()}, **target_sd}, str(ck / "model.safetensors"))
    (ck / "trainer_state.json").write_text(json.dumps({"global_step": 7}))
    assert _import(tmp_path, ck, "--config", str(zlab / "config.json")) == 2
    assert "unknown tensor" in capsys.readouterr().err
    assert _import(tmp_path, ck, "--config", str(zlab / "config.json"), "--prefix", "nope.") == 2
    assert "no tensor under prefix 'nope.'" in capsys.readouterr().err
    assert _import(tmp_path, ck, "--config", str(zlab / "config.json"), "--prefix", "draft_model.") == 0
    rec = json.loads(capsys.readouterr().out)["records"][0]
    assert rec["step"] == 7 and read_manifest(rec["record"])["imported_from"]["prefix"] == "draft_model."
    _evaluated(ev, rec["record"], zlab_tau)
