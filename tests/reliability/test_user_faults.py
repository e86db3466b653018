"""Faults an outside user runs into, probed with real parts (docs/reliability.md, third round): a target
updated in place under a running worker, a Redis that loses its data (restart without persistence,
eviction on a shared server), a read-only DFLASH_HOME.

Real parts: the bundled tiny target and the real Evaluator, a real redis-server (tests/conftest.py or
a private one configured as the fault needs), real RQ workers, the real hook and ledger.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from eval_worker.service.jobs.builder import make_job
from eval_worker.service.worker.eval_job import run_eval_job
from eval_worker.service.worker.evaluators import WorkerSettings
from tests.support.sidecar_support import REPO_ROOT, publish_random, tiny_target_drafter_config

TINY_TARGET = REPO_ROOT / "dflash_train" / "assets" / "tiny_target"
OPTS = {"max_new_tokens": 8, "num_prompts": 1, "measure_speed": False}


def _record_target(out: dict) -> dict:
    record = json.loads(Path(out["ledger_path"]).read_text())
    return (record.get("result") or record)["target"]


# --------------------------------------------------------------------------- target replaced in place

def test_target_replaced_in_place_is_loaded_again(tmp_path, worker_evaluators, caplog):
    """A user updates the target's weights in place (same path) between two jobs of one worker. The
    second job must measure the new weights, not the copy the worker loaded before (on main: the
    stale copy, recorded under the same path as if it were the update)."""
    import logging

    import torch
    from safetensors.torch import load_file, save_file

    from dflash_train.core.target import Target

    target = tmp_path / "target"
    shutil.copytree(TINY_TARGET, target)
    cfg, mask = tiny_target_drafter_config(target)
    root = tmp_path / "ck"
    ckpt = publish_random(root, "run-tgt", 1, target_config=cfg, mask_token_id=mask, seed=1)
    evs = worker_evaluators(WorkerSettings(results_dir=tmp_path / "results", roots=[root],
                                           cache_dir=tmp_path / "cache", default_target=str(target)))
    job = make_job(ckpt, suite="builtin:coding-v1", target=str(target), options=OPTS).to_json()
    first = _record_target(run_eval_job(job))
    assert first["fingerprint"] == Target.load(target).fingerprint()

    # the update: other weights written beside, renamed over the old file (how a copy tool replaces it)
    weights = load_file(str(target / "model.safetensors"))
    gen = torch.Generator().manual_seed(0)
    weights = {k: v + 0.05 * torch.randn(v.shape, generator=gen, dtype=v.dtype) if v.is_floating_point() else v
               for k, v in weights.items()}
    save_file(weights, str(target / "model.new"))
    os.replace(target / "model.new", target / "model.safetensors")
    updated = Target.load(target).fingerprint()
    assert updated != first["fingerprint"]

    caplog.set_level(logging.WARNING, logger="eval_worker.service.worker.evaluators")
    second = _record_target(run_eval_job({**job, "attempt": 1}))  # `enqueue --force`: a new attempt
    assert second["fingerprint"] == updated  # main: the first fingerprint (the stale copy's)
    assert evs.target_loads(str(target)) == 2
    assert any("changed on disk since it was loaded" in r.getMessage() for r in caplog.records)

    third = run_eval_job({**job, "attempt": 2})  # unchanged since: the loaded copy is kept
    assert _record_target(third)["fingerprint"] == updated and evs.target_loads(str(target)) == 2


# --------------------------------------------------------------------------- Redis loses its data

@pytest.fixture
def volatile_redis(tmp_path):
    """A private redis-server without persistence (no AOF, no RDB): a restart loses every key, as on a
    shared server configured as a cache."""
    yield from _private_redis(tmp_path / "volatile-redis", {"appendonly": "no", "save": ""})


def _private_redis(directory, config: dict):
    """A private redis-server with `config` on top of the embedded server's, stopped after the test."""
    from eval_worker.service.local_redis.server import LocalRedis

    server = LocalRedis(directory, extra_config=config)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def test_redis_data_loss_the_hook_sends_lost_jobs_again_and_each_is_recorded_once(volatile_redis, tmp_path):
    """The hook queued step 1 (running on a real worker) and step 2 (waiting); Redis restarts empty.
    On main both were gone for good: no job, no failure, `status` silent, the pins kept for ever. Now
    the hook sees its jobs missing, unrecorded and still pinned, says so and queues them again; the
    running one is recorded once (its second delivery is not evaluated again)."""
    from eval_worker.redis_client import connect
    from eval_worker.results.ledger import Ledger
    from eval_worker.service.queueing.queue import status
    from hooks.eval_on_checkpoint import EvalOnCheckpoint
    from tests.support.sidecar_support import WorkerProcess, read_calls, wait_for

    root = tmp_path / "ck"
    ckpts = {s: publish_random(root, "run-lost", s, seed=s) for s in (1, 2)}
    calls, gate = tmp_path / "calls.jsonl", tmp_path / "gate"
    worker = WorkerProcess(tmp_path, volatile_redis.url, [root, tmp_path], name="w-volatile", target=tmp_path,
                           args=["--evaluator-factory", "tests.support.sidecar_support:gated_fake_evaluator"],
                           env={"SIDECAR_GATE": str(gate), "SIDECAR_CALLS": str(calls)})
    conn = connect(volatile_redis.url)
    hook = EvalOnCheckpoint(every_n_steps=1, suite="builtin:coding-v1", target=str(tmp_path),
                            redis_url=volatile_redis.url, min_backoff=0.05, max_backoff=0.2, reconcile_interval=0.2)
    try:
        worker.wait_registered(conn)
        for s in (1, 2):
            hook.on_checkpoint_published(None, s, ckpts[s], None)
        wait_for(lambda: read_calls(calls), 60, "step 1 to start on the worker")
        assert hook.flush(30) and [j["step"] for j in status(conn)["queued"]] == [2]

        volatile_redis.stop()
        volatile_redis.start()  # same port, no data
        assert conn.dbsize() == 0 or not conn.exists(f"rq:job:{hook.outcomes[0].job_id}")
        # the worker is still inside step 1 (gated): both show as queued again (main: nothing, for ever)
        wait_for(lambda: sorted(j["step"] for j in status(conn)["queued"]) == [1, 2], 30,
                 "the lost jobs to be queued again")
        assert sorted(hook.resent) == sorted(o.job_id for o in hook.outcomes[:2])
        assert any("Redis no longer has the eval job for step 1" in e for e in hook.errors), hook.errors

        gate.touch()
        ledger = Ledger(tmp_path / "results")
        wait_for(lambda: len(ledger.entries("run-lost", all_attempts=True)) == 2
                 and not status(conn)["queued"] and not status(conn)["running"], 60, "both jobs to be recorded")
        executions = [c["checkpoint"] for c in read_calls(calls)]
        assert sorted(executions) == sorted(str(ckpts[s]) for s in (1, 2)), executions  # one evaluation each
        assert [e.step for e in ledger.entries("run-lost", all_attempts=True)] == [1, 2]  # one record each
        assert status(conn)["failed"] == []
        hook.release_pins()
        pins = {s: sorted(p.name for p in (c / ".pins").glob("*")) for s, c in ckpts.items()}
        assert pins == {1: [], 2: []}, (pins, hook.client.pins)
    finally:
        hook.close()
        worker.stop()
        conn.close()


