"""Config files, flags and the `dflash-train` entry point."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_train.cli import main
from dflash_train.train_config import TrainConfig, TrainConfigError, load_config

REPO = Path(__file__).resolve().parents[1]


def test_yaml_json_and_overrides(tmp_path):
    y = tmp_path / "c.yaml"
    y.write_text("max_steps: 50\nlr: 1.0e-3\nwandb: yes\ntarget_layer_ids: [1, 3]\n")
    c = load_config(y, {"max_steps": "70", "queue_depth": 0})
    assert (c.max_steps, c.lr, c.wandb, c.target_layer_ids, c.queue_depth) == (70, 1e-3, True, [1, 3], 0)
    j = tmp_path / "c.json"
    j.write_text(json.dumps({"batch_size": 4, "adam_betas": [0.8, 0.9]}))
    c = TrainConfig.from_file(j, {"target_layer_ids": "2,4"})
    assert c.batch_size == 4 and c.adam_betas == [0.8, 0.9] and c.target_layer_ids == [2, 4]


@pytest.mark.parametrize("text,match", [
    ("max_stepz: 5\n", "unknown train config keys: max_stepz"),
    ("max_steps: 2.5\n", "max_steps"),
    ("max_steps: 0\n", "max_steps must be >= 1"),
    ("loss_type: kl\n", "loss_type"),
    ("wandb: maybe\n", "wandb"),
    ("- a list\n", "mapping"),
])
def test_bad_configs_are_clear_errors(tmp_path, text, match):
    p = tmp_path / "bad.yaml"
    p.write_text(text)
    with pytest.raises(TrainConfigError, match=match):
        load_config(p)


@pytest.mark.parametrize("name", ["demo", "long"])
def test_bundled_configs_parse(name):
    c = load_config(name)
    assert c.target == "builtin:tiny-target" and c.max_steps > 0 and c.publish_every <= c.max_steps


def test_every_option_is_a_flag(capsys):
    assert main(["--config", "demo", "--max-steps", "7", "--no-progress", "--target-layer-ids", "1,2",
                 "--run-id", "x", "--gamma", "3.5", "--print-config"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["max_steps"] == 7 and out["progress"] is False and out["target_layer_ids"] == [1, 2]
    assert out["run_id"] == "x" and out["gamma"] == 3.5
    assert main(["--config", "demo", "--max-steps", "zero", "--print-config"]) == 2
    assert "cannot use 'zero'" in capsys.readouterr().err


def test_cli_trains_and_publishes(tmp_path, tiny_target_path):
    """`python -m dflash_train` end to end on the bundled target: a few steps, one checkpoint."""
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps({"text": "def add(a, b):\n    return a + b\n" * (i + 2)}) for i in range(8)))
    cmd = [sys.executable, "-m", "dflash_train", "--config", "demo", "--data", str(data), "--max-steps", "3",
           "--batch-size", "4", "--num-anchors", "4", "--publish-every", "3", "--checkpoint-root", str(tmp_path / "ck"),
           "--run-id", "cli", "--queue-depth", "1", "--no-progress", "--num-threads", "1"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    from dflash_train.checkpoint import load_drafter
    from dflash_train.publication import read_manifest
    path = tmp_path / "ck" / "cli" / "step-00000003"
    assert read_manifest(path)["step"] == 3
    assert load_drafter(path).config.block_size == 16
    assert (tmp_path / "ck" / "cli" / "train_state" / "state-00000003.pt").is_file()
    assert "done: step 3" in proc.stderr


@pytest.mark.slow
def test_torchrun_two_ranks_cli(tmp_path, tiny_target_path):
    """`torchrun --nproc-per-node 2 -m dflash_train`: gloo on CPU, rank 0 publishes, ranks agree."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(port), "-m", "dflash_train", "--config", "demo", "--max-steps", "4",
           "--num-prompts", "16", "--max-new-tokens", "32", "--batch-size", "4", "--num-anchors", "4",
           "--publish-every", "2", "--checkpoint-root", str(tmp_path), "--run-id", "ddp", "--no-progress",
           "--num-threads", "1"]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    from dflash_train.publication import list_checkpoints
    assert [p.name for p in list_checkpoints(tmp_path / "ddp")] == ["step-00000002", "step-00000004"]
