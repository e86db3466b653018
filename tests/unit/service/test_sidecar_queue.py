"""The eval queue against a real redis-server: JSON payloads, dedupe, force, priorities, cancel, CLI."""
from __future__ import annotations

import json
import subprocess
import sys
import zlib

import pytest

from eval_worker.cli import main as cli
from eval_worker.redis_client import connect
from eval_worker.results.ledger import Ledger
from eval_worker.service.jobs.builder import make_job
from eval_worker.service.jobs.ids import job_id_for, suite_fingerprint
from eval_worker.service.jobs.schema import SCHEMA, JobError, validate_job
from eval_worker.service.queueing.client import enqueue
from eval_worker.service.queueing.queue import JOB_FUNC, QueueConfig, cancel, fetch_job, get_queue, status
from tests.support.sidecar_support import REPO_ROOT, publish_random


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("roots")
    return root, [publish_random(root, "run-q", step, seed=step) for step in (100, 200)]



def _job(path, **kw):
    return make_job(path, suite="builtin:coding-v1", **kw)


def test_rq_stores_the_job_as_json_not_pickle(conn, ckpts):
    root, (c100, _) = ckpts
    out = enqueue(conn, _job(c100), roots=[root])
    raw = conn.hgetall(f"rq:job:{out.job_id}")
    data = zlib.decompress(raw[b"data"])
    assert not data.startswith(b"\x80")  # a pickle would start with the PROTO opcode
    func, instance, args, kwargs = json.loads(data)
    assert func == JOB_FUNC and instance is None and kwargs == {}
    assert args[0]["schema"] == SCHEMA and args[0]["checkpoint"] == str(c100)
    assert json.loads(raw[b"meta"])["run_id"] == "run-q"
    assert int(raw[b"timeout"]) == QueueConfig().job_timeout
    assert int(raw[b"failure_ttl"]) == QueueConfig().failure_ttl and int(raw[b"result_ttl"]) == QueueConfig().result_ttl
    job = fetch_job(conn, out.job_id)
    assert job.retries_left == QueueConfig().retry_max and job.retry_intervals == QueueConfig().retry_intervals
    assert (root / "run-q" / "step-00000100" / ".pins" / out.job_id).exists()  # kept from retention


def test_same_evaluation_twice_is_a_noop_that_says_so(conn, ckpts):
    root, (c100, _) = ckpts
    first = enqueue(conn, _job(c100))
    second = enqueue(conn, _job(c100))
    assert (first.status, second.status) == ("enqueued", "duplicate")
    assert second.job_id == first.job_id and "already queued" in second.message
    assert get_queue(conn, "dflash-eval").count == 1


def test_force_evaluates_again_under_a_new_attempt(conn, ckpts):
    root, (c100, _) = ckpts
    first = enqueue(conn, _job(c100))
    forced = [enqueue(conn, _job(c100), force=True) for _ in range(2)]
    assert [f.status for f in forced] == ["enqueued", "enqueued"]
    assert [f.job_id for f in forced] == [first.job_id + "-r1", first.job_id + "-r2"]
    assert [f.job.attempt for f in forced] == [1, 2]
    assert get_queue(conn, "dflash-eval").count == 3


def test_recorded_in_ledger_is_not_enqueued_again(conn, ckpts, tmp_path):
    root, (c100, _) = ckpts
    job = _job(c100)
    fp = suite_fingerprint(job.suite)
    job_id = job_id_for(job, fp)
    Ledger(tmp_path, connection=conn).write(job=job, job_id=job_id, result={
        "suite": {"fingerprint": fp}, "tau": {"macro": 2.75}})
    out = enqueue(conn, job)
    assert out.status == "evaluated" and "τ=2.750" in out.message and "--force" in out.message
    assert get_queue(conn, "dflash-eval").count == 0
    assert enqueue(conn, job, force=True).status == "enqueued"


def test_priorities_use_their_own_queues(conn, ckpts):
    _, (c100, c200) = ckpts
    enqueue(conn, _job(c100, priority="high"))
    enqueue(conn, _job(c200, priority="low"))
    assert status(conn)["queues"] == {"dflash-eval-high": 1, "dflash-eval": 0, "dflash-eval-low": 1}