def test_redis_data_loss_the_results_index_is_rebuilt_from_the_ledger(volatile_redis, tmp_path):
    """A job recorded, then Redis restarts empty. On main `status` showed no results at all (its index
    lives in Redis, nothing rebuilt it) and `enqueue` queued the recorded checkpoint again as new. Now a
    running worker's maintenance sees the index gone, rebuilds it from the ledger files and says so."""
    from eval_worker.redis_client import connect
    from eval_worker.service.queueing.client import enqueue
    from eval_worker.service.queueing.queue import status
    from tests.support.sidecar_support import WorkerProcess, wait_for

    root = tmp_path / "ck"
    ckpt = publish_random(root, "run-index", 4, seed=4)
    worker = WorkerProcess(tmp_path, volatile_redis.url, [root, tmp_path], name="w-index", target=tmp_path,
                           args=["--evaluator-factory", "tests.support.fake_evaluator:FakeEvaluator"])
    conn = connect(volatile_redis.url)
    try:
        worker.wait_registered(conn)
        enqueue(conn, make_job(ckpt, suite="builtin:coding-v1", target=str(tmp_path)))
        wait_for(lambda: status(conn)["runs"].get("run-index"), 60, "the job to be recorded")
        before = status(conn)["runs"]["run-index"]

        volatile_redis.stop()
        volatile_redis.start()  # same port, no data
        assert status(conn)["runs"] == {}  # the gap, until a worker's maintenance pass
        wait_for(lambda: status(conn)["runs"].get("run-index"), 60, "the results index to be rebuilt")
        after = status(conn)["runs"]["run-index"]
        shown = ("evaluated", "latest", "best")  # the eval-lag notes are routing's, not the ledger's
        assert [after[k] for k in shown] == [before[k] for k in shown]
        again = enqueue(conn, make_job(ckpt, suite="builtin:coding-v1", target=str(tmp_path)))
        assert again.status == "evaluated", again.message  # main: "enqueued" as if never evaluated
        assert "index rebuilt from 1 record(s)" in worker.log()
        assert len(list((tmp_path / "results").rglob("attempt-*.json"))) == 1
    finally:
        worker.stop()
        conn.close()


