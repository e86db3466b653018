"""The eval worker as a real `dflash-eval worker` subprocess (RQ worker, heartbeats) on the tiny target.

Jobs that must be "running" while the test acts go through a gate in front of the real
Evaluator (tests.support.sidecar_support.gated_evaluator): the evaluation waits until the test
creates the gate file.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eval_worker.cli import main as cli
from eval_worker.redis_client import connect
from eval_worker.results.ledger import Ledger
from eval_worker.service.jobs.builder import make_job
from eval_worker.service.queueing.client import enqueue
from eval_worker.service.queueing.queue import QueueConfig, cancel, fetch_job, status
from tests.support.sidecar_support import (
    REPO_ROOT,
    WorkerProcess,
    publish_random,
    read_calls,
    tiny_target_drafter_config,
    wait_for,
    write_suite,
)

TINY = REPO_ROOT / "dflash_train" / "assets" / "tiny_target"
GATED = ["--evaluator-factory", "tests.support.sidecar_support:gated_evaluator"]


def _target() -> Path:
    if (TINY / "config.json").is_file():
        return TINY
    dev = os.environ.get("SIDECAR_DEV_TARGET")  # a locally built tiny target, until the bundled one lands
    if dev and (Path(dev) / "config.json").is_file():
        return Path(dev)
    pytest.skip(f"bundled tiny target missing: {TINY}")


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    target = _target()
    base = tmp_path_factory.mktemp("sidecar")
    root = base / "ckpts"
    cfg, mask = tiny_target_drafter_config(target)
    ckpts = {s: publish_random(root, "run-w", s, target_config=cfg, mask_token_id=mask, seed=s)
             for s in (10, 20, 30, 40)}
    suite = write_suite(root / "suite.jsonl", n_prompts=2, max_new_tokens=12)  # in a root: the worker may read it
    return {"target": target, "root": root, "ckpts": ckpts, "suite": suite, "cfg": cfg, "mask": mask}


@pytest.fixture
def ctx(setup, redis_url, tmp_path):
    conn = connect(redis_url)
    workers: list[WorkerProcess] = []

    def start(name, *, gated=False, args=(), env=None):
        extra = {"SIDECAR_GATE": str(tmp_path / "gate"),
                 "SIDECAR_CALLS": str(tmp_path / "calls.jsonl")} if gated else {}
        w = WorkerProcess(tmp_path, redis_url, [setup["root"]], name=name, target=setup["target"],
                          args=(GATED if gated else []) + list(args), env={**extra, **(env or {})})
        workers.append(w)
        return w

    def job(step, **kw):
        return make_job(setup["ckpts"][step], suite=str(setup["suite"]), target=str(setup["target"]), **kw)

    def finished(job_id, timeout=120):
        j = fetch_job(conn, job_id)
        wait_for(lambda: j.get_status(refresh=True).value in ("finished", "failed", "stopped"), timeout,
                 f"job {job_id} to end")
        j.refresh()
        return j

    ns = type("Ctx", (), dict(conn=conn, url=redis_url, start=start, job=job, finished=finished, tmp=tmp_path,
                              ledger=Ledger(tmp_path / "results"), gate=tmp_path / "gate",
                              calls=tmp_path / "calls.jsonl", **setup))
    try:
        yield ns
    finally:
        for w in workers:
            w.stop()
        conn.close()


def _replace(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def test_target_loaded_once_failures_visible_and_requeueable(ctx):
    w = ctx.start("w-once")
    w.wait_registered(ctx.conn)
    outs = [enqueue(ctx.conn, ctx.job(s)) for s in (10, 20, 30)]
    results = [ctx.finished(o.job_id).return_value() for o in outs]
    assert {r["worker_pid"] for r in results} == {w.pid}
    assert [r["target_loads"] for r in results] == [1, 1, 1]  # preloaded once, never reloaded
    assert all(r["recorded_now"] and isinstance(r["tau"], float) for r in results)
    assert len(ctx.ledger.entries("run-w")) == 3
    rec = ctx.ledger.entries("run-w")[0].read()
    assert rec["result"]["schema"] == "dflash-eval-result/1" and rec["job_id"] == outs[0].job_id
    assert not (ctx.ckpts[10] / ".pins" / outs[0].job_id).exists()  # released once recorded

    # evaluate a finished step again by run/step: a new attempt, recorded next to the first
    assert cli(["requeue", "--run", "run-w", "--steps", "20", "--redis-url", ctx.url]) == 0
    assert ctx.finished(outs[1].job_id + "-r1").get_status().value == "finished"
    assert [(e.step, e.attempt) for e in ctx.ledger.entries("run-w")] == [(10, 0), (20, 1), (30, 0)]

    # a checkpoint changed after publication: the job fails at once with the reason, the worker carries on.
    # Changed before enqueue (enqueue reads the marker, not the weights) and by rename: changed in place after
    # enqueue, the worker could map the file while it is being rewritten (a SIGBUS, not the error under test)
    weights = ctx.ckpts[40] / "model.safetensors"
    good = weights.read_bytes()
    _replace(weights, good[:-1] + bytes([good[-1] ^ 0xFF]))
    bad = enqueue(ctx.conn, ctx.job(40))
    j = ctx.finished(bad.job_id)
    assert j.get_status().value == "failed" and j.retries_left == 0 and len(j.results()) == 1
    st = status(ctx.conn)
    [failed] = st["failed"]
    assert failed["job_id"] == bad.job_id and "digest mismatch" in failed["reason"]
    assert st["workers"][0]["state"] == "idle" and w.proc.poll() is None
    assert (ctx.ckpts[40] / ".pins" / bad.job_id).exists()  # still pinned: it will be re-run

    # fixed, then re-queued by hand under the same id
    _replace(weights, good)
    assert cli(["requeue", "--failed", "--redis-url", ctx.url]) == 0
    assert ctx.finished(bad.job_id).get_status().value == "finished"
    assert status(ctx.conn)["failed"] == [] and len(ctx.ledger.entries("run-w")) == 4
    assert len(ctx.ledger.entries("run-w", all_attempts=True)) == 5

    # an attempt already in the ledger (its first execution died after recording) is not evaluated again
    forced = enqueue(ctx.conn, ctx.job(10), force=True)
    Ledger(ctx.tmp / "results").write(job=forced.job, job_id=forced.job_id, result=rec["result"])
    r = ctx.finished(forced.job_id).return_value()
    assert r["recorded_now"] is False and r["attempt"] == 1

    out = subprocess.run([sys.executable, "-m", "rq.cli", "info", "--url", ctx.url],
                         capture_output=True, text=True, timeout=60)
    assert "1 workers" in out.stdout and "dflash-eval " in out.stdout, out.stdout


@pytest.mark.slow  # ~10-25 s: CI's slow pass (the default suite stays under 10 min on 2 cores)
def test_two_workers_each_job_runs_once_despite_long_jobs(ctx):
    a, b = ctx.start("w-a", gated=True), ctx.start("w-b", gated=True)
    a.wait_registered(ctx.conn)
    b.wait_registered(ctx.conn)
    outs = [enqueue(ctx.conn, ctx.job(s)) for s in (10, 20)]
    wait_for(lambda: len(read_calls(ctx.calls)) == 2, 60, "both jobs to start")
    assert {c["pid"] for c in read_calls(ctx.calls)} == {a.pid, b.pid}
    running = status(ctx.conn)["running"]
    assert sorted(r["job_id"] for r in running) == sorted(o.job_id for o in outs)
    assert {r["worker"] for r in running} == {"w-a", "w-b"}
    time.sleep(6)  # > heartbeat interval (1 s) + grace (2 s): heartbeats keep both jobs theirs
    assert len(read_calls(ctx.calls)) == 2
    ctx.gate.touch()
    results = [ctx.finished(o.job_id).return_value() for o in outs]
    assert {r["worker_pid"] for r in results} == {a.pid, b.pid}
    for o in outs:
        assert len(fetch_job(ctx.conn, o.job_id).results()) == 1  # one execution each
    assert len(ctx.ledger.entries("run-w", all_attempts=True)) == 2


@pytest.mark.slow  # ~10-25 s: CI's slow pass (the default suite stays under 10 min on 2 cores)
def test_job_of_a_killed_worker_runs_again_and_is_recorded_once(ctx):
    a, b = ctx.start("w-doomed", gated=True), ctx.start("w-survivor", gated=True)
    a.wait_registered(ctx.conn)
    b.wait_registered(ctx.conn)
    cfg = QueueConfig(retry_max=2, retry_intervals=[])
    out = enqueue(ctx.conn, ctx.job(20), config=cfg)
    first = wait_for(lambda: read_calls(ctx.calls), 60, "the job to start")[0]
    victim = a if first["pid"] == a.pid else b
    survivor = b if victim is a else a
    victim.kill_group()  # SIGKILL: no cleanup, no goodbye
    ctx.gate.touch()
    j = ctx.finished(out.job_id, timeout=90)
    assert j.get_status().value == "finished"
    assert [c["pid"] for c in read_calls(ctx.calls)] == [victim.pid, survivor.pid]
    assert j.return_value()["worker_pid"] == survivor.pid
    assert j.retries_left == 1  # the abandoned execution used one retry
    assert len(ctx.ledger.entries("run-w", all_attempts=True)) == 1


@pytest.mark.slow  # ~10-25 s: CI's slow pass (the default suite stays under 10 min on 2 cores)
def test_sigterm_finishes_the_running_job_then_exits(ctx):
    w = ctx.start("w-term", gated=True)
    w.wait_registered(ctx.conn)
    out = enqueue(ctx.conn, ctx.job(30))
    wait_for(lambda: read_calls(ctx.calls), 60, "the job to start")
    w.signal(signal.SIGTERM)
    time.sleep(1.5)
    assert w.proc.poll() is None  # still working on it
    assert fetch_job(ctx.conn, out.job_id).get_status().value == "started"
    ctx.gate.touch()
    assert w.wait(60) == 0
    assert fetch_job(ctx.conn, out.job_id).get_status().value == "finished"
    assert "warm shut down requested" in w.log()


@pytest.mark.slow
def test_sigterm_with_stop_timeout_hands_the_job_back(ctx):
    w = ctx.start("w-handback", gated=True, args=["--stop-timeout", "1"])
    w.wait_registered(ctx.conn)
    out = enqueue(ctx.conn, ctx.job(30))
    wait_for(lambda: read_calls(ctx.calls), 60, "the job to start")
    w.signal(signal.SIGTERM)
    assert w.wait(60) == 0
    j = fetch_job(ctx.conn, out.job_id)
    assert j.get_status().value == "queued" and status(ctx.conn)["queues"]["dflash-eval"] == 1
    assert j.retries_left == QueueConfig().retry_max  # handed back, not counted as a failure
    ctx.gate.touch()
    w2 = ctx.start("w-next", gated=True)
    assert ctx.finished(out.job_id).get_status().value == "finished"
    assert [c["pid"] for c in read_calls(ctx.calls)] == [w.pid, w2.pid]
    assert len(ctx.ledger.entries("run-w", all_attempts=True)) == 1


@pytest.mark.slow
def test_timeout_and_cancel_fail_the_job_not_the_worker(ctx):
    w = ctx.start("w-timeout", gated=True)
    w.wait_registered(ctx.conn)
    slow = enqueue(ctx.conn, ctx.job(10), config=QueueConfig(job_timeout=3, retry_max=0))
    j = ctx.finished(slow.job_id, timeout=60)
    assert j.get_status().value == "failed"
    assert "timeout" in status(ctx.conn)["failed"][0]["reason"].lower()

    running = enqueue(ctx.conn, ctx.job(20))
    wait_for(lambda: len(read_calls(ctx.calls)) == 2, 60, "the second job to start")
    assert "stop" in cancel(ctx.conn, running.job_id)
    assert ctx.finished(running.job_id).get_status().value == "stopped"

    ctx.gate.touch()
    last = enqueue(ctx.conn, ctx.job(30))
    assert ctx.finished(last.job_id).get_status().value == "finished"
    assert w.proc.poll() is None and ctx.finished(last.job_id).return_value()["worker_pid"] == w.pid


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                continue
    return out


def _running(pid: int) -> bool:
    try:
        return (Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]) not in ("Z", "X")
    except (OSError, IndexError):
        return False


def test_orphan_scheduler_stops_when_its_worker_is_sigkilled(tmp_path, redis_url):
    """Observed: after SIGKILL of a worker its RQ scheduler (reparented to init) ran on for 13+ minutes,
    still scheduling retries and holding the scheduler lock."""
    conn = connect(redis_url)
    w = WorkerProcess(tmp_path, redis_url, [tmp_path], name="w-orphan", args=["--no-preload"])
    try:
        w.wait_registered(conn)
        scheduler = wait_for(lambda: _children(w.pid), 60, "the worker's scheduler process")[0]
        wait_for(lambda: f"started with PID {scheduler}" in w.log(), 30, "the scheduler's start line")  # it is RQ's
        assert _running(scheduler)
        lock = "rq:scheduler-lock:dflash-eval"
        wait_for(lambda: conn.get(lock) is not None, 30, "the scheduler lock")
        os.kill(w.pid, signal.SIGKILL)  # the worker only, as the OOM killer would
        w.proc.wait(timeout=30)
        wait_for(lambda: not _running(scheduler), 15, f"scheduler pid {scheduler} to exit after its worker died")
        assert conn.get(lock) is None  # it stopped gracefully: the lock is free for another worker's scheduler
        assert "is gone; stopping" in w.log() or "Scheduler" in w.log()
    finally:
        if _running(locals().get("scheduler", -1) or -1):
            os.kill(scheduler, signal.SIGKILL)
        w.stop()
        conn.close()
