"""docs/adoption.md: the one command (or line) per trainer, run as written (placeholders filled in) against
checkpoints laid out as each trainer writes them, on a real redis-server queue."""
from __future__ import annotations

import json
import os
import re
import shlex
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_train.checkpoints.checkpoint import save_drafter
from eval_worker.cli import main as cli
from eval_worker.redis_client import connect
from eval_worker.service.queueing.queue import get_queue
from tests.support import layouts
from tests.support.factories import drafter_for, qwen3_target

DOC = Path(__file__).resolve().parents[2] / "docs" / "adoption.md"
TARGET = qwen3_target(layers=6, hidden=32)


def blocks() -> dict[str, str]:
    text = DOC.read_text()
    return {m.group(1): m.group(2).strip() for m in
            re.finditer(r"<!-- tested: (\w+) -->\n```\w+\n(.*?)\n```", text, re.S)}


def test_adoption_doc_names_every_trainer():
    assert set(blocks()) == {"loop", "hf_trainer", "specforge", "deepspec_hook", "deepspec_watch", "speculators",
                             "automodel"}


@pytest.fixture
def env(tmp_path, redis_url, monkeypatch):
    root = tmp_path / "ckpts"
    root.mkdir()
    monkeypatch.setenv("REDIS_URL", redis_url)
    monkeypatch.setenv("DFLASH_CHECKPOINT_ROOTS", os.pathsep.join([str(root), str(tmp_path)]))
    zdir = tmp_path / "zlab"
    save_drafter(drafter_for(TARGET, layers=1, features=2), zdir)
    (tmp_path / "target").mkdir()
    return {"tmp": tmp_path, "zdir": zdir, "sd": load_file(str(zdir / "model.safetensors")), "redis": redis_url,
            "fill": {"CONFIG_JSON": str(zdir / "config.json"), "TARGET": str(tmp_path / "target")}}


def _run(key, env, **paths) -> None:
    """The documented command with its placeholders filled; `watch` scanned twice (--once --settle 0)."""
    argv = shlex.split(blocks()[key])
    assert argv[0] == "dflash-eval"
    fill = {**env["fill"], **{k: str(v) for k, v in paths.items()}}
    argv = [fill.get(a, a) for a in argv[1:]]
    assert not [a for a in argv if re.fullmatch(r"[A-Z_]+", a)], argv  # every placeholder filled
    for _ in range(2 if argv[0] == "watch" else 1):
        assert cli(argv + (["--once", "--settle", "0"] if argv[0] == "watch" else [])) == 0


def _jobs(env):
    return sorted((j.args[0]["run_id"], j.args[0]["step"], j.args[0]["target"])
                  for j in get_queue(connect(env["redis"]), "dflash-eval").jobs)


def test_adoption_doc_hand_written_loop(env):
    run = env["tmp"] / "loop-run"
    run.mkdir()
    torch.save({"model_state_dict": env["sd"], "optimizer_state_dict": {"state": {}}, "step": 20000},
               run / "checkpoint_step20k.pt")
    _run("loop", env, RUN_DIR=run)
    assert _jobs(env) == [("loop-run", 20000, env["fill"]["TARGET"])]


def test_adoption_doc_hf_trainer(env):
    out = env["tmp"] / "hf-out"
    (out / "checkpoint-10").mkdir(parents=True)
    save_file({f"model.{k}": v for k, v in env["sd"].items()}, str(out / "checkpoint-10" / "model.safetensors"))
    (out / "checkpoint-10" / "trainer_state.json").write_text(json.dumps({"global_step": 10}))
    _run("hf_trainer", env, OUTPUT_DIR=out)
    assert _jobs(env) == [("hf-out", 10, env["fill"]["TARGET"])]


def test_adoption_doc_specforge(env):
    out = env["tmp"] / "sf-out"
    (out / "sf-step40").mkdir(parents=True)
    torch.save({"model": {f"draft_model.{k}": v for k, v in env["sd"].items()}, "optimizer": {}, "global_step": 40},
               out / "sf-step40" / "training_state.pt")
    _run("specforge", env, OUTPUT_DIR=out)
    assert _jobs(env) == [("sf-out", 40, env["fill"]["TARGET"])]


def test_adoption_doc_deepspec_hook_and_watch(env, capsys):
    exp = env["tmp"] / "exp1"
    step = layouts.deepspec(env["zdir"], exp / "step_300", TARGET)

    class BaseTrainer:  # DeepSpec's, with its empty hook
        def _launch_eval(self, target_model_name_or_path, checkpoint_dir, step, tensorboard_dir, exp_name):
            print("You can use this function to launch your auto eval script!")

    namespace = {"BaseTrainer": BaseTrainer}
    exec(blocks()["deepspec_hook"], namespace)  # the documented line, as written
    BaseTrainer()._launch_eval(env["fill"]["TARGET"], str(step), 300, str(exp / "tb"), "exp1")
    assert "[dflash-eval] step 300: enqueued" in capsys.readouterr().out
    assert _jobs(env) == [("exp1", 300, env["fill"]["TARGET"])]
    # without touching DeepSpec: follow the experiment (step_latest marks what is complete)
    layouts.deepspec(env["zdir"], exp / "step_600", TARGET)
    os.symlink("step_300", exp / "step_latest")
    _run("deepspec_watch", env, EXP_DIR=exp)
    assert _jobs(env) == [("exp1", 300, env["fill"]["TARGET"])]  # step 600 is still being written
    os.remove(exp / "step_latest")
    os.symlink("step_600", exp / "step_latest")
    _run("deepspec_watch", env, EXP_DIR=exp)
    assert _jobs(env) == [("exp1", 300, env["fill"]["TARGET"]), ("exp1", 600, env["fill"]["TARGET"])]


def test_adoption_doc_speculators(env):
    save = env["tmp"] / "spec-save"
    layouts.speculators(env["zdir"], save / "3", TARGET)
    _run("speculators", env, SAVE_DIR=save)
    assert _jobs(env) == [("spec-save", 3, env["fill"]["TARGET"])]


def test_adoption_doc_automodel(env):
    d = layouts.automodel(env["zdir"], env["tmp"] / "automodel-drafter", TARGET, draft_sliding_window=64)
    _run("automodel", env, DRAFTER_DIR=d)
    assert _jobs(env) == [("automodel-drafter", 0, env["fill"]["TARGET"])]
