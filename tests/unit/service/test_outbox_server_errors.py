"""The hook outbox keeps a job on every server-side condition and sets aside only jobs refused for themselves.

Observed before: with Redis at `maxmemory` (noeviction) the delivery failed with
`OOM command not allowed...` and the job file went to `rejected/`, which nothing read again.
Real parts: a private redis-server per test (at maxmemory, unable to persist (MISCONF), busy
in a script (BUSY)), the real hook and its delivery thread, the real `dflash-eval enqueue`.
"""
from __future__ import annotations

import shutil
import threading
import time

import pytest
import redis
from hypothesis import given
from hypothesis import strategies as st

from dflash_train.checkpoints.publication import read_manifest
from dflash_train.common.errors import retryable
from eval_worker.cli import main as cli
from eval_worker.redis_client import connect
from eval_worker.service.jobs.schema import JobError
from eval_worker.service.local_redis.server import LocalRedis
from eval_worker.service.queueing.outbox import OUTBOX_DIRNAME
from eval_worker.service.queueing.queue import get_queue
from hooks import EvalOnCheckpoint, Outbox
from tests.support.sidecar_support import publish_random

SUITE = "builtin:coding-v1"


@pytest.fixture
def server(tmp_path):
    work = tmp_path / "redis-work"  # redis-server's working directory (its RDB/AOF), apart from our state
    work.mkdir()
    s = LocalRedis(tmp_path / "redis", extra_config={"dir": str(work), "lua-time-limit": 100})
    s.start()
    s.work = work
    try:
        yield s
    finally:
        s.stop(timeout=3)


def _hook(url):
    return EvalOnCheckpoint(every_n_steps=1, suite=SUITE, redis_url=url, eval_final=False,
                            min_backoff=0.2, max_backoff=0.5, connect_timeout=2.0)


def _submit_and_try(hook, ckpt) -> Outbox:
    hook.on_checkpoint_published(None, read_manifest(ckpt)["step"], ckpt, read_manifest(ckpt))
    assert not hook.flush(1.5)  # not delivered...
    box = Outbox(ckpt.parent / OUTBOX_DIRNAME)
    assert len(box) == 1 and box.rejected() == {}  # ...and still waiting, not set aside
    return box


def _delivered(hook, conn, box) -> None:
    assert hook.flush(10) and len(box) == 0 and box.rejected() == {}
    assert [j.meta["step"] for j in get_queue(conn, "dflash-eval").jobs] == [1]


def test_outbox_server_error_out_of_memory_keeps_the_job(tmp_path, server):
    conn = connect(server.url)
    conn.set("filler", b"x" * 4_000_000)
    conn.config_set("maxmemory", "1mb")  # noeviction (the embedded default): every write is refused
    with pytest.raises(redis.exceptions.OutOfMemoryError, match="maxmemory"):  # the server's `-OOM ...`
        conn.set("probe", 1)
    hook = _hook(server.url)
    try:
        box = _submit_and_try(hook, publish_random(tmp_path / "ck", "run-o", 1))
        assert "OutOfMemoryError" in hook.errors[-1] and "maxmemory" in hook.errors[-1]
        conn.config_set("maxmemory", "0")  # the operator makes room
        _delivered(hook, conn, box)
    finally:
        hook.close()


def test_outbox_server_error_misconf_keeps_the_job(tmp_path, server):
    """Redis cannot persist (its directory is gone, stop-writes-on-bgsave-error): writes get MISCONF."""
    conn = connect(server.url)
    conn.config_set("stop-writes-on-bgsave-error", "yes")
    shutil.rmtree(server.work)  # as root a read-only directory is still writable; a deleted one is not
    try:
        conn.bgsave()
    except redis.exceptions.ResponseError:
        pass
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and conn.info("persistence")["rdb_last_bgsave_status"] != "err":
        time.sleep(0.1)
    with pytest.raises(redis.exceptions.ResponseError, match="MISCONF"):
        conn.set("probe", 1)
    hook = _hook(server.url)
    try:
        box = _submit_and_try(hook, publish_random(tmp_path / "ck", "run-m", 1))
        assert "MISCONF" in hook.errors[-1]
        conn.config_set("stop-writes-on-bgsave-error", "no")  # the operator lets writes through
        _delivered(hook, conn, box)
        conn.config_set("save", "")  # no final snapshot into the missing directory at shutdown
    finally:
        hook.close()