def test_invalid_jobs_never_reach_redis(conn, ckpts, tmp_path):
    root, (c100, _) = ckpts
    with pytest.raises(JobError, match="outside the checkpoint roots"):
        enqueue(conn, _job(c100), roots=[tmp_path])
    unpublished = root / "run-q" / "step-00000300"
    unpublished.mkdir()
    with pytest.raises(JobError, match="COMPLETE.json"):
        enqueue(conn, {**_job(c100).to_json(), "checkpoint": str(unpublished), "step": 300})
    with pytest.raises(JobError, match="unknown job schema version"):
        enqueue(conn, {**_job(c100).to_json(), "schema": "dflash-eval-job/0"})
    assert not conn.keys("rq:job:*")


def test_cancel_a_queued_job(conn, ckpts):
    root, (c100, _) = ckpts
    out = enqueue(conn, _job(c100))
    assert "canceled" in cancel(conn, out.job_id)
    assert fetch_job(conn, out.job_id).get_status().value == "canceled"
    assert get_queue(conn, "dflash-eval").count == 0
    assert not (root / "run-q" / "step-00000100" / ".pins" / out.job_id).exists()
    with pytest.raises(JobError, match="nothing to cancel"):
        cancel(conn, out.job_id)
    with pytest.raises(JobError, match="no job"):
        cancel(conn, "eval-nope")


def test_rq_info_shows_our_queues(conn, ckpts, redis_url):
    _, (c100, c200) = ckpts
    enqueue(conn, _job(c100))
    enqueue(conn, _job(c200))
    out = subprocess.run([sys.executable, "-m", "rq.cli", "info", "--url", redis_url],
                         capture_output=True, text=True, timeout=60, cwd=REPO_ROOT)
    assert out.returncode == 0, out.stderr
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith("dflash-eval "))
    assert " 2, 0 executing, 0 finished, 0 failed" in line, out.stdout


def test_cli_enqueue_status_cancel(redis_url, ckpts, capsys):
    root, (c100, c200) = ckpts
    assert cli(["enqueue", str(c100), str(c200), "--redis-url", redis_url, "--checkpoint-root", str(root)]) == 0
    out = capsys.readouterr().out
    assert [ln.split()[0] for ln in out.splitlines()] == ["enqueued", "enqueued"]
    assert cli(["enqueue", str(c100), "--redis-url", redis_url]) == 0
    assert "already queued" in capsys.readouterr().out
    (root / "half-written").mkdir(exist_ok=True)
    assert cli(["enqueue", str(root / "half-written"), "--redis-url", redis_url]) == 2
    assert "COMPLETE.json" in capsys.readouterr().out
    assert cli(["enqueue", str(root / "run-q"), "--redis-url", redis_url]) == 0  # a run dir: all its checkpoints
    assert [ln.split()[0] for ln in capsys.readouterr().out.splitlines()] == ["duplicate", "duplicate"]
    assert cli(["status", "--redis-url", redis_url]) == 0
    out = capsys.readouterr().out
    assert "dflash-eval=2" in out and "failed (0)" in out
    job_id = job_id_for(_job(c100), suite_fingerprint("builtin:coding-v1"))
    assert cli(["cancel", job_id, "--redis-url", redis_url]) == 0
    assert "canceled" in capsys.readouterr().out
    assert cli(["status", "--json", "--redis-url", redis_url]) == 0
    assert json.loads(capsys.readouterr().out)["queues"]["dflash-eval"] == 1


def test_cli_never_prints_the_password(redis_server, capsys):
    url = f"redis://:hunter2-secret@127.0.0.1:{redis_server.port}/0"
    code = cli(["status", "--redis-url", url])
    captured = capsys.readouterr()
    text = captured.out + captured.err
    assert "hunter2-secret" not in text
    if code != 0:  # this server has no password: AUTH is refused, with the URL redacted
        assert "***" in text


def test_requeue_run_needs_known_steps(redis_url, capsys):
    assert cli(["requeue", "--run", "nope", "--all", "--redis-url", redis_url]) == 2
    assert "no enqueued jobs" in capsys.readouterr().err
    assert cli(["requeue", "--redis-url", redis_url]) == 2
    assert cli(["requeue", "--failed", "--redis-url", redis_url]) == 0
    assert "no failed jobs" in capsys.readouterr().out