def test_redis_data_loss_a_forced_evaluation_after_it_evaluates_anew(volatile_redis, tmp_path, monkeypatch):
    """Attempts 0 and 1 recorded, Redis restarts empty, a worker rebuilds the results index, the user
    forces one more evaluation. On main the attempt counter restarted at 1: the job got the id of the
    recorded attempt 1 and the worker handed that record back without evaluating ("already recorded")."""
    from eval_worker.redis_client import connect
    from eval_worker.service.queueing.client import enqueue
    from eval_worker.service.worker.worker import serve
    from tests.support.sidecar_support import read_calls

    monkeypatch.setenv("DFLASH_SINKS", "none")
    calls = tmp_path / "calls.jsonl"
    monkeypatch.setenv("SIDECAR_CALLS", str(calls))
    root = tmp_path / "ck"
    ckpt = publish_random(root, "run-force", 5, seed=5)
    settings = WorkerSettings(results_dir=tmp_path / "results", roots=[root, tmp_path], default_target=str(tmp_path),
                              evaluator_factory="tests.support.sidecar_support:gated_fake_evaluator")
    conn = connect(volatile_redis.url)

    def burst():
        serve(conn, ["dflash-eval"], settings, burst=True, preload=False, with_scheduler=False, name="w-force")

    try:
        job = make_job(ckpt, suite="builtin:coding-v1", target=str(tmp_path))
        assert enqueue(conn, job).job.attempt == 0
        burst()
        assert enqueue(conn, job, force=True).job.attempt == 1
        burst()
        volatile_redis.stop()
        volatile_redis.start()  # same port, no data
        burst()  # nothing queued; its maintenance rebuilds the results index from the ledger
        forced = enqueue(conn, job, force=True)
        assert forced.status == "enqueued" and forced.job.attempt == 2, forced.message  # main: attempt 1
        burst()
        assert len(read_calls(calls)) == 3  # main: 2 (the forced job was not evaluated)
        attempts = sorted(p.name for p in (tmp_path / "results").rglob("attempt-*.json"))
        assert attempts == ["attempt-0.json", "attempt-1.json", "attempt-2.json"]
    finally:
        conn.close()


# --------------------------------------------------------------------------- a server that may drop jobs

@pytest.fixture
def evicting_redis(tmp_path):
    """A private redis-server set up as a shared cache often is: 4 MB and `allkeys-lru`."""
    yield from _private_redis(tmp_path / "lru-redis", {"maxmemory": "4mb", "maxmemory-policy": "allkeys-lru"})


def test_server_policy_an_evicting_redis_is_named_by_every_part(evicting_redis, tmp_path, capsys, caplog):
    """Another tenant fills a shared `allkeys-lru` Redis: our queued jobs are evicted like cache keys,
    without a failure anywhere (probed: 5 of 5 queued jobs gone, `status` empty, nothing recorded). On
    main nothing said the server could do that; now the worker, `status` (text and JSON), `enqueue`
    and the hook each name the policy and the fix, and the hook queues its evicted jobs again."""
    import logging

    from eval_worker.cli import main as cli
    from eval_worker.redis_client import connect
    from eval_worker.service.queueing.queue import status
    from hooks.eval_on_checkpoint import EvalOnCheckpoint
    from tests.support.sidecar_support import wait_for

    url = evicting_redis.url
    conn = connect(url)
    root = tmp_path / "ck"
    ckpts = {s: publish_random(root, "run-lru", s, seed=s) for s in (1, 2, 3)}
    said = "maxmemory-policy allkeys-lru"

    assert cli(["enqueue", str(ckpts[3]), "--target", str(tmp_path), "--redis-url", url]) == 0
    assert said in capsys.readouterr().err
    assert cli(["status", "--redis-url", url]) == 0
    assert said in capsys.readouterr().err
    assert any(said in w and "noeviction" in w for w in status(conn)["server_warnings"])

    caplog.set_level(logging.WARNING)
    from eval_worker.service.worker.worker import serve

    serve(conn, ["dflash-eval"], WorkerSettings(results_dir=tmp_path / "results", roots=[root, tmp_path],
                                               default_target=str(tmp_path),
                                               evaluator_factory="tests.support.fake_evaluator:FakeEvaluator"),
          burst=True, preload=False, with_scheduler=False, name="w-lru")
    assert any(said in r.getMessage() for r in caplog.records if r.name == "eval_worker.service.worker.worker")

    # its periodic check at the default interval (30 s): the test runs it itself below
    hook = EvalOnCheckpoint(every_n_steps=1, suite="builtin:coding-v1", target=str(tmp_path), redis_url=url,
                            min_backoff=0.05, max_backoff=0.2)
    try:
        for s in (1, 2):
            hook.on_checkpoint_published(None, s, ckpts[s], None)
        assert hook.flush(30) and any(said in e for e in hook.errors), hook.errors
        ids = [o.job_id for o in hook.outcomes]
        for i in range(100_000):  # the other tenant
            conn.set(f"other:{i}", "x" * 500)
            if i % 500 == 0 and not any(conn.exists(f"rq:job:{j}") for j in ids):
                break
        assert not any(conn.exists(f"rq:job:{j}") for j in ids)  # evicted: gone without a failure
        conn.delete(*conn.keys("other:*"))
        hook.release_pins()  # the periodic check
        assert len(hook.resent) == 2
        wait_for(lambda: sorted(j["step"] for j in status(conn)["queued"]) == [1, 2], 30,
                 "the evicted jobs to be queued again")
    finally:
        hook.close()
        conn.close()


