"""Config files, flags and the `dflash-train` entry point."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_train.training.cli import main
from dflash_train.training.train_config import TrainConfig, TrainConfigError, load_config

REPO = Path(__file__).resolve().parents[3]


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
    from dflash_train.checkpoints.checkpoint import load_drafter
    from dflash_train.checkpoints.publication import read_manifest
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
    from dflash_train.checkpoints.publication import list_checkpoints
    assert [p.name for p in list_checkpoints(tmp_path / "ddp")] == ["step-00000002", "step-00000004"]


def test_every_flag_has_help_text():
    """`dflash-train --help`: no flag without a description (argparse's own --help aside)."""
    from dflash_train.training.cli import build_parser

    parser = build_parser()
    empty = [a.option_strings for a in parser._actions if a.option_strings and not (a.help or "").strip()]
    assert empty == []
    text = parser.format_help()
    for flag in ("--eval-every", "--eval-suite", "--eval-baseline", "--eval-target", "--redis-url", "--max-steps"):
        assert flag in text
    # the help of a field is the config's own, and says its default
    assert "publish a checkpoint for evaluation every N steps" in text and "(default: 100)" in text
    # each flag states its default once: the config's built-in one, not argparse's None as well
    twice = [a.option_strings for a in parser._actions if (a.help or "").count("default") > 1]
    assert twice == [] and "(default: None)" not in text
    proc = subprocess.run([sys.executable, "-m", "dflash_train", "--help"], cwd=REPO, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and "--eval-every" in proc.stdout


def test_eval_flags_reach_the_config(capsys):
    assert main(["--config", "demo", "--eval-every", "50", "--eval-suite", "builtin:coding-v1,hf:gsm8k:n=8",
                 "--eval-baseline", "/drafters/zlab", "--print-config"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["eval_every"] == 50 and out["eval_suite"] == ["builtin:coding-v1", "hf:gsm8k:n=8"]
    assert out["eval_baseline"] == "/drafters/zlab"
    assert main(["--config", "demo", "--eval-every", "0", "--print-config"]) == 2
    assert "eval_every must be >= 1" in capsys.readouterr().err


def _torchrun(tmp_path, *args, timeout=420):
    """torchrun with 2 CPU ranks in its own process group (killed whole on a timeout); each rank's
    stdout/stderr in its own file under tmp_path/logs (torchrun --redirects 3)."""
    import os
    import signal
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(port), "--log-dir", str(tmp_path / "logs"), "--redirects", "3",
           "-m", "dflash_train", *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    ranks = {}
    for r in (0, 1):
        files = list((tmp_path / "logs").rglob(f"attempt_0/{r}/stderr.log"))
        ranks[r] = (files[0].read_text() if files else "") + "".join(
            p.read_text() for p in (tmp_path / "logs").rglob(f"attempt_0/{r}/stdout.log"))
    return proc.returncode, out + err, ranks


@pytest.mark.slow  # ~10-25 s: CI's slow pass (the default suite stays under 10 min on 2 cores)
def test_torchrun_two_ranks_rank0_alone_reports(tmp_path, tiny_target_path):
    """Under `torchrun --nproc-per-node 2` only rank 0 shows progress and prints `done:`, with the
    global figures (the same loss rank 0 logged for the last step, summed over both ranks)."""
    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps({"text": "def add(a, b):\n    return a + b\n" * (i + 2)}) for i in range(8)))
    code, combined, ranks = _torchrun(
        tmp_path, "--config", "demo", "--data", str(data), "--max-steps", "2", "--batch-size", "4",
        "--num-anchors", "4", "--publish-every", "2", "--checkpoint-root", str(tmp_path / "ck"), "--run-id", "ddp",
        "--queue-depth", "0", "--num-threads", "1", "--log-every", "1", "--progress", "--progress-every-s", "0")
    assert code == 0, combined[-3000:]
    r0, r1 = ranks[0], ranks[1]
    assert r0.count("done: step 2") == 1 and "done:" not in r1
    assert "train ddp: 1/2 steps" in r0 and "train ddp" not in r1  # progress lines: rank 0 only
    assert "all 2 rank(s)" in r0
    import re
    last_logged = re.findall(r"step 2 loss ([\d.]+) acc ([\d.]+)", r0)
    done = re.search(r"done: step 2, loss ([\d.]+), acc ([\d.]+)", r0)
    assert last_logged and done and done.groups() == last_logged[-1]
    assert r1.strip() == "" or "WARNING" in r1 or "Warning" in r1, r1[-2000:]  # nothing but warnings


def test_eval_every_queues_one_job_per_suite(tmp_path, tiny_target_path, redis_url):
    """`--eval-every` wires the EvalOnCheckpoint hook: every 2nd step's checkpoint, each suite, on the queue."""
    from eval_worker.redis_client import connect
    from eval_worker.service.queueing.queue import status

    data = tmp_path / "data.jsonl"
    data.write_text("\n".join(json.dumps({"text": "def add(a, b):\n    return a + b\n" * (i + 2)}) for i in range(8)))
    suite = tmp_path / "s.jsonl"
    suite.write_text('{"suite": "mine"}\n{"name": "a", "prompt": "def f():"}\n')
    assert main(["--config", "demo", "--data", str(data), "--max-steps", "4", "--batch-size", "4", "--num-anchors", "4",
                 "--publish-every", "1", "--checkpoint-root", str(tmp_path / "ck"), "--run-id", "wired",
                 "--queue-depth", "0", "--no-progress", "--num-threads", "1", "--eval-every", "2",
                 "--eval-suite", f"builtin:coding-v1,{suite}", "--eval-target", str(tiny_target_path),
                 "--redis-url", redis_url]) == 0
    conn = connect(redis_url)
    try:
        queued = status(conn, run="wired")["queued"]
    finally:
        conn.close()
    assert sorted((j["step"], j["suite"]) for j in queued) == sorted(
        (step, s) for step in (2, 4) for s in ("builtin:coding-v1", str(suite)))


def test_the_eval_hook_is_a_plugin_the_hooks_package_registers():
    """dflash-train finds the eval hook by name through packaging metadata, never by importing hooks itself."""
    from dflash_train.training.callbacks import load_plugin
    from hooks.eval_flags import eval_hook

    assert load_plugin("eval") is eval_hook
    with pytest.raises(LookupError, match="no 'nope' callback plug-in is installed"):
        load_plugin("nope")