def test_rq_dashboard_shows_our_queues_and_jobs(conn, ckpts, redis_url, monkeypatch):
    pytest.importorskip("rq_dashboard")
    from rq.serializers import JSONSerializer
    from rq_dashboard import web
    from rq_dashboard.app import create_app

    _, (c100, _) = ckpts
    out = enqueue(conn, _job(c100))
    monkeypatch.setattr(web.config, "serializer", web.config.serializer)  # restored after the test
    monkeypatch.setenv("RQ_DASHBOARD_REDIS_URL", redis_url)
    monkeypatch.setenv("RQ_DASHBOARD_JSON_SERIALIZER", "true")  # `rq-dashboard --json`: our jobs are JSON
    monkeypatch.setenv("RQ_DASHBOARD_URL_PREFIX", "")
    client = create_app().test_client()
    assert web.config.serializer is JSONSerializer
    queues = client.get("/0/data/queues.json").get_json()["queues"]
    assert {q["name"]: q["count"] for q in queues}["dflash-eval"] == 1
    info = client.get(f"/0/data/job/{out.job_id}.json").get_json()
    assert info["status"] == "queued" and "eval run-q step 100" in info["description"]
    assert json.loads(info["metadata"])["run_id"] == "run-q"


def test_cli_enqueue_several_suites_one_job_each(redis_url, ckpts, capsys):
    """`--suite` repeats: one job per (checkpoint, suite), told apart by the suite's part of the id."""
    root, (c100, _) = ckpts
    conn = connect(redis_url)
    argv = ["enqueue", str(c100), "--suite", "builtin:coding-v1", "--suite", "hf:gsm8k:n=4", "--suite",
            "hf:mt-bench:n=4:seed=0", "--redis-url", redis_url, "--checkpoint-root", str(root), "--json"]
    assert cli(argv) == 0
    outcomes = json.loads(capsys.readouterr().out)["outcomes"]
    assert [o["status"] for o in outcomes] == ["enqueued"] * 3
    suites = [fetch_job(conn, o["job_id"]).meta["suite"] for o in outcomes]
    assert suites == ["builtin:coding-v1", "hf:gsm8k:n=4", "hf:mt-bench:n=4"]  # no dataset needed to queue
    assert len({o["job_id"] for o in outcomes}) == 3
    assert cli(argv[:2] + ["--suite", "hf:gsm8k:n=4", "--redis-url", redis_url, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["outcomes"][0]["status"] == "duplicate"
    assert cli(argv[:2] + ["--suite", "hf:nope", "--redis-url", redis_url]) == 2
    assert "no standard benchmark 'nope'" in capsys.readouterr().out


def test_status_shows_tau_per_suite(redis_url, tmp_path, capsys):
    """A run evaluated on two suites: latest and best τ per suite (one scale each), not one best across them."""
    from tests.support.eval_results import make_result

    conn = connect(redis_url)
    ledger = Ledger(tmp_path / "results", connection=conn)
    taus = {}
    for step, p in ((100, 0.3), (200, 0.5)):
        for suite, spec, q in (("coding", "builtin:coding-v1", p), ("gsm8k-n8", "hf:gsm8k:n=8", p + 0.3)):
            res = make_result("run-s", step, p=q, suite=suite)
            job = validate_job({"schema": "dflash-eval-job/1", "run_id": "run-s", "step": step, "checkpoint": "/x",
                                "checkpoint_digest": res["checkpoint"]["digest"], "suite": spec, "attempt": 0})
            path, record, _ = ledger.write(job=job, job_id=f"eval-run-s-{step}-{suite}", result=res)
            ledger.index(record, path)
            taus[(spec, step)] = res["tau"]["macro"]
    suites = status(conn, run="run-s")["runs"]["run-s"]["suites"]
    assert set(suites) == {"builtin:coding-v1", "hf:gsm8k:n=8"}
    for spec, t in suites.items():
        assert t["evaluated"] == 2 and t["latest"]["step"] == 200
        assert t["best"]["tau"] == pytest.approx(max(taus[(spec, 100)], taus[(spec, 200)]))
    assert cli(["status", "--run", "run-s", "--redis-url", redis_url]) == 0
    out = capsys.readouterr().out
    assert "run-s: 4 evaluated on 2 suites" in out
    assert f"hf:gsm8k:n=8: 2 evaluated; latest τ {taus[('hf:gsm8k:n=8', 200)]:.3f} @ step 200" in out