def test_server_policy_a_redis_without_persistence_is_named(volatile_redis):
    from eval_worker.redis_client import connect
    from eval_worker.service.queueing.queue import server_risks

    conn = connect(volatile_redis.url)
    try:
        [risk] = server_risks(conn)
        assert "no AOF, no RDB" in risk and "appendonly yes" in risk
    finally:
        conn.close()


# --------------------------------------------------------------------------- a read-only DFLASH_HOME

@pytest.fixture
def read_only_dir(tmp_path):
    """An empty directory behind a real read-only bind mount (a container's read-only volume). Root only."""
    import subprocess

    from tests.support import soak

    why = soak.can_mount()
    if why:
        pytest.skip(why)
    d = tmp_path / "ro-home"
    d.mkdir()
    subprocess.run(["mount", "--bind", str(d), str(d)], check=True, timeout=30)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(d)], check=True, timeout=30)
        yield d
    finally:
        subprocess.run(["umount", "-l", str(d)], check=False, timeout=30)


def test_read_only_home_the_worker_evaluates_without_its_disk_cache(read_only_dir, tmp_path, worker_evaluators,
                                                                     caplog):
    """DFLASH_HOME (hence the reference/feature cache) on a read-only mount, the ledger on a writable
    volume. On main every job evaluated, then failed at the cache write ([Errno 30]), was retried and
    evaluated again, and ended failed. Now the worker says once that it runs without a disk cache,
    and records the job."""
    import logging

    with pytest.raises(OSError):
        (read_only_dir / "probe").write_text("x")  # the mount really is read-only
    cfg, mask = tiny_target_drafter_config(TINY_TARGET)
    root = tmp_path / "ck"
    ckpt = publish_random(root, "run-ro", 1, target_config=cfg, mask_token_id=mask, seed=1)
    worker_evaluators(WorkerSettings(results_dir=tmp_path / "results", roots=[root],
                                     cache_dir=read_only_dir / "cache", default_target=str(TINY_TARGET)))
    caplog.set_level(logging.WARNING, logger="eval_worker.service.worker.evaluators")
    job = make_job(ckpt, suite="builtin:coding-v1", target=str(TINY_TARGET), options=OPTS).to_json()
    out = run_eval_job(job)  # main: OSError [Errno 30] Read-only file system: '.../ro-home/cache'
    assert out["recorded_now"] and Path(out["ledger_path"]).is_file()
    warned = [r.getMessage() for r in caplog.records if "cannot be written" in r.getMessage()]
    assert len(warned) == 1 and "DFLASH_CACHE_DIR" in warned[0] and "Read-only file system" in warned[0]
    assert list(read_only_dir.iterdir()) == []


# --------------------------------------------------------------------------- drafters that cannot give a τ