def test_outbox_server_error_busy_script_keeps_the_job(tmp_path, server):
    conn = connect(server.url)
    busy = threading.Thread(target=lambda: pytest.raises(redis.exceptions.ResponseError, conn.eval,
                                                          "while true do end", 0), daemon=True)
    busy.start()
    other = connect(server.url, ping=False, socket_timeout=5)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # until the script has run past lua-time-limit
        try:
            other.ping()
            time.sleep(0.05)
        except redis.exceptions.ResponseError as e:
            assert "BUSY" in str(e)
            break
    hook = _hook(server.url)
    try:
        box = _submit_and_try(hook, publish_random(tmp_path / "ck", "run-b", 1))
        assert "BUSY" in hook.errors[-1]
        other.script_kill()
        busy.join(10)
        _delivered(hook, other, box)
    finally:
        hook.close()


@given(st.sampled_from([redis.exceptions.ResponseError, redis.exceptions.ConnectionError,
                        redis.exceptions.TimeoutError, redis.exceptions.BusyLoadingError,
                        redis.exceptions.ReadOnlyError, redis.exceptions.OutOfMemoryError,
                        redis.exceptions.AuthenticationError, redis.exceptions.ClusterDownError,
                        redis.exceptions.MovedError, redis.exceptions.AskError, OSError, RuntimeError]),
       st.sampled_from(["MOVED 3999 127.0.0.1:6381", "ASK 3999 127.0.0.1:6381", "TRYAGAIN", "CLUSTERDOWN",
                        "MISCONF Redis is configured to save RDB snapshots", "BUSY Redis is busy",
                        "LOADING Redis is loading", "NOREPLICAS", "OOM command not allowed", "x"]))
def test_outbox_server_error_classes_are_never_the_jobs_fault(cls, message):
    """Every server-side condition (cluster redirections included) keeps the job; only JobError sets it aside."""
    try:
        error = cls(message)
    except (TypeError, ValueError):  # MovedError/AskError parse their message
        error = cls("3999 127.0.0.1:6381")
    assert retryable(error)
    assert not retryable(JobError("invalid job: step must be a non-negative integer"))


def test_outbox_server_error_then_set_aside_jobs_are_delivered_again_after_a_fix(tmp_path, redis_url, capsys):
    """A job refused for itself (its suite file is missing) is set aside; once the file is back,
    `enqueue --outbox DIR --retry-rejected` delivers it."""
    ck = publish_random(tmp_path / "ck", "run-r", 1)
    suite = tmp_path / "suite.jsonl"
    suite.write_text('{"name": "p", "prompt": "def f():"}\n')
    hook = EvalOnCheckpoint(every_n_steps=1, suite=str(suite), redis_url=redis_url, eval_final=False)
    hidden = tmp_path / "suite.jsonl.away"
    suite.rename(hidden)  # gone between the hook writing the job and its delivery
    try:
        hook.on_checkpoint_published(None, 1, ck, read_manifest(ck))
        assert hook.flush(5)
    finally:
        hook.close()
    box = Outbox(ck.parent / OUTBOX_DIRNAME)
    assert len(box) == 0 and list(box.rejected())
    assert "unknown or unreadable suite" in next(iter(box.rejected().values()))
    assert cli(["enqueue", "--outbox", str(box.dir), "--redis-url", redis_url]) == 2  # still refused, still kept
    out = capsys.readouterr().out
    assert "set aside" in out and "--retry-rejected" in out
    hidden.rename(suite)  # the user fixes it
    assert cli(["enqueue", "--outbox", str(box.dir), "--retry-rejected", "--redis-url", redis_url]) == 0
    assert "1 set-aside job(s) put back; delivered 1" in capsys.readouterr().out
    assert box.rejected() == {} and len(box) == 0
    assert [j.meta["step"] for j in get_queue(connect(redis_url), "dflash-eval").jobs] == [1]
