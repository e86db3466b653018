"""`dflash-eval publish`: rebuild the eval run from the ledger, also after a W&B outage.

(tests/unit/checkpoints/test_publish.py is the trainer's checkpoint-publication test.)
"""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash_train.common.settings import Settings
from eval_worker.results.ledger import read_record
from eval_worker.results.sinks import publish_result
from eval_worker.results.sinks.names import scalars
from tests.support.eval_results import fake_checkpoint, make_result, write_ledger
from tests.support.wandb_reader import read_run

REPO = Path(__file__).resolve().parents[2]


def dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again: nothing listens there


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "eval_worker.cli", *args], capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})}, timeout=180)


@pytest.fixture
def ledger(tmp_path, wandb_offline, monkeypatch):
    results = tmp_path / "results"
    monkeypatch.setenv("DFLASH_RESULTS_DIR", str(results))

    def add(run_id: str, step: int, p: float, **kw) -> tuple[dict, dict]:
        _, digest = fake_checkpoint(tmp_path / "ckpt", run_id, step)
        res = make_result(run_id, step, p=p, checkpoint_root=str(tmp_path / "ckpt"), digest=digest, **kw)
        return read_record(write_ledger(results, res)), res

    add.results = results
    add.wandb = wandb_offline
    return add


@pytest.mark.slow  # ~10-25 s: CI's slow pass (the default suite stays under 10 min on 2 cores)
def test_worker_carries_on_through_a_wandb_outage_and_publish_reproduces_every_point(ledger, redis_url, tmp_path):
    """A real worker with W&B "online" at a dead 127.0.0.1 port: the sink fails fast, every job
    still finishes and is in the ledger; `publish --mode offline` then rebuilds every point."""
    from eval_worker.redis_client import connect
    from eval_worker.service.jobs.builder import make_job
    from eval_worker.service.queueing.client import enqueue
    from eval_worker.service.queueing.queue import fetch_job

    port = dead_port()
    ckpt, target = tmp_path / "ckpt", tmp_path / "target"
    target.mkdir()
    conn = connect(redis_url)
    job_ids = []
    for step in (200, 100, 300):  # out of order, as re-queued checkpoints arrive
        ck, _ = fake_checkpoint(ckpt, "run-o", step)
        job = make_job(ck, suite="builtin:coding-v1", target=target,
                       wandb={"project": "dflash-eval", "group": "run-o", "entity": None, "mode": "online"})
        outcome = enqueue(conn, job, roots=[ckpt])
        assert outcome.enqueued
        job_ids.append(outcome.job_id)
    env = {"WANDB_MODE": "online", "WANDB_BASE_URL": f"http://127.0.0.1:{port}", "WANDB_API_KEY": "k" * 40,
           "DFLASH_WANDB_INIT_TIMEOUT_S": "2"}
    t0 = time.monotonic()
    proc = cli("worker", "--redis-url", redis_url, "--burst", "--no-scheduler", "--checkpoint-root", str(ckpt),
               "--results-dir", str(ledger.results), "--target", str(target),
               "--evaluator-factory", "tests.support.fake_evaluator:FakeEvaluator", env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert time.monotonic() - t0 < 120, "the sink did not fail fast"
    for jid in job_ids:
        job = fetch_job(conn, jid)
        assert job.get_status().value == "finished"
        assert f"127.0.0.1:{port}" in job.return_value()["sink_error"]
    assert not (ledger.wandb / "run-o-eval.online.json").exists()  # nothing was marked as logged
    records = {r["step"]: r["result"] for r in map(read_record, ledger.results.glob("run-o/step-*/*/attempt-0.json"))}
    assert sorted(records) == [100, 200, 300]

    proc = cli("publish", "--run", "run-o", "--mode", "offline", "--results", str(ledger.results),
               env={"WANDB_MODE": "offline"})
    assert proc.returncode == 0, proc.stderr
    assert "steps 100, 200, 300" in proc.stdout and "wandb sync" in proc.stdout
    pointer = json.loads((ledger.wandb / "run-o-eval.json").read_text())
    log = read_run(pointer["wandb_file"])
    assert sorted(log.points("eval/tau")) == [100, 200, 300]
    for step, res in records.items():
        for key, value in scalars(res).items():
            assert log.points(key)[step] == pytest.approx(value), (key, step)
        assert log.points("eval/prompts/nrows")[step] == len(res["prompts"])
    assert log.summary["eval/tau"]["max"] == pytest.approx(max(r["tau"]["macro"] for r in records.values()))


def test_publish_is_idempotent_and_force_rebuilds(ledger):
    for step in (100, 200):
        ledger("run-i", step, 0.5)
    first = cli("publish", "--run", "run-i")
    assert first.returncode == 0 and "rebuilt" in first.stdout, first.stderr
    builds = ledger.wandb / "builds" / "run-i-eval"
    (b1,) = list(builds.iterdir())
    again = cli("publish", "--run", "run-i")
    assert again.returncode == 0 and "already up to date" in again.stdout
    assert list(builds.iterdir()) == [b1]
    forced = cli("publish", "--run", "run-i", "--force")
    assert forced.returncode == 0 and "rebuilt" in forced.stdout
    (b2,) = list(builds.iterdir())
    assert b2 != b1
    log = read_run(json.loads((ledger.wandb / "run-i-eval.json").read_text())["wandb_file"])
    assert sorted(log.points("eval/tau")) == [100, 200]


def test_publish_keeps_the_project_the_worker_used(ledger):
    record, _ = ledger("run-p", 100, 0.5)
    job = {**record["job"], "wandb": {"project": "my-proj", "group": "grp", "entity": None, "mode": "offline"}}
    assert publish_result(record, job, Settings.from_env())["wandb"]["ok"]
    ledger("run-p", 200, 0.6)
    proc = cli("publish", "--run", "run-p")
    assert proc.returncode == 0, proc.stderr
    pointer = json.loads((ledger.wandb / "run-p-eval.json").read_text())
    assert pointer["target"]["project"] == "my-proj"
    assert read_run(pointer["wandb_file"]).group == "grp"


def test_a_worker_that_ran_wandb_itself_still_publishes_through_its_own_child(ledger, monkeypatch, tmp_path):
    """A process that used W&B exports WANDB_SERVICE; the publishing child must not inherit it
    (it would talk to that service, with its settings, and outlive its own kill)."""
    record, _ = ledger("run-s", 100, 0.5)
    monkeypatch.setenv("WANDB_SERVICE", f"2-{os.getpid()}-unix-{tmp_path / 'gone.sock'}")
    out = publish_result(record, record["job"], Settings.from_env())["wandb"]
    assert out["ok"], out
    assert read_run(json.loads((ledger.wandb / "run-s-eval.json").read_text())["wandb_file"]).points("eval/tau")


def test_publish_bad_input_says_why_and_changes_nothing(ledger):
    proc = cli("publish", "--run", "no-such-run")
    assert proc.returncode == 2 and "no results for run 'no-such-run'" in proc.stderr
    ledger("run-e", 100, 0.5)
    assert cli("publish", "--run", "run-e").returncode == 0
    before = (ledger.wandb / "run-e-eval.json").read_text()
    bad = ledger.results / "run-e" / "step-00000200" / "abcd1234"
    bad.mkdir(parents=True)
    (bad / "attempt-0.json").write_text("{not json")
    proc = cli("publish", "--run", "run-e")
    assert proc.returncode == 2 and "attempt-0.json" in proc.stderr and "unreadable" in proc.stderr
    assert (ledger.wandb / "run-e-eval.json").read_text() == before  # the good build stays current
    proc = cli("publish", "--run", "run-e", "--mode", "sideways")
    assert proc.returncode == 2 and "invalid choice" in proc.stderr