def test_unusable_drafters_fail_once_with_the_reason_through_the_worker(conn, tmp_path, monkeypatch):
    """Holds what the probe found right (engine-level twins: tests/unit/engine/test_errors.py): a diverged
    drafter (NaN/Inf weights, as the trainer publishes it), one built for another target, and one whose
    layer ids the target lacks, each queued with 2 retries to a real RQ worker on the tiny target: each
    fails once (no retry), the reason names the fault, nothing is recorded, and no plausible τ appears."""
    import torch
    from rq.job import JobStatus

    from dflash_train.checkpoints.checkpoint import publish_checkpoint
    from dflash_train.core.config import DrafterConfig
    from dflash_train.core.model import DFlashDrafter
    from eval_worker.service.queueing.client import enqueue
    from eval_worker.service.queueing.queue import QueueConfig, failure_reason, fetch_job
    from eval_worker.service.worker.worker import serve

    monkeypatch.setenv("DFLASH_SINKS", "none")
    cfg, mask = tiny_target_drafter_config(TINY_TARGET)
    root = tmp_path / "ck"

    def drafter(**changes):
        c = DrafterConfig.for_target(cfg, mask_token_id=mask, num_hidden_layers=1, num_features=2, block_size=8)
        for k, v in changes.items():
            setattr(c, k, v)
        return DFlashDrafter(c).eval()

    diverged = drafter()
    with torch.no_grad():
        diverged.fc.weight[0, 0] = float("nan")
        diverged.layers[0].mlp.up_proj.weight[1, 1] = float("inf")
    ckpts = {
        "diverged": publish_checkpoint(diverged, root, "run-nan", 1, train_metrics={"loss": float("nan")}),
        "other target": publish_random(root, "run-other", 1, seed=3),  # hidden 32, 6 layers, another vocab
        "layer ids": publish_checkpoint(drafter(target_layer_ids=[0, 99]), root, "run-ids", 1,
                                        train_metrics={"loss": 1.0}),
    }
    expected = {"diverged": "non-finite weights (NaN/Inf) in 2 tensor(s): fc.weight (1 of",
                "other target": "drafter and target do not fit: drafter hidden_size 32 != target hidden size 256",
                "layer ids": "target_layer_ids [99] outside the target's 8 layers"}
    ids = {name: enqueue(conn, make_job(ck, suite="builtin:coding-v1", target=str(TINY_TARGET), options=OPTS),
                         config=QueueConfig(retry_max=2, retry_intervals=[])).job_id for name, ck in ckpts.items()}
    serve(conn, ["dflash-eval"], WorkerSettings(results_dir=tmp_path / "results", roots=[root],
                                                cache_dir=tmp_path / "cache", default_target=str(TINY_TARGET)),
          burst=True, preload=False, with_scheduler=False, name="w-unusable")
    for name, job_id in ids.items():
        job = fetch_job(conn, job_id)
        assert job.get_status() == JobStatus.FAILED and job.retries_left == 0 and len(job.results()) == 1, name
        assert expected[name] in failure_reason(job), (name, failure_reason(job))
    assert list((tmp_path / "results").rglob("attempt-*.json")) == []


def test_read_only_home_without_redis_url_says_what_to_set(read_only_dir, tmp_path, monkeypatch, capsys):
    """No REDIS_URL and DFLASH_HOME read-only: the embedded server cannot start. On main every command
    printed a bare `[Errno 30] Read-only file system: '.../redis'`; now one sentence names the two fixes.
    The hook keeps its job in the outbox beside the checkpoints (nothing lost) and notes the same reason."""
    from dflash_train.common.settings import Settings
    from eval_worker.cli import main as cli
    from hooks.eval_on_checkpoint import EvalOnCheckpoint

    monkeypatch.setenv("DFLASH_HOME", str(read_only_dir))
    monkeypatch.delenv("REDIS_URL", raising=False)
    assert cli(["dismiss", "--all"]) != 0  # a command that needs the server (`status` starts none)
    err = capsys.readouterr().err.strip()
    assert err == (f"error: the embedded redis-server cannot keep its data in {read_only_dir / 'redis'} "
                   "(Read-only file system): set REDIS_URL to a Redis server, or DFLASH_HOME to a writable directory")

    root = tmp_path / "ck"
    ckpt = publish_random(root, "run-rohome", 1, seed=1)
    hook = EvalOnCheckpoint(every_n_steps=1, suite="builtin:coding-v1", target=str(tmp_path),
                            settings=Settings.from_env(), min_backoff=0.05, max_backoff=0.2)
    try:
        hook.on_checkpoint_published(None, 1, ckpt, None)
        assert not hook.flush(1)
        assert any("set REDIS_URL to a Redis server" in e for e in hook.errors), hook.errors
        assert len(list((root / "run-rohome" / ".eval-outbox").glob("*.json"))) == 1  # kept, not set aside
    finally:
        hook.close()
