"""Reliability of the job service: pins and fast workers, suite size limits, clock skew between
worker boxes, a hook whose outbox disk is full, secrets in URLs (docs/reliability.md rows).

Real parts throughout: a real redis-server (tests/conftest.py), real RQ workers (in-process
`serve(burst=True)` or `dflash-eval worker` subprocesses), the stand-in engine
tests.fake_evaluator (no model: these tests are about the service, not the number).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis
from rq import Queue
from rq.job import JobStatus

from eval_worker.service import jobs
from eval_worker.service.evaluators import WorkerSettings
from eval_worker.service.queue import enqueue, fetch_job
from eval_worker.service.redis_local import connect
from eval_worker.service.worker import serve
from tests.sidecar_support import REPO_ROOT, publish_random

FAKE = "tests.fake_evaluator:FakeEvaluator"


@pytest.fixture
def conn(redis_url):
    c = connect(redis_url)
    yield c
    c.close()


def _settings(tmp_path: Path, root: Path, **kw) -> WorkerSettings:
    return WorkerSettings(results_dir=tmp_path / "results", roots=[root, tmp_path], default_target=str(tmp_path),
                          evaluator_factory=FAKE, **kw)


def _pins(checkpoint: Path) -> list[str]:
    d = checkpoint / ".pins"
    return sorted(p.name for p in d.iterdir()) if d.is_dir() else []


# --------------------------------------------------------------------------- pin before enqueue

def test_pin_race_a_worker_done_before_enqueue_returns_leaves_no_pin(conn, tmp_path, monkeypatch):
    """A worker (real RQ worker, in-process, burst) takes the job, records it and unpins before
    `enqueue_call` has returned to the enqueuer. The enqueuer must not pin after that."""
    monkeypatch.setenv("DFLASH_SINKS", "none")
    root = tmp_path / "ck"
    path = publish_random(root, "run-pin", 5, seed=5)
    settings = _settings(tmp_path, root)
    real = Queue.enqueue_call
    ran = []

    def with_a_fast_worker(self, *args, **kwargs):
        job = real(self, *args, **kwargs)
        serve(conn, [self.name], settings, burst=True, preload=False, with_scheduler=False, name="w-fast")
        ran.append(job.get_status(refresh=True))
        return job

    monkeypatch.setattr(Queue, "enqueue_call", with_a_fast_worker)
    out = enqueue(conn, jobs.make_job(path, suite="builtin:coding-v1", target=str(tmp_path)))
    assert out.status == "enqueued" and ran == [JobStatus.FINISHED]
    assert _pins(path) == []  # retention may remove the checkpoint now: its only job is recorded

    # more enqueuers of the same checkpoint, now that it is done: each pins first, sees the job
    # finished (or recorded), and takes its pin back
    monkeypatch.setattr(Queue, "enqueue_call", real)
    for _ in range(3):
        again = enqueue(conn, jobs.make_job(path, suite="builtin:coding-v1", target=str(tmp_path)))
        assert again.status in ("duplicate", "evaluated")
    assert _pins(path) == []


def test_pin_race_an_enqueue_that_fails_leaves_no_pin(conn, tmp_path, monkeypatch):
    root = tmp_path / "ck"
    path = publish_random(root, "run-pin", 6, seed=6)

    def refused(self, *args, **kwargs):
        raise redis.exceptions.ConnectionError("connection refused")

    monkeypatch.setattr(Queue, "enqueue_call", refused)
    with pytest.raises(redis.exceptions.ConnectionError):
        enqueue(conn, jobs.make_job(path, suite="builtin:coding-v1", target=str(tmp_path)))
    assert _pins(path) == []  # nothing queued, so nothing would ever have released it
