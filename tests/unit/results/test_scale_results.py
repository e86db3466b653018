"""The queue at scale: what one enqueue and one `status` read from Redis must not grow with the queue.

Counted on the real redis-server (INFO commandstats), not timed: a scan of a run's jobs per
enqueue made enqueueing quadratic in a run's checkpoints, and `status` loaded every queued job
to list 50 of them (bench/scale_results.py has the times at 100,000 jobs).
"""
from __future__ import annotations

import hashlib

from eval_worker.results.ledger import STEP_CKPTS_DONE, STEP_CKPTS_PREFIX, Ledger
from eval_worker.service.queueing.client import enqueue
from eval_worker.service.queueing.queue import QueueConfig, _job_brief, get_queue, status
from eval_worker.service.queueing.rq_jobs import fetch_jobs


def _digest(n: int) -> str:
    return hashlib.sha256(str(n).encode()).hexdigest()


def _job(run: str, step: int, n: int) -> dict:
    return {"schema": "dflash-eval-job/1", "run_id": run, "step": step, "checkpoint": f"/nowhere/{run}/step-{step:08d}",
            "checkpoint_digest": _digest(n), "target": None, "suite": "builtin:coding-v1", "baseline": None,
            "wandb": None, "requested_by": "hook", "priority": "default", "attempt": 0, "train_metrics": None,
            "options": None}


def _calls(conn, command: str) -> int:
    return int((conn.info("commandstats").get(f"cmdstat_{command}") or {}).get("calls", 0))


def _enqueue(conn, run, step, n):
    return enqueue(conn, _job(run, step, n), check=False, config=QueueConfig(retry_max=0), suite_fp="abcd1234")


def test_scale_enqueue_reads_one_set_per_job_not_a_scan_of_the_runs_jobs(conn):
    for i in range(40):
        _enqueue(conn, "run-big", 100 * (i + 1), i)
    conn.config_resetstat()
    for i in range(40, 80):
        _enqueue(conn, "run-big", 100 * (i + 1), i)
    assert _calls(conn, "hscan") == 0 and _calls(conn, "hgetall") == 0
    assert _calls(conn, "smembers") == 40  # one per enqueue, whatever the run's size
    # what the scan answered is still answered: another checkpoint at the same step, queued or recorded
    note = _enqueue(conn, "run-big", 500, 1000).message
    assert f"already has checkpoint(s) {_digest(4)[:12]}..." in note
    record = {"run_id": "run-big", "step": 9900, "suite": "s", "suite_fingerprint": "abcd1234", "key": "k" * 16,
              "attempt": 0, "job_id": "j", "checkpoint_digest": "e" * 64, "result": {}}
    Ledger(connection=conn).index(record, "/r/run-big/step-00009900/kkkk/attempt-0.json")
    assert ("e" * 12) in _enqueue(conn, "run-big", 9900, 2000).message


def test_scale_enqueue_notes_checkpoints_queued_before_the_step_sets_existed(conn):
    _enqueue(conn, "run-old", 100, 1)
    record = {"run_id": "run-old", "step": 200, "suite": "s", "suite_fingerprint": "abcd1234", "key": "k" * 16,
              "attempt": 0, "job_id": "j", "checkpoint_digest": "e" * 64, "result": {}}
    Ledger(connection=conn).index(record, "/r/run-old/step-00000200/kkkk/attempt-0.json")
    for key in conn.scan_iter(STEP_CKPTS_PREFIX + "*"):  # as a Redis written by the previous version
        conn.delete(key)
    conn.srem(STEP_CKPTS_DONE, "run-old")
    assert _digest(1)[:12] in _enqueue(conn, "run-old", 100, 2).message
    assert "e" * 12 in _enqueue(conn, "run-old", 200, 3).message


