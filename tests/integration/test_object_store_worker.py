"""Two boxes, no shared filesystem: the trainer's box publishes to an S3-compatible store (a real
moto server over HTTP), `dflash-eval enqueue` queues the store URLs, and a worker on another
local root (it cannot see the trainer's directory) pulls, verifies and evaluates with the real
engine on the bundled tiny target.

Select with `pytest -k "object_store or s3"`.
"""
from __future__ import annotations

import json
import uuid

import pytest

from dflash_train.checkpoints import storage
from dflash_train.checkpoints.publication import MARKER_NAME, read_manifest, upload_checkpoint
from eval_worker.cli import main as cli
from eval_worker.redis_client import connect
from eval_worker.results.ledger import Ledger
from eval_worker.service.jobs.builder import make_job
from eval_worker.service.queueing.client import enqueue
from eval_worker.service.queueing.queue import fetch_job
from tests.integration.test_sidecar_worker import _target
from tests.support.s3_server import CREDENTIALS
from tests.support.sidecar_support import (
    WorkerProcess,
    publish_random,
    tiny_target_drafter_config,
    wait_for,
    write_suite,
)


def _finish(conn, job_id: str, timeout: float = 240):
    job = fetch_job(conn, job_id)
    wait_for(lambda: job.get_status(refresh=True).value in ("finished", "failed"), timeout, job_id)
    return job


