"""`dflash-eval watch`: a directory fed by a fake trainer (checkpoints appear mid-write, the watcher
restarts, one checkpoint is deleted before its eval) ends with exactly one job per complete checkpoint,
on a real redis-server queue."""
from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file

from dflash_train.checkpoints.checkpoint import save_drafter
from eval_worker.cli import main as cli
from eval_worker.redis_client import connect
from eval_worker.service.queueing.queue import get_queue, queue_name
from hooks.watch import Watcher
from tests.support.factories import drafter_for, qwen3_target


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def _hf_checkpoint(out, step, sd, complete=True):
    ck = out / f"checkpoint-{step}"
    ck.mkdir(parents=True)
    save_file({f"drafter.{k}": v for k, v in sd.items()}, str(ck / "model.safetensors"))
    if complete:
        (ck / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    return ck


def _jobs(redis_url):
    q = get_queue(connect(redis_url), queue_name("dflash-eval", "default"))
    return sorted((j.meta["run_id"], j.meta["step"]) for j in q.get_jobs())


def test_watch_fake_trainer_restart_and_deletion(tmp_path, redis_url, capsys):
    zdir = tmp_path / "cfg"
    save_drafter(drafter_for(qwen3_target(layers=6, hidden=32), layers=1, features=2), zdir)
    sd = load_file(str(zdir / "model.safetensors"))
    out, into = tmp_path / "train" / "run-x", tmp_path / "ckpts"
    args = ["watch", str(out), "--into", str(into), "--checkpoint-root", str(tmp_path), "--config",
            str(zdir / "config.json"), "--redis-url", redis_url, "--once", "--suite", "builtin:coding-v1"]
    # checkpoint-10 mid-write (no trainer_state.json yet): nothing
    _hf_checkpoint(out, 10, sd, complete=False)
    assert cli(args) == 0 and _jobs(redis_url) == []
    (out / "checkpoint-10" / "trainer_state.json").write_text(json.dumps({"global_step": 10}))
    assert cli(args) == 0
    assert "queued   " in capsys.readouterr().out and _jobs(redis_url) == [("run-x", 10)]
    # restarts: nothing twice; what appeared while down is picked up
    _hf_checkpoint(out, 20, sd)
    _hf_checkpoint(out, 30, sd)
    assert cli(args) == 0 and cli(args) == 0
    assert _jobs(redis_url) == [("run-x", 10), ("run-x", 20), ("run-x", 30)]
    # the trainer's retention deletes its own copies: the queued jobs read our converted checkpoints
    shutil.rmtree(out / "checkpoint-10")
    for rec in (into / "run-x").glob("step-*"):
        assert (rec / "COMPLETE.json").exists() and (rec / "model.safetensors").exists()

    # plain files settle; one deleted before it was complete is a visible skip; a restart mid-way
    lines, clock = [], Clock()
    submitted = []

    def watcher():
        return Watcher(out, into, submit=lambda r: submitted.append(r) or "ok", config=zdir / "config.json",
                       settle=30, log=lines.append, clock=clock)

    w = watcher()
    pt = out / "loop_step40.pt"
    torch.save({"model_state_dict": sd, "step": 40}, pt)
    torch.save({"model_state_dict": sd, "step": 50}, out / "loop_step50.pt")
    assert w.scan() == []  # first sight
    clock.now += 10
    with open(pt, "ab") as f:  # still being written
        f.write(b"")
    os.utime(pt, ns=(pt.stat().st_atime_ns, pt.stat().st_mtime_ns + 5_000_000))
    assert w.scan() == []
    clock.now += 25  # loop_step50 has settled (35 s), loop_step40 changed 25 s ago
    events = w.scan()
    assert [(e["status"], e["step"]) for e in events] == [("queued", 50)]
    os.remove(out / "loop_step50.pt")  # already converted: nothing lost
    os.remove(pt)  # deleted before it was complete
    events = w.scan()
    assert [(e["status"], e["checkpoint"]) for e in events] == [("skipped", str(pt))]
    assert "deleted before it was complete" in lines[-1]
    w2 = watcher()  # restart: the state file says what was done
    torch.save({"model_state_dict": sd, "step": 60}, out / "loop_step60.pt")
    assert w2.scan() == []
    clock.now += 31
    assert [(e["status"], e["step"]) for e in w2.scan()] == [("queued", 60)]
    assert w2.scan() == [] and len(submitted) == 2
    assert [p.name for p in submitted] == ["step-00000050", "step-00000060"]
    assert len(lines) == 3  # one line per checkpoint handled


def test_watch_deepspec_step_latest_rule(tmp_path):
    exp = tmp_path / "exp"
    for n in (50, 60):
        (exp / f"step_{n}").mkdir(parents=True)
    os.symlink("step_50", exp / "step_latest")
    w = Watcher(exp, tmp_path / "into", submit=lambda r: "ok", log=lambda line: None)
    assert w.complete(exp / "step_50") and not w.complete(exp / "step_60")
    os.remove(exp / "step_latest")
    os.symlink("step_60", exp / "step_latest")
    assert w.complete(exp / "step_60")


def test_watch_deepspec_launch_eval_drop_in(tmp_path, redis_url, monkeypatch, capsys):
    """DeepSpec's `_launch_eval(target, checkpoint_dir, step, tensorboard_dir, exp_name)` body: queued with its step."""
    from hooks.deepspec import launch_eval
    from tests.support import layouts

    target = qwen3_target(layers=6, hidden=32)
    zdir = tmp_path / "z"
    save_drafter(drafter_for(target, layers=1, features=2), zdir)
    step = layouts.deepspec(zdir, tmp_path / "exp1" / "step_300", target)
    monkeypatch.setenv("DFLASH_CHECKPOINT_ROOTS", str(tmp_path / "ckpts"))
    (tmp_path / "ckpts").mkdir()
    line = launch_eval(str(tmp_path / "target"), str(step), 300, str(tmp_path / "tb"), "exp1", redis_url=redis_url)
    assert line.startswith("[dflash-eval] step 300: enqueued") and line in capsys.readouterr().out
    assert _jobs(redis_url) == [("exp1", 300)]
    shutil.rmtree(step)  # DeepSpec's retention: our converted copy stays for the eval
    assert (tmp_path / "ckpts" / "exp1" / "step-00000300" / "model.safetensors").exists()
    # a failure is printed, never raised into training
    bad = launch_eval("t", str(tmp_path / "missing"), 400, None, "exp1", redis_url=redis_url)
    assert "eval not queued" in bad and _jobs(redis_url) == [("exp1", 300)]


def test_watch_an_object_store_run_prefix(tmp_path, redis_url, s3_server, monkeypatch, capsys):
    """`dflash-eval watch s3://...`: each published checkpoint (marker written last) queued once, across restarts."""
    from dflash_train.checkpoints.publication import upload_checkpoint
    from tests.support.sidecar_support import publish_random

    s3_server.make_bucket("watched")
    monkeypatch.setenv("DFLASH_HOME", str(tmp_path / "home"))
    run_url = "s3://watched/runs/run1"
    for step in (1, 2):
        upload_checkpoint(publish_random(tmp_path / "ck", "run1", step, seed=step), run_url)
    args = ["watch", run_url, "--checkpoint-root", "s3://watched/runs", "--redis-url", redis_url, "--once"]
    assert cli(args) == 0 and cli(args) == 0
    assert _jobs(redis_url) == [("run1", 1), ("run1", 2)]
    upload_checkpoint(publish_random(tmp_path / "ck", "run1", 3, seed=3), run_url)
    assert cli(args + ["--every", "3"]) == 0
    assert _jobs(redis_url) == [("run1", 1), ("run1", 2), ("run1", 3)]
    assert capsys.readouterr().out.count("queued   s3://watched/runs/run1/step-") == 3  # one line each
