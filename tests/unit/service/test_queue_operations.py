"""Operations on the queue a user reaches for: job ids in `status`, dismissing failures, partial requeue."""
from __future__ import annotations

import json

import pytest
from rq.job import JobStatus

from eval_worker.cli import main as cli
from eval_worker.service.jobs.builder import make_job
from eval_worker.service.jobs.schema import JobError
from eval_worker.service.queueing.client import enqueue
from eval_worker.service.queueing.queue import QueueConfig, dismiss_failed, fetch_job, get_queue, status
from eval_worker.service.worker.evaluators import WorkerSettings
from eval_worker.service.worker.worker import serve
from tests.support.sidecar_support import publish_random


def _fail_jobs(conn, root, tmp_path, paths):
    """Queue jobs for `paths`, break their weights, and let a real burst worker fail them (digest
    mismatch: not retryable, so they land in the failed registry at once, no target is loaded)."""
    ids = [enqueue(conn, make_job(p, suite="builtin:coding-v1"), config=QueueConfig(retry_max=0)).job_id
           for p in paths]
    for p in paths:
        (p / "model.safetensors").write_bytes(b"not the published weights")
    serve(conn, ["dflash-eval"], WorkerSettings(results_dir=tmp_path / "results", roots=[root]), burst=True,
          preload=False, with_scheduler=False, name=f"w-{tmp_path.name}"[:60])
    assert all(fetch_job(conn, i).get_status() == JobStatus.FAILED for i in ids)
    return ids


def test_status_lists_every_job_id_text_and_json(redis_url, conn, tmp_path, capsys):
    root = tmp_path / "ck"
    paths = [publish_random(root, "run-s", step, seed=step) for step in (10, 20, 30)]
    queued = [enqueue(conn, make_job(p, suite="builtin:coding-v1"), config=QueueConfig()).job_id
              for p in paths[:2]]
    high = enqueue(conn, make_job(paths[2], suite="builtin:coding-v1", priority="high")).job_id
    st = status(conn)
    assert [j["job_id"] for j in st["queued"]] == [high, *queued]  # the order workers take them in
    assert cli(["status", "--redis-url", redis_url]) == 0
    out = capsys.readouterr().out
    assert "queued (3):" in out and all(i in out for i in [high, *queued])
    assert cli(["status", "--json", "--run", "run-s", "--redis-url", redis_url]) == 0
    data = json.loads(capsys.readouterr().out)
    assert {j["job_id"] for j in data["queued"]} == {high, *queued}
    assert {(j["run_id"], j["step"]) for j in data["queued"]} == {("run-s", 10), ("run-s", 20), ("run-s", 30)}
    assert cli(["status", "--json", "--run", "other", "--redis-url", redis_url]) == 0
    assert json.loads(capsys.readouterr().out)["queued"] == []
    # the id `status` shows is the id `cancel` takes
    assert cli(["cancel", queued[0], "--redis-url", redis_url]) == 0
    assert queued[0] not in {j["job_id"] for j in status(conn)["queued"]}


def test_dismiss_failed_jobs(redis_url, conn, tmp_path, capsys):
    root = tmp_path / "ck"
    paths = [publish_random(root, "run-d", step, seed=step) for step in (1, 2, 3)]
    ids = _fail_jobs(conn, root, tmp_path, paths)
    assert {j["job_id"] for j in status(conn)["failed"]} == set(ids)
    assert all((p / ".pins" / i).exists() for p, i in zip(paths, ids, strict=True))  # failed jobs stay pinned

    with pytest.raises(JobError, match="dismiss"):  # cancel points at the right command
        from eval_worker.service.queueing.queue import cancel
        cancel(conn, ids[0])
    assert cli(["dismiss", ids[0], "--redis-url", redis_url]) == 0
    assert capsys.readouterr().out.strip() == f"dismissed {ids[0]}"
    assert {j["job_id"] for j in status(conn)["failed"]} == set(ids[1:])
    with pytest.raises(JobError, match="no job"):
        fetch_job(conn, ids[0])
    assert not (paths[0] / ".pins" / ids[0]).exists()  # retention may remove it now

    # an id that is not a failed job is named, the others still go; exit status says so
    other = enqueue(conn, make_job(publish_random(root, "run-d", 4, seed=4), suite="builtin:coding-v1")).job_id
    assert cli(["dismiss", ids[1], other, "--redis-url", redis_url]) == 2
    captured = capsys.readouterr()
    assert f"dismissed {ids[1]}" in captured.out and f"{other} is queued, not failed" in captured.err
    assert get_queue(conn, "dflash-eval").count == 1  # the queued job was left alone

    assert cli(["dismiss", "--all", "--run", "someone-else", "--redis-url", redis_url]) == 0
    assert "no failed jobs" in capsys.readouterr().out
    assert dismiss_failed(conn, run="run-d") == ([ids[2]], [])
    assert status(conn)["failed"] == []
    assert cli(["dismiss", "--redis-url", redis_url]) == 2  # nothing named, no --all


