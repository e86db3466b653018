"""Training-side hook: cadence, rank 0, pins, and the durable outbox across a Redis outage."""
from __future__ import annotations

import time

import pytest
from rq.job import JobStatus

from dflash_train.checkpoints.publication import apply_retention, is_pinned, read_manifest
from eval_worker.redis_client import connect
from eval_worker.service.jobs.builder import make_job
from eval_worker.service.jobs.schema import JobError
from eval_worker.service.queueing.client import enqueue
from eval_worker.service.queueing.outbox import OUTBOX_DIRNAME, job_key
from eval_worker.service.queueing.queue import get_queue, status
from hooks import EvalOnCheckpoint, Outbox
from tests.support.sidecar_support import publish_random, wait_for

SUITE = "builtin:coding-v1"



def _publish(root, steps, run="run-h"):
    return {s: publish_random(root, run, s, seed=s) for s in steps}


def _notify(hook, path):
    hook.on_checkpoint_published(None, read_manifest(path)["step"], path, read_manifest(path))


def _queued_steps(conn):
    q = get_queue(conn, "dflash-eval")
    return sorted(j.meta["step"] for j in q.jobs)


# --- outbox -------------------------------------------------------------------------------

def test_outbox_put_is_idempotent_and_delivery_keeps_order(tmp_path):
    root = tmp_path / "ck"
    ck = _publish(root, (1, 2))
    box = Outbox(tmp_path / "box")
    jobs = [make_job(ck[s], suite=SUITE).to_json() for s in (2, 1)]  # the outbox holds JSON data
    for j in jobs + jobs:
        box.put(j)
    assert len(box) == 2 and box.holds(ck[1]) and not box.holds(root)
    sent = []
    report = box.deliver(lambda j: sent.append(j["step"]), is_invalid=lambda e: False)
    assert sent == [1, 2] and report.complete and len(box) == 0


def test_outbox_transport_error_keeps_jobs_and_invalid_ones_are_set_aside(tmp_path):
    ck = _publish(tmp_path / "ck", (1, 2, 3))
    box = Outbox(tmp_path / "box")
    for s in (1, 2, 3):
        box.put(make_job(ck[s], suite=SUITE).to_json())

    def send(job):
        if job["step"] == 1:
            raise JobError("checkpoint is gone")
        if job["step"] == 2:
            raise ConnectionError("redis down")

    report = box.deliver(send, is_invalid=lambda e: isinstance(e, JobError))
    assert report.rejected == [job_key(make_job(ck[1], suite=SUITE).to_json())] and report.remaining == 2
    assert "redis down" in report.error
    assert [p.stem for p in box.pending()] == [job_key(make_job(ck[s], suite=SUITE).to_json()) for s in (2, 3)]
    reason = next(box.rejected_dir.glob("*.reason.txt")).read_text()
    assert "checkpoint is gone" in reason


# --- the hook with Redis up -------------------------------------------------------------------

def test_cadence_final_checkpoint_and_pins(tmp_path, conn, redis_url):
    root = tmp_path / "ck"
    ck = _publish(root, (100, 200, 300, 400, 500))
    hook = EvalOnCheckpoint(every_n_steps=200, queue="dflash-eval", suite=SUITE, redis_url=redis_url)
    for s in (100, 200, 300, 400, 500):
        _notify(hook, ck[s])
    hook.on_train_end(None)
    assert _queued_steps(conn) == [200, 400, 500]  # each multiple once, plus the final checkpoint
    assert [o.status for o in hook.outcomes] == ["enqueued"] * 3 and not hook.errors
    assert all(is_pinned(ck[s]) for s in (200, 400, 500)) and not is_pinned(ck[100])
    assert not list((root / "run-h" / OUTBOX_DIRNAME).glob("*.json"))
    first = get_queue(conn, "dflash-eval").jobs[0]
    job = first.args[0]
    assert job["requested_by"] == "hook" and job["train_metrics"]["loss"] == pytest.approx(1.2)
    # a worker that sees the checkpoints read-only cannot unpin: the hook releases pins of finished jobs
    first.set_status(JobStatus.FINISHED)
    assert hook.release_pins() == 1
    assert not is_pinned(ck[200]) and is_pinned(ck[400]) and is_pinned(ck[500])
    hook.close()
    # retention keeps the last one and every checkpoint whose evaluation is still queued
    removed = apply_retention(root / "run-h", keep_last=1, protect=hook.protects)
    assert sorted(p.name for p in removed) == ["step-00000100", "step-00000200", "step-00000300"]
    assert ck[400].exists() and ck[500].exists()


