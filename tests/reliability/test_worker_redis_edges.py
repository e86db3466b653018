"""Workers and Redis at the edges (docs/reliability.md, fourth round; issue 34 D4, D5, D16): a worker
whose registration lapsed, a partitioned worker's records, a Redis refusing writes at enqueue.

Real parts: the session's redis-server (tests/conftest.py) or a private one configured as the fault
needs, real RQ workers (the `dflash-eval worker` CLI in a subprocess, or `serve` in-process), the real
ledger and commands.
"""
from __future__ import annotations

import json
import logging
import signal

import pytest

from eval_worker.service.jobs.builder import make_job
from eval_worker.service.worker.evaluators import WorkerSettings
from tests.support.eval_results import fake_checkpoint
from tests.support.sidecar_support import publish_random

FAKE = "tests.support.fake_evaluator:FakeEvaluator"


# --------------------------------------------------------------------------- D4: registration lapsed

def _registered(conn, name: str) -> bool:
    from rq.worker import Worker

    return any(w.name == name for w in Worker.all(connection=conn))


def test_worker_reregisters_after_its_registration_lapsed(redis_url, conn, tmp_path, capsys):
    """A failover to a server that never saw the worker (here: the data flushed), then a SIGSTOP past
    the heartbeat TTL (its hash lapsed and another worker's maintenance dropped it from rq:workers).
    On main `rq:workers` stayed empty and `status` said `workers (0):` while the worker kept taking
    jobs; now each heartbeat sees the lapse and registers the worker again."""
    from rq import worker_registration
    from rq.worker import Worker

    from eval_worker.cli import main as cli
    from eval_worker.service.queueing.queue import get_queue
    from tests.support.sidecar_support import WorkerProcess, wait_for

    root = tmp_path / "ck"
    worker = WorkerProcess(tmp_path, redis_url, [root, tmp_path], name="w-lapse", target=tmp_path,
                           args=["--evaluator-factory", FAKE])
    try:
        worker.wait_registered(conn)
        key = Worker.redis_worker_namespace_prefix + "w-lapse"

        conn.flushall()  # the failover: a replica that never saw the worker's registration
        assert not _registered(conn, "w-lapse")
        wait_for(lambda: _registered(conn, "w-lapse"), 30, "the worker to register again after the failover")

        worker.signal(signal.SIGSTOP)  # paused past its heartbeat TTL:
        conn.delete(key)  # the TTL ran out (brought forward) ...
        worker_registration.clean_worker_registry(get_queue(conn, "dflash-eval"))  # ... another worker's pass
        assert not _registered(conn, "w-lapse")
        worker.signal(signal.SIGCONT)
        wait_for(lambda: _registered(conn, "w-lapse"), 30, "the worker to register again after the pause")

        assert cli(["status", "--redis-url", redis_url]) == 0
        out = capsys.readouterr().out
        assert "workers (1):" in out and "w-lapse" in out, out  # main: `workers (0):`
        [w] = [w for w in Worker.all(connection=conn) if w.name == "w-lapse"]
        assert "dflash-eval" in w.queue_names() and w.pid == worker.pid
        assert "registered again" in worker.log()
    finally:
        worker.signal(signal.SIGCONT)
        worker.stop()


# --------------------------------------------------------------------------- D5: partition, no false loss