def test_requeue_requeues_what_exists_and_reports_what_does_not(redis_url, conn, tmp_path, capsys):
    root = tmp_path / "ck"
    paths = [publish_random(root, "run-p", step, seed=step) for step in (10, 20)]
    ids = _fail_jobs(conn, root, tmp_path, paths[:1])
    enqueue(conn, make_job(paths[1], suite="builtin:coding-v1"))  # queued: left as it is
    assert cli(["requeue", "--run", "run-p", "--steps", "10,20,99", "--redis-url", redis_url]) == 1
    out = capsys.readouterr().out.splitlines()
    assert [ln.split()[0] for ln in out] == ["requeued", "skipped", "missing"]
    assert "step 99" in out[2] and "enqueue" in out[2]
    assert fetch_job(conn, ids[0]).get_status() == JobStatus.QUEUED  # step 10 went back despite step 99
    assert cli(["requeue", "--run", "run-p", "--steps", "98,99", "--json", "--redis-url", redis_url]) == 2
    assert "no enqueued job for step(s) [98, 99]" in capsys.readouterr().err
    assert cli(["requeue", "--run", "run-p", "--steps", "20", "--json", "--redis-url", redis_url]) == 0
    assert [ln["status"] for ln in json.loads(capsys.readouterr().out)] == ["skipped"]


def test_the_worker_logs_each_jobs_tau_ci_and_duration(conn, tmp_path, caplog, monkeypatch):
    import logging
    import re

    monkeypatch.setenv("DFLASH_SINKS", "none")  # read by WorkerSettings' Settings.from_env below
    root = tmp_path / "ck"
    path = publish_random(root, "run-l", 100, seed=3)
    job_id = enqueue(conn, make_job(path, suite="builtin:coding-v1", target=str(tmp_path))).job_id
    caplog.set_level(logging.INFO, logger="eval_worker.service.worker.eval_job")
    serve(conn, ["dflash-eval"], WorkerSettings(results_dir=tmp_path / "results", roots=[root, tmp_path],
                                                default_target=str(tmp_path),
                                                evaluator_factory="tests.support.fake_evaluator:FakeEvaluator"),
          burst=True, preload=False, with_scheduler=False, name=f"wl-{tmp_path.name}"[:60])
    assert fetch_job(conn, job_id).get_status() == JobStatus.FINISHED
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith(f"job {job_id}:")]
    assert len(lines) == 1, [r.getMessage() for r in caplog.records]
    record = json.loads(next((tmp_path / "results" / "run-l").rglob("attempt-0.json")).read_text())
    tau = record["result"]["tau"]
    m = re.search(r"run run-l step 100 suite \S+: τ ([\d.]+) \(95% CI \[([\d.]+), ([\d.]+)\], (\d+) verify steps\) "
                  r"in \d+s; recorded at (\S+)", lines[0])
    assert m, lines[0]
    assert [float(x) for x in m.group(1, 2, 3)] == [round(tau["macro"], 3), *(round(x, 3) for x in tau["ci95"])]
    assert int(m.group(4)) == tau["num_steps"] and m.group(5).endswith("attempt-0.json")


def test_submission_expands_run_directories_and_queues_one_job_per_checkpoint_and_suite(conn, tmp_path):
    """The service behind `enqueue`: a run directory stands for its checkpoints, a suite named twice is one job,
    a checkpoint that cannot be made into a job is an error with its reason, the others are queued."""
    from eval_worker.service.jobs.request import EvalRequest
    from eval_worker.service.queueing.client import JobClient
    from eval_worker.service.queueing.submission import Submission, expand_checkpoints, is_published

    root = tmp_path / "ck"
    ck = {s: publish_random(root, "run-s", s) for s in (1, 2)}
    (tmp_path / "plain").mkdir()
    paths = expand_checkpoints([str(root / "run-s"), str(tmp_path / "plain")])
    assert paths == [str(ck[1]), str(ck[2]), str(tmp_path / "plain")]
    assert is_published(str(root / "run-s")) and not is_published(str(tmp_path / "plain"))
    sub = Submission(EvalRequest.of(suites=["builtin:coding-v1", "builtin:coding-v1"], priority="high"), roots=[root])
    sub.make_jobs(paths)
    assert [(j.step, j.priority) for j in sub.jobs] == [(1, "high"), (2, "high")]
    [error] = sub.errors
    assert error["checkpoint"] == str(tmp_path / "plain") and "outside the checkpoint roots" in error["error"]
    sub.enqueue_all(JobClient(connection=conn, roots=[root]))
    assert [o.status for o in sub.outcomes] == ["enqueued", "enqueued"]
    assert get_queue(conn, "dflash-eval-high").count == 2
    again = Submission(EvalRequest.of(suites=["builtin:coding-v1"], priority="high"), roots=[root])
    again.make_jobs([str(ck[1])])
    again.enqueue_all(JobClient(connection=conn, roots=[root]))
    assert [o.status for o in again.outcomes] == ["duplicate"] and not again.errors