def test_uneven_cadence_takes_the_first_checkpoint_past_each_multiple(tmp_path, conn, redis_url):
    ck = _publish(tmp_path / "ck", (100, 200, 300, 400, 500, 600, 700, 800))
    hook = EvalOnCheckpoint(every_n_steps=250, suite=SUITE, redis_url=redis_url, eval_final=False)
    for s in sorted(ck):
        _notify(hook, ck[s])
    assert hook.flush(10)
    hook.close()
    assert _queued_steps(conn) == [300, 500, 800]


def test_only_rank0_enqueues(tmp_path, conn, redis_url, monkeypatch):
    ck = _publish(tmp_path / "ck", (100,))
    monkeypatch.setenv("RANK", "1")
    hook = EvalOnCheckpoint(every_n_steps=1, suite=SUITE, redis_url=redis_url)
    _notify(hook, ck[100])
    hook.on_train_end(None)
    assert _queued_steps(conn) == [] and not (tmp_path / "ck" / "run-h" / OUTBOX_DIRNAME).exists()


def test_a_bad_suite_never_raises_into_training(tmp_path, conn, redis_url):
    ck = _publish(tmp_path / "ck", (100,))
    hook = EvalOnCheckpoint(every_n_steps=1, suite="builtin:no-such-suite", redis_url=redis_url)
    _notify(hook, ck[100])  # must not raise
    hook.on_train_end(None)
    assert _queued_steps(conn) == []
    box = Outbox(tmp_path / "ck" / "run-h" / OUTBOX_DIRNAME)
    assert "no-such-suite" in next(box.rejected_dir.glob("*.reason.txt")).read_text()


# --- Redis outage -------------------------------------------------------------------------------

def test_outbox_delivers_after_redis_comes_back(tmp_path, redis_server, redis_url):
    root = tmp_path / "ck"
    ck = _publish(root, (100, 200, 300))
    run_dir = root / "run-h"
    hook = EvalOnCheckpoint(every_n_steps=100, suite=SUITE, redis_url=redis_url, min_backoff=0.2, max_backoff=0.5,
                            connect_timeout=0.5)
    redis_server.stop()
    try:
        stalls = []
        for s in (100, 200):
            t0 = time.perf_counter()
            _notify(hook, ck[s])
            stalls.append(time.perf_counter() - t0)
        assert max(stalls) < 0.5, stalls  # the training thread never waits for Redis
        assert not hook.flush(1.0)  # nothing can go out
        box = Outbox(run_dir / OUTBOX_DIRNAME)
        assert len(box) == 2 and hook.protects(ck[100])
        assert apply_retention(run_dir, keep_last=1, protect=hook.protects) == []  # kept while waiting
    finally:
        redis_server.start()
    conn = connect(redis_server.url)
    _notify(hook, ck[300])  # the next successful delivery takes the backlog too
    wait_for(lambda: len(_queued_steps(conn)) == 3, 30, "the outbox to drain")
    assert _queued_steps(conn) == [100, 200, 300] and len(box) == 0
    assert not hook.protects(ck[100]) and is_pinned(ck[100])  # queued now: the pin keeps it
    # delivering the same jobs again (e.g. a crash before the files were removed) adds nothing
    for s in (100, 200):
        box.put(make_job(ck[s], suite=SUITE, requested_by="hook").to_json())
    assert box.deliver(lambda j: enqueue(conn, j), is_invalid=lambda e: False).complete
    assert _queued_steps(conn) == [100, 200, 300]
    hook.on_train_end(None)
    conn.close()


def test_outbox_delivered_at_train_end(tmp_path, redis_server, redis_url):
    ck = _publish(tmp_path / "ck", (100,))
    hook = EvalOnCheckpoint(every_n_steps=100, suite=SUITE, redis_url=redis_url, min_backoff=30, max_backoff=60,
                            connect_timeout=0.5)
    redis_server.stop()
    try:
        _notify(hook, ck[100])
        time.sleep(0.3)  # the first delivery attempt fails; the next would be 30 s away
    finally:
        redis_server.start()
    t0 = time.perf_counter()
    hook.on_train_end(None)
    assert time.perf_counter() - t0 < 20
    conn = connect(redis_server.url)
    assert _queued_steps(conn) == [100] and status(conn)["queues"]["dflash-eval"] == 1
    conn.close()


def test_leftovers_are_delivered_by_the_cli(tmp_path, redis_server, redis_url, capsys):
    from eval_worker.cli import main as cli

    ck = _publish(tmp_path / "ck", (100, 200))
    box = Outbox(tmp_path / "ck" / "run-h" / OUTBOX_DIRNAME)
    for s in (100, 200):
        box.put(make_job(ck[s], suite=SUITE, requested_by="hook").to_json())
    assert cli(["enqueue", "--outbox", str(box.dir), "--redis-url", redis_url]) == 0
    assert "delivered 2" in capsys.readouterr().out and len(box) == 0
    conn = connect(redis_url)
    assert _queued_steps(conn) == [100, 200]
    conn.close()