def test_partition_no_false_loss_warning_from_a_second_worker(conn, tmp_path, worker_evaluators, caplog,
                                                                 monkeypatch):
    """Worker A recorded a job's result in the ledger while cut off from Redis (the file written, the
    index write failed); worker B's maintenance finds no results index. On main B warned that Redis
    "lost its data": it had not (the run's jobs are all there). B indexes the record quietly; the
    warning stays for a Redis that did lose its data (flushed: no trace of the run)."""
    from eval_worker.service.queueing.client import enqueue
    from eval_worker.service.queueing.queue import get_queue, status
    from eval_worker.service.worker.eval_job import run_eval_job
    from eval_worker.service.worker.worker import serve

    monkeypatch.setenv("DFLASH_SINKS", "none")
    root = tmp_path / "ck"
    ckpt, _ = fake_checkpoint(root, "run-part", 3)  # the stand-in engine reads only its marker
    settings = WorkerSettings(results_dir=tmp_path / "results", roots=[root, tmp_path], default_target=str(tmp_path),
                              evaluator_factory=FAKE)
    job = make_job(ckpt, suite="builtin:coding-v1", target=str(tmp_path))
    assert enqueue(conn, job).enqueued
    assert conn.lpop(get_queue(conn, "dflash-eval").key)  # worker A took it ...
    worker_evaluators(settings)
    run_eval_job(job.to_json())  # ... and recorded it without reaching Redis (no connection: no index)
    assert status(conn)["runs"] == {}

    def worker_b():
        serve(conn, ["dflash-eval"], settings, burst=True, preload=False, with_scheduler=False, name="w-b")

    caplog.set_level(logging.INFO, logger="eval_worker.service.worker.worker")
    worker_b()
    said = [r.getMessage() for r in caplog.records if r.name == "eval_worker.service.worker.worker"]
    assert not any("lost its data" in m for m in said), said  # main: the warning
    assert any("index rebuilt from 1 record(s)" in m for m in said), said
    assert status(conn)["runs"]["run-part"]["evaluated"] == 1

    conn.flushall()  # a Redis that did lose its data: still said
    caplog.clear()
    worker_b()
    assert any("lost its data" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert status(conn)["runs"]["run-part"]["evaluated"] == 1


@pytest.fixture
def full_redis(tmp_path):
    """A private redis-server at its memory limit with `noeviction`: it refuses every write (OOM)."""
    from eval_worker.service.local_redis.server import LocalRedis

    server = LocalRedis(tmp_path / "oom-redis", extra_config={"maxmemory": "2mb", "maxmemory-policy": "noeviction"})
    server.start()
    try:
        yield server
    finally:
        server.stop()


def test_enqueue_redis_oom_says_cause_and_fix(full_redis, tmp_path, capsys):
    """`enqueue` on a Redis at its memory limit with `noeviction`. On main: a raw `OutOfMemoryError`
    traceback, rc 1. Now one sentence naming the cause (out of memory, its limit and policy) and the
    fix, rc 2, and nothing queued or pinned."""
    import redis

    from eval_worker.cli import main as cli
    from eval_worker.redis_client import connect

    conn = connect(full_redis.url)
    try:
        root = tmp_path / "ck"
        ckpts = [fake_checkpoint(root, "run-oom", s)[0] for s in (1, 2, 3)]
        base = ["--target", str(tmp_path), "--redis-url", full_redis.url, "--checkpoint-root", str(root)]
        assert cli(["enqueue", str(ckpts[2]), *base, "--json"]) == 0  # queued before the server filled up
        [queued] = json.loads(capsys.readouterr().out)["outcomes"]
        filler = 0
        while True:  # another tenant fills it until it refuses
            try:
                conn.set(f"other:{filler}", "x" * 10_000)
            except redis.exceptions.OutOfMemoryError:  # the refusal we wait for
                break
            filler += 1
        # full it stays: the limit a little under what it holds (freed client buffers would let a
        # small write in again, and the test would depend on their size)
        used = int(conn.info("memory")["used_memory"])
        conn.config_set("maxmemory", used - 256 * 1024)
        rc = cli(["enqueue", *map(str, ckpts[:2]), *base])
        out, err = capsys.readouterr()
        assert rc == 2, (out, err)
        assert "Traceback" not in out + err and "OutOfMemoryError" not in out + err
        lines = [ln for ln in err.splitlines() + out.splitlines() if "out of memory" in ln]
        assert len(lines) == 2, (out, err)  # one per checkpoint
        assert all("maxmemory-policy noeviction" in ln and "CONFIG SET maxmemory" in ln for ln in lines), lines
        assert not any((c / ".pins").exists() and any((c / ".pins").iterdir()) for c in ckpts[:2])
        assert conn.keys("rq:job:*") == [f"rq:job:{queued['job_id']}".encode()]

        # a command without handling of its own (`cancel` of the queued job) gets the same sentence
        rc = cli(["cancel", queued["job_id"], "--redis-url", full_redis.url])
        out, err = capsys.readouterr()
        assert rc == 2 and "Traceback" not in out + err, (out, err)
        assert err.startswith("error: Redis refuses writes: it is out of memory") and "CONFIG SET maxmemory" in err
    finally:
        conn.close()


# --------------------------------------------------------------------------- D10: deep JSON

DEEP = "[" * 100_000 + "]" * 100_000  # 100k levels: Python's parser gave up with a bare RecursionError


def test_deep_json_in_config_marker_and_suite_is_a_clear_error_naming_the_file(tmp_path, capsys, redis_url):
    """100k-deep JSON in a drafter's config.json (`import`), a checkpoint's COMPLETE.json and a suite line
    (`enqueue`). On main each was a raw RecursionError traceback; now an error naming the file, rc 2."""
    from eval_worker.cli import main as cli

    root = tmp_path / "ck"
    root.mkdir()

    drafter = root / "zlab-drafter"
    drafter.mkdir()
    (drafter / "config.json").write_text(DEEP)
    (drafter / "model.safetensors").write_bytes(b"\0" * 16)
    rc = cli(["import", str(drafter), "--checkpoint-root", str(root), "--into", str(root)])
    err = capsys.readouterr().err
    assert rc == 2 and str(drafter / "config.json") in err and "nested too deeply" in err, err
    assert "Traceback" not in err and "RecursionError" not in err

    ckpt, _ = fake_checkpoint(root, "run-deep", 1)
    good_marker = (ckpt / "COMPLETE.json").read_bytes()
    (ckpt / "COMPLETE.json").write_text(DEEP)
    rc = cli(["enqueue", str(ckpt), "--target", str(tmp_path), "--checkpoint-root", str(root),
              "--redis-url", redis_url])
    out, err = capsys.readouterr()
    assert rc == 2 and str(ckpt / "COMPLETE.json") in out + err and "nested too deeply" in out + err, (out, err)
    assert "Traceback" not in out + err and "RecursionError" not in out + err

    (ckpt / "COMPLETE.json").write_bytes(good_marker)
    suite = root / "deep.jsonl"
    suite.write_text('{"suite": "deep", "version": "1"}\n' + '{"name": "p0", "prompt": ' + DEEP + "}\n")
    rc = cli(["enqueue", str(ckpt), "--suite", str(suite), "--target", str(tmp_path), "--checkpoint-root",
              str(root), "--redis-url", redis_url])
    out, err = capsys.readouterr()
    assert rc == 2 and f"{suite}:2" in out + err and "nested too deeply" in out + err, (out, err)
    assert "Traceback" not in out + err and "RecursionError" not in out + err

    from dflash_train.common import jsonutil  # the one parser behind all three

    with pytest.raises(json.JSONDecodeError, match="nested too deeply"):
        jsonutil.loads(DEEP)


# --------------------------------------------------------------------------- D14: cache disk full

@pytest.fixture
def small_disk(tmp_path):
    """A real 512 KiB tmpfs (root only; skips elsewhere), filled by `fill()` block by block."""
    import subprocess

    from tests.support import soak

    why = soak.can_mount()
    if why:
        pytest.skip(why)
    mnt = tmp_path / "small-disk"
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(mnt)], check=True, timeout=30)

    def fill() -> None:
        with open(mnt / ".filler", "ab", buffering=0) as fh:
            try:
                while True:
                    fh.write(b"\0" * 4096)
            except OSError:
                pass  # ENOSPC: full by blocks (inodes left: an empty file can still be made)

    try:
        yield mnt, fill
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False, timeout=30)