def test_scale_status_loads_only_the_jobs_it_lists(conn):
    runs = ["run-x", "run-y", "run-z"]
    for i in range(150):
        _enqueue(conn, runs[i % 3], 100 * (i // 3 + 1), i)
    served = get_queue(conn, "dflash-eval").get_job_ids()
    conn.config_resetstat()
    st = status(conn, limit=10)
    assert st["queued_total"] == 150 and [j["job_id"] for j in st["queued"]] == served[:10]
    assert _calls(conn, "hgetall") <= 12  # the 10 listed jobs and our target map, not the 150 queued
    st = status(conn, run="run-y", limit=5)
    assert st["queued_total"] == 50 and [j["job_id"] for j in st["queued"]] == [i for i in served if "run-y" in i][:5]
    full = status(conn)  # --json: every job, in the order served
    assert [j["job_id"] for j in full["queued"]] == served and full["queued_total"] == 150
    # read field by field, each brief is what the whole job says
    assert full["queued"] == [_job_brief(j) for j in fetch_jobs(conn, served)]


def test_scale_worker_catching_up_publishes_a_run_once_not_once_per_job(conn, tmp_path, wandb_offline, monkeypatch):
    """A backlog of one run's jobs: each leaves the sinks to the run's next queued job; the last one
    publishes every record (an offline W&B rebuild costs ~0.1 s per record: per job, it was quadratic)."""
    import json

    from eval_worker.service.jobs.builder import make_job
    from eval_worker.service.queueing.queue import fetch_job
    from eval_worker.service.worker.evaluators import WorkerSettings
    from eval_worker.service.worker.worker import serve
    from tests.support.eval_results import fake_checkpoint
    from tests.support.wandb_reader import read_run

    monkeypatch.delenv("DFLASH_SINKS", raising=False)  # the default: W&B (offline here)
    root = tmp_path / "ck"
    ids = [enqueue(conn, make_job(fake_checkpoint(root, "run-s", step)[0], suite="builtin:coding-v1")).job_id
           for step in (100, 200, 300)]
    other = enqueue(conn, make_job(fake_checkpoint(root, "run-o", 100)[0], suite="builtin:coding-v1")).job_id
    serve(conn, ["dflash-eval"], WorkerSettings(results_dir=tmp_path / "results", roots=[root],
                                                default_target=str(tmp_path),
                                                evaluator_factory="tests.support.fake_evaluator:FakeEvaluator"),
          burst=True, preload=False, with_scheduler=False, name=f"ws-{tmp_path.name}"[:60])
    deferred = [fetch_job(conn, i).return_value()["sinks_deferred_to"] for i in ids + [other]]
    assert deferred == [ids[1], ids[2], None, None]
    pointer = json.loads((wandb_offline / "run-s-eval.json").read_text())
    assert sorted(read_run(pointer["wandb_file"]).points("eval/tau")) == [100, 200, 300]
    assert (wandb_offline / "run-o-eval.json").is_file()  # another run's job is no reason to wait


def test_deferred_sink_failure_still_publishes(conn, tmp_path, wandb_offline, monkeypatch):
    """Issue 34 D3: job 1 leaves the sinks to job 2 of its run (`sinks_deferred_to`), job 2 then fails
    (damaged weights): job 1's record must still reach W&B, published by the failing job."""
    import json

    from eval_worker.service.jobs.builder import make_job
    from eval_worker.service.queueing.queue import fetch_job
    from eval_worker.service.worker.evaluators import WorkerSettings
    from eval_worker.service.worker.worker import serve
    from tests.support.eval_results import fake_checkpoint
    from tests.support.wandb_reader import read_run

    monkeypatch.delenv("DFLASH_SINKS", raising=False)  # the default: W&B (offline here)
    root = tmp_path / "ck"
    first, second = (fake_checkpoint(root, "run-d", step)[0] for step in (100, 200))
    ids = [enqueue(conn, make_job(d, suite="builtin:coding-v1")).job_id for d in (first, second)]
    (second / "model.safetensors").write_bytes(b"damaged after publication")
    serve(conn, ["dflash-eval"], WorkerSettings(results_dir=tmp_path / "results", roots=[root],
                                                default_target=str(tmp_path),
                                                evaluator_factory="tests.support.fake_evaluator:FakeEvaluator"),
          burst=True, preload=False, with_scheduler=False, name=f"wd-{tmp_path.name}"[:60])
    assert fetch_job(conn, ids[0]).return_value()["sinks_deferred_to"] == ids[1]
    assert fetch_job(conn, ids[1]).get_status() == "failed"
    pointer = json.loads((wandb_offline / "run-d-eval.json").read_text())
    assert sorted(read_run(pointer["wandb_file"]).points("eval/tau")) == [100]
    assert not conn.exists("dflash:sinks-owed:run-d")  # paid
