"""`JobClient`, the one way every producer enqueues: outbox, delivery, resend, dedupe by job id, roots.

Real parts: the session's redis-server (stopped and started again for the outage), real RQ queues,
checkpoints published by the trainer's `publish_checkpoint`, the real `dflash-eval` commands.
"""
from __future__ import annotations

import time

from eval_worker.cli import main as cli
from eval_worker.redis_client import connect
from eval_worker.service.jobs.builder import make_job
from eval_worker.service.queueing.client import Delivery, JobClient
from eval_worker.service.queueing.outbox import OUTBOX_DIRNAME, Outbox
from eval_worker.service.queueing.queue import get_queue
from tests.support.sidecar_support import publish_random

SUITE = "builtin:coding-v1"


def _queued(url) -> list[tuple[str, int]]:
    conn = connect(url)
    try:
        return sorted((j.meta["run_id"], j.meta["step"]) for j in get_queue(conn, "dflash-eval").jobs)
    finally:
        conn.close()


def test_jobclient_outbox_when_redis_down_then_delivers(tmp_path, redis_server, redis_url):
    """Redis away: `post` answers at once with the job waiting in the outbox beside the checkpoints (and
    `submit` in background mode never waits at all); back: the next post takes the backlog too."""
    ck = {s: publish_random(tmp_path / "ck", "run-c", s, seed=s) for s in (1, 2, 3)}
    box = Outbox(tmp_path / "ck" / "run-c" / OUTBOX_DIRNAME)
    client = JobClient(redis_url, delivery=Delivery(connect_timeout=0.5))
    background = JobClient(redis_url, delivery=Delivery(background=True, min_backoff=30, connect_timeout=0.5))
    redis_server.stop()
    try:
        t0 = time.perf_counter()
        [waiting] = client.post([make_job(ck[1], suite=SUITE, requested_by="hook")])
        assert time.perf_counter() - t0 < 5
        assert waiting.status == "waiting" and not waiting.taken and "dflash-eval enqueue --outbox" in waiting.message
        assert waiting.outbox == box.dir and len(box) == 1 and box.holds(ck[1]) and client.protects(ck[1])
        t0 = time.perf_counter()
        assert background.submit(make_job(ck[2], suite=SUITE, requested_by="hook")) is not None
        assert time.perf_counter() - t0 < 0.5  # a file write, no network call in the caller's thread
        assert not background.flush(0.5) and len(box) == 2  # nothing could go: kept, never set aside
        assert box.rejected() == {}
    finally:
        background.close()
        redis_server.start()
    [enqueued] = client.post([make_job(ck[3], suite=SUITE, requested_by="hook")])
    client.close()
    assert enqueued.status == "enqueued" and enqueued.taken
    assert _queued(redis_url) == [("run-c", 1), ("run-c", 2), ("run-c", 3)] and len(box) == 0
    assert [o.status for o in client.outcomes] == ["enqueued"] * 3


def test_jobclient_dedupes_same_checkpoint(tmp_path, conn, redis_url):
    """One evaluation, one job id, whoever asks: the hook's outbox path and a user's direct send of the
    same checkpoint and suite land on the same id, queued once."""
    ck = publish_random(tmp_path / "ck", "run-d", 5)
    client = JobClient(redis_url)
    [first] = client.post([make_job(ck, suite=SUITE, requested_by="hook")])
    [again] = client.post([make_job(ck, suite=SUITE, requested_by="hook")])
    by_user = JobClient(connection=conn).send(make_job(ck, suite=SUITE, requested_by="user"))
    client.close()
    assert first.status == "enqueued" and again.status == "duplicate" and by_user.status == "duplicate"
    assert first.job_id == again.job_id == by_user.job_id
    assert get_queue(conn, "dflash-eval").count == 1
    forced = JobClient(connection=conn).send(make_job(ck, suite=SUITE), force=True)  # a new attempt, its own id
    assert forced.status == "enqueued" and forced.job_id == f"{first.job_id}-r1"


def test_jobclient_checks_roots_on_every_path(tmp_path, conn, redis_url):
    """A client with roots refuses a checkpoint outside them, sent directly or delivered from an outbox
    (`enqueue --outbox` applies plain `enqueue`'s roots check): set aside with the reason, nothing queued."""
    inside, outside = tmp_path / "inside", tmp_path / "outside"
    inside.mkdir()
    ck = publish_random(outside, "run-r", 1)
    client = JobClient(connection=conn, roots=[inside])
    [posted] = client.post([make_job(ck, suite=SUITE, requested_by="hook")])
    assert posted.status == "rejected" and "outside the checkpoint roots" in posted.message
    box = Outbox(tmp_path / "box")
    box.put(make_job(ck, suite=SUITE, requested_by="hook").to_json())
    report = client.deliver_outbox(box.dir)
    assert report["delivered"] == [] and len(report["rejected"]) == 1
    assert "outside the checkpoint roots" in next(iter(report["set_aside"].values()))
    assert get_queue(conn, "dflash-eval").count == 0
    # the same outbox through the command, with the roots given: the same refusal
    box.restore_rejected()
    assert cli(["enqueue", "--outbox", str(box.dir), "--checkpoint-root", str(inside),
                "--redis-url", redis_url]) == 2
    assert get_queue(conn, "dflash-eval").count == 0 and len(box.rejected()) == 1


def test_jobclient_resends_a_job_redis_lost(tmp_path, conn, redis_url):
    """A queued job that Redis no longer has (a FLUSHALL, a restart without persistence), not recorded and
    still pinned, goes back into the outbox and is queued again by the client's reconciliation."""
    ck = publish_random(tmp_path / "ck", "run-l", 7)
    client = JobClient(redis_url)
    [first] = client.post([make_job(ck, suite=SUITE, requested_by="hook")])
    conn.flushall()
    assert client.release_pins() == 0 and client.resent == [first.job_id]
    assert any("Redis no longer has the eval job for step 7" in e for e in client.errors)
    client.deliver(client.outbox_for(ck))
    client.close()
    assert _queued(redis_url) == [("run-l", 7)]


def test_jobclient_watch_keeps_jobs_in_the_outbox_while_redis_refuses_writes(tmp_path, conn, redis_url, capsys):
    """`dflash-eval watch` posts through the client: with Redis refusing writes (out of memory at
    `maxmemory`) the scan goes on and the job waits in the outbox (before: the error ended the watcher);
    once Redis takes writes again, the next scan delivers it, once."""
    watched = tmp_path / "ck" / "run-w"
    publish_random(tmp_path / "ck", "run-w", 10)
    into = tmp_path / "into"
    into.mkdir()
    args = ["watch", str(watched), "--into", str(into), "--checkpoint-root", str(tmp_path),
            "--redis-url", redis_url, "--once", "--settle", "0"]
    conn.set("filler", b"x" * 4_000_000)
    conn.config_set("maxmemory", "1mb")  # noeviction: every write refused
    try:
        assert cli(args) == 0
        assert "waiting" in capsys.readouterr().out
        assert len(Outbox(watched / OUTBOX_DIRNAME)) == 1
    finally:
        conn.config_set("maxmemory", "0")
        conn.delete("filler")
    assert cli(args) == 0 and cli(args) == 0
    assert _queued(redis_url) == [("run-w", 10)] and len(Outbox(watched / OUTBOX_DIRNAME)) == 0