def test_cache_enospc_degrades_to_evaluating_without_the_cache(small_disk, tmp_path, worker_evaluators, caplog):
    """The reference/feature cache on a disk full by blocks. On main the start-up probe (an empty file)
    passed, and every job evaluated, failed at the cache write ([Errno 28], no path named) and was
    retried: 0 records. Now a full disk at start-up is seen by the probe (real bytes); one that fills
    up later is seen at the first write: either way one warning naming the path, and the job recorded."""
    from pathlib import Path

    from eval_worker.service.worker import evaluators
    from eval_worker.service.worker.eval_job import run_eval_job
    from tests.support.sidecar_support import REPO_ROOT, tiny_target_drafter_config

    target = REPO_ROOT / "dflash_train" / "assets" / "tiny_target"
    mnt, fill = small_disk
    cfg, mask = tiny_target_drafter_config(target)
    root = tmp_path / "ck"
    opts = {"max_new_tokens": 8, "num_prompts": 1, "measure_speed": False}
    caplog.set_level(logging.WARNING)

    # 1. full before the worker starts: the probe says so
    fill()
    assert evaluators._writable_cache_dir(mnt / "cache") is None  # main: the path (an empty file fits)
    assert any("cannot be written" in r.getMessage() and "No space left" in r.getMessage() for r in caplog.records)
    (mnt / ".filler").unlink()
    caplog.clear()

    # 2. room at start-up, full by the time the job writes its entries
    ckpt = publish_random(root, "run-full", 1, target_config=cfg, mask_token_id=mask, seed=1)
    evs = worker_evaluators(WorkerSettings(results_dir=tmp_path / "results", roots=[root], cache_dir=mnt / "cache",
                                           default_target=str(target)))
    evs.get(str(target))  # the worker's preload: the probe passes (the disk has room)
    fill()
    job = make_job(ckpt, suite="builtin:coding-v1", target=str(target), options=opts).to_json()
    out = run_eval_job(job)  # main: OSError [Errno 28] No space left on device, nothing recorded
    assert out["recorded_now"] and Path(out["ledger_path"]).is_file()
    warned = [r.getMessage() for r in caplog.records if "cannot be written" in r.getMessage()]
    assert len(warned) == 1 and str(mnt / "cache") in warned[0] and "No space left" in warned[0], warned
    record = json.loads(Path(out["ledger_path"]).read_text())
    assert isinstance(record["result"]["tau"]["macro"], float)
    assert not [p for p in (mnt / "cache").rglob("*") if p.is_file() and ".tmp-" in p.name]  # no partial entry
    run_eval_job({**job, "attempt": 1})  # the next job: no write tried, no new warning
    assert len([r for r in caplog.records if "cannot be written" in r.getMessage()]) == 1