@pytest.mark.slow  # ~10-25 s: CI's slow pass (the default suite stays under 10 min on 2 cores)
def test_s3_two_boxes_publish_enqueue_pull_verify_evaluate(tmp_path, redis_url, s3_server, capsys):
    target = _target()
    cfg, mask = tiny_target_drafter_config(target)
    bucket = f"b-{uuid.uuid4().hex[:12]}"
    s3_server.make_bucket(bucket)
    prefix = f"s3://{bucket}/runs"

    # ---- the trainer's box: publish locally (the contract), upload (files, then the marker)
    trainer_box = tmp_path / "trainer-box"
    good = upload_checkpoint(publish_random(trainer_box, "run1", 100, target_config=cfg, mask_token_id=mask),
                             f"{prefix}/run1")
    bad = upload_checkpoint(publish_random(trainer_box, "run1", 200, target_config=cfg, mask_token_id=mask, seed=2),
                            f"{prefix}/run1")
    outside = upload_checkpoint(publish_random(trainer_box, "run9", 100, target_config=cfg, mask_token_id=mask),
                                f"s3://{bucket}/elsewhere/run9")
    # an interrupted upload: every file of step 300 is there, the marker never came
    partial_src = publish_random(trainer_box, "run1", 300, target_config=cfg, mask_token_id=mask, seed=3)
    partial = f"{prefix}/run1/step-00000300"
    store = storage.store_for(partial)
    for f in ("config.json", "model.safetensors"):
        store.put_file(partial_src / f, f"{partial}/{f}")
    # a corrupted object after publication (bit rot, a bad copy): its marker still says the old digest
    data = bytearray(store.read_bytes(f"{bad}/model.safetensors"))
    data[-7] ^= 0x55
    store.write_bytes(f"{bad}/model.safetensors", bytes(data))

    (tmp_path / "suites").mkdir()
    suite_a = write_suite(tmp_path / "suites" / "a.jsonl", n_prompts=2, max_new_tokens=10)
    suite_b = write_suite(tmp_path / "suites" / "b.jsonl", n_prompts=1, max_new_tokens=10)
    conn = connect(redis_url)

    # ---- enqueue from the trainer's box: store URLs; the run prefix expands to its marked steps only
    assert cli(["enqueue", f"{prefix}/run1", "--suite", str(suite_a), "--redis-url", redis_url,
                "--checkpoint-root", prefix, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert sorted(o["job_id"].split("-")[2] for o in out["outcomes"]) == ["100", "200"]  # not 300: no marker
    assert cli(["enqueue", partial, "--suite", str(suite_a), "--redis-url", redis_url, "--checkpoint-root",
                prefix]) == 2
    assert "no COMPLETE.json" in capsys.readouterr().out
    assert cli(["enqueue", outside, "--suite", str(suite_a), "--redis-url", redis_url,
                "--checkpoint-root", prefix]) == 2
    assert "outside the checkpoint prefixes" in capsys.readouterr().out
    ids = {o["job_id"].split("-")[2]: o["job_id"] for o in out["outcomes"]}
    second = enqueue(conn, make_job(good, suite=str(suite_b), roots=[prefix]), roots=[prefix])  # same checkpoint
    # jobs that skipped the enqueue-side checks (another client): the worker refuses them itself
    m = read_manifest(good)
    sneaky_partial = enqueue(conn, {**make_job(good, suite=str(suite_a)).to_json(), "checkpoint": partial, "step": 300},
                             check=False)
    sneaky_outside = enqueue(conn, make_job(outside, suite=str(suite_a)), check=False)

    # ---- the eval box: its own local root (it never sees trainer-box), the store prefix as its only checkpoint root
    eval_box = tmp_path / "eval-box"
    eval_box.mkdir()
    worker = WorkerProcess(eval_box, redis_url, [prefix], name="w-s3", target=target,
                           args=["--burst", "--checkpoint-cache-dir", str(eval_box / "ckcache")],
                           env={"DFLASH_SUITE_ROOTS": str(tmp_path / "suites"), "DFLASH_HOME": str(eval_box / "home")})
    try:
        assert worker.wait(600) == 0, worker.log()
    finally:
        worker.stop()
    log = worker.log()

    ok = _finish(conn, ids["100"])
    assert ok.get_status().value == "finished", ok.latest_result().exc_string
    assert _finish(conn, second.job_id).get_status().value == "finished"
    records = [e.read() for e in Ledger(eval_box / "results").entries("run1")]
    assert sorted((r["step"], r["job"]["suite"]) for r in records) == [(100, str(suite_a)), (100, str(suite_b))]
    for r in records:
        assert r["result"]["checkpoint"]["path"] == good and r["result"]["checkpoint"]["digest"] == m["digest"]
        assert isinstance(r["result"]["tau"]["macro"], float)
    # downloaded once for the two jobs, into the eval box's cache, keyed by the manifest digest
    assert log.count(f"downloaded {good} ") == 1, log
    entries = [p for p in (eval_box / "ckcache").iterdir() if p.is_dir() and not p.name.startswith(".")]
    assert len(entries) == 1 and (entries[0] / MARKER_NAME).read_bytes() == store.read_bytes(f"{good}/{MARKER_NAME}")

    corrupt = _finish(conn, ids["200"])
    assert corrupt.get_status().value == "failed"
    assert "digest mismatch after download: model.safetensors" in corrupt.latest_result().exc_string
    for job, why in ((sneaky_partial, "no COMPLETE.json"), (sneaky_outside, "outside the checkpoint prefixes")):
        j = _finish(conn, job.job_id)
        assert j.get_status().value == "failed" and why in j.latest_result().exc_string
    assert {r["step"] for r in records} == {100}  # nothing recorded for the refused ones
    assert not (tmp_path / "eval-box" / "trainer-box").exists()

    # no secret in what the job, the ledger or the log carry
    secret = CREDENTIALS["AWS_SECRET_ACCESS_KEY"]
    texts = [log] + [p.read_text() for p in (eval_box / "results").rglob("*.json")]
    texts += [json.dumps(fetch_job(conn, i).args) for i in ids.values()]
    assert not any(secret in t or CREDENTIALS["AWS_ACCESS_KEY_ID"] in t for t in texts)
    conn.close()


@pytest.mark.slow  # ~10-25 s: CI's slow pass (the default suite stays under 10 min on 2 cores)
def test_s3_trainer_publishes_to_the_store_off_the_training_thread(tmp_path, redis_url, s3_server, monkeypatch):
    """`publish_to`: the trainer uploads each checkpoint on its publisher thread, the hook queues
    the store URLs (pinned in the store), retention runs on the store, and a worker that sees
    only the store evaluates them."""
    import threading

    from dflash_train.checkpoints import checkpoint as checkpoint_mod
    from dflash_train.checkpoints.publication import is_pinned, list_checkpoints
    from dflash_train.common.settings import Settings
    from dflash_train.training.train_config import TrainConfig
    from dflash_train.training.trainer import train
    from hooks import EvalOnCheckpoint

    target = _target()
    bucket = f"b-{uuid.uuid4().hex[:12]}"
    s3_server.make_bucket(bucket)
    prefix = f"s3://{bucket}/runs"
    threads, real_upload = [], checkpoint_mod.upload_checkpoint
    monkeypatch.setattr(checkpoint_mod, "upload_checkpoint",
                        lambda *a, **k: threads.append(threading.current_thread().name) or real_upload(*a, **k))
    (tmp_path / "suites").mkdir()
    suite = write_suite(tmp_path / "suites" / "s.jsonl", n_prompts=1, max_new_tokens=8)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": f"def f{i}(x):\n    return x + {i}\n" * 3}) + "\n" for i in range(8)))
    home = tmp_path / "trainer-home"
    hook = EvalOnCheckpoint(every_n_steps=4, suite=str(suite), target=str(target), redis_url=redis_url,
                            settings=Settings.from_env({"DFLASH_HOME": str(home)}))
    summary = train(TrainConfig(target=str(target), data=str(data), regenerate=False, max_steps=6, publish_every=2,
                                keep_last=1, batch_size=2, num_anchors=4, max_seq_len=64, seq_multiple=0, block_size=8,
                                progress=False, checkpoint_root=str(tmp_path / "trainer-box"), run_id="st",
                                publish_to=prefix, log_every=2), callbacks=[hook])
    assert summary.step == 6 and not hook.errors, hook.errors
    assert threads and set(threads) == {"checkpoint-publisher"}  # never the training thread
    jobs = [o.job for o in hook.outcomes]
    assert [j.checkpoint for j in jobs] == [f"{prefix}/st/step-00000004", f"{prefix}/st/step-00000006"]
    assert (home / "outbox" / "st").is_dir()  # the hook's outbox is local, the checkpoints are not
    # retention on the store: keep_last=1 plus the pinned ones (their jobs are queued)
    assert list_checkpoints(f"{prefix}/st") == [j.checkpoint for j in jobs]
    assert all(is_pinned(j.checkpoint) for j in jobs)

    eval_box = tmp_path / "eval-box"
    eval_box.mkdir()
    worker = WorkerProcess(eval_box, redis_url, [prefix], name="w-s3-train", target=target, args=["--burst"],
                           env={"DFLASH_SUITE_ROOTS": str(tmp_path / "suites"), "DFLASH_HOME": str(eval_box / "home")})
    try:
        assert worker.wait(600) == 0, worker.log()
    finally:
        worker.stop()
    records = [e.read() for e in Ledger(eval_box / "results").entries("st")]
    assert sorted(r["step"] for r in records) == [4, 6]
    assert not any(is_pinned(j.checkpoint) for j in jobs)  # the worker released its pins in the store
    assert (eval_box / "home" / "checkpoint-cache").is_dir()


def test_s3_upload_owed_when_the_run_stopped_is_made_on_restart(tmp_path, s3_server, monkeypatch):
    """A checkpoint published locally whose upload failed (the store was down, the job was killed)
    is uploaded when the run starts again, before training resumes."""
    import pytest

    from dflash_train.checkpoints import checkpoint as checkpoint_mod
    from dflash_train.checkpoints.publication import CheckpointError, list_checkpoints
    from dflash_train.training.train_config import TrainConfig
    from dflash_train.training.trainer import train

    target = _target()
    bucket = f"b-{uuid.uuid4().hex[:12]}"
    s3_server.make_bucket(bucket)
    prefix = f"s3://{bucket}/runs"
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": f"def f{i}(x):\n    return x + {i}\n" * 3}) + "\n" for i in range(8)))
    real_upload = checkpoint_mod.upload_checkpoint

    def store_down_at_step_4(path, run_url, **kw):
        if str(path).endswith("step-00000004"):
            raise storage.StoreUnavailable("connection refused (simulated)")
        return real_upload(path, run_url, **kw)

    config = dict(target=str(target), data=str(data), regenerate=False, publish_every=2, keep_last=0, batch_size=2,
                  num_anchors=4, max_seq_len=64, seq_multiple=0, block_size=8, progress=False,
                  checkpoint_root=str(tmp_path / "trainer-box"), run_id="owed", publish_to=prefix, log_every=2)
    monkeypatch.setattr(checkpoint_mod, "upload_checkpoint", store_down_at_step_4)
    with pytest.raises(CheckpointError, match="connection refused"):
        train(TrainConfig(max_steps=4, **config))
    assert [p.name for p in list_checkpoints(tmp_path / "trainer-box" / "owed")] == ["step-00000002", "step-00000004"]
    assert list_checkpoints(f"{prefix}/owed") == [f"{prefix}/owed/step-00000002"]
    monkeypatch.setattr(checkpoint_mod, "upload_checkpoint", real_upload)
    train(TrainConfig(max_steps=6, **config))  # resumes from step 4's training state
    assert list_checkpoints(f"{prefix}/owed") == [f"{prefix}/owed/step-0000000{s}" for s in (2, 4, 6)]
