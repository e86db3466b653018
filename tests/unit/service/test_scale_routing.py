"""Many runs, several targets, a pool of workers: routing by target, backlog policies, eval lag.

Real stack: the session's redis-server, real RQ workers (`serve`, burst, in this process) with the
stand-in engine of tests/support/fake_evaluator.py (no model: the queue, ledger and sinks are what is tested),
checkpoints with valid markers and digests (tests/eval_results.fake_checkpoint).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from rq.job import JobStatus

from eval_worker.cli import main as cli
from eval_worker.results.ledger import Ledger
from eval_worker.results.run_results import load_run
from eval_worker.service.jobs.builder import make_job
from eval_worker.service.queueing import routing
from eval_worker.service.queueing.client import enqueue, requeue_run
from eval_worker.service.queueing.queue import QueueConfig, fetch_job, status
from eval_worker.service.worker import evaluators
from eval_worker.service.worker.evaluators import WorkerSettings
from eval_worker.service.worker.worker import serve
from tests.support.eval_results import fake_checkpoint
from tests.support.wandb_reader import read_run

FAKE = "tests.support.fake_evaluator:FakeEvaluator"
BASE = "dflash-eval"



@pytest.fixture
def stack(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_SINKS", "none")  # the sinks' own tests cover W&B; here `publish` is run once
    targets = {name: tmp_path / "targets" / name for name in ("qwen-a", "qwen-b")}
    for t in targets.values():
        t.mkdir(parents=True)
    return {"root": tmp_path / "ck", "results": tmp_path / "results", "targets": targets, "tmp": tmp_path}


def _queue(conn, stack, run: str, steps, *, target=None, config=None, priority="default") -> list[str]:
    ids = []
    for step in steps:
        ck, _ = fake_checkpoint(stack["root"], run, step)
        job = make_job(ck, suite="builtin:coding-v1", target=str(target) if target else None, priority=priority)
        out = enqueue(conn, job, config=config or QueueConfig())
        assert out.status == "enqueued", out.message
        ids.append(out.job_id)
    return ids


def _work(conn, stack, *, serve_targets=(), default_target=None, max_jobs=None, name="w"):
    """One real burst worker serving the plain queues and `serve_targets`' queues."""
    targets = [str(t) for t in serve_targets]
    queues = routing.serving_queue_names(BASE, ["high", "default", "low"], targets)
    settings = WorkerSettings(results_dir=stack["results"], roots=[stack["root"]],
                              target_roots=[stack["tmp"] / "targets"],
                              default_target=str(default_target or next(iter(stack["targets"].values()))),
                              evaluator_factory=FAKE)
    serve(conn, queues, settings, burst=True, preload=default_target is not None, with_scheduler=False,
          name=f"{name}-{stack['tmp'].name}"[:60], max_jobs=max_jobs, route_base=BASE, serve_targets=targets)


def _started(conn, ids) -> list[str]:
    """Job ids in the order a worker started them."""
    return sorted(ids, key=lambda i: fetch_job(conn, i).started_at)


def test_target_routing_each_worker_takes_only_its_targets_and_status_names_the_unserved(conn, stack, capsys,
                                                                                          redis_url):
    a, b = stack["targets"]["qwen-a"], stack["targets"]["qwen-b"]
    routed = QueueConfig(route_by_target=True)
    ids_a = _queue(conn, stack, "run-a", (100, 200), target=a, config=routed)
    ids_b = _queue(conn, stack, "run-b", (100, 200), target=b, config=routed)
    # a job's queue is named by its target's identity; nothing is on the plain queue
    assert {fetch_job(conn, i).origin for i in ids_a} == {f"{BASE}@{routing.target_key(str(a))}"}
    assert {fetch_job(conn, i).origin for i in ids_b} == {f"{BASE}@{routing.target_key(str(b))}"}
    st = status(conn)
    assert st["queues"][BASE] == 0 and st["queued_total"] == 4
    assert sorted((t["target"], t["queued"]) for t in st["targets_without_worker"]) == [(str(a), 2), (str(b), 2)]

    _work(conn, stack, serve_targets=[a], default_target=a, name="wa")
    assert [fetch_job(conn, i).get_status() for i in ids_a] == [JobStatus.FINISHED] * 2
    assert [fetch_job(conn, i).get_status() for i in ids_b] == [JobStatus.QUEUED] * 2  # never taken by A's worker
    assert evaluators.current().loaded_targets() == [str(Path(a).resolve())]  # B was never loaded
    st = status(conn)
    assert [t["target"] for t in st["targets_without_worker"]] == [str(b)]
    assert cli(["status", "--redis-url", redis_url]) == 0
    assert f"target {b}: 2 job(s) queued and no worker serves it" in capsys.readouterr().out

    # priorities keep working inside a target's queues: a high job queued last runs first
    high = _queue(conn, stack, "run-b", (300,), target=b, config=routed, priority="high")
    _work(conn, stack, serve_targets=[b], default_target=b, name="wb")
    assert _started(conn, ids_b + high)[0] == high[0]
    assert status(conn)["targets_without_worker"] == []
    assert sorted(e.step for e in Ledger(stack["results"]).entries("run-b")) == [100, 200, 300]


def test_target_routing_a_worker_serving_two_targets_takes_its_loaded_targets_jobs_first(conn, stack):
    a, b = stack["targets"]["qwen-a"], stack["targets"]["qwen-b"]
    routed = QueueConfig(route_by_target=True)
    first_b = _queue(conn, stack, "run-b", (100, 200), target=b, config=routed)  # queued first
    then_a = _queue(conn, stack, "run-a", (100, 200), target=a, config=routed)
    _work(conn, stack, serve_targets=[a, b], default_target=a, name="wab")  # holds A when it starts
    assert _started(conn, first_b + then_a) == then_a + first_b  # A's jobs, then one swap to B


def test_backlog_policy_thin_skips_all_but_every_kth_and_the_newest_visibly_and_requeueably(conn, stack, capsys,
                                                                                             redis_url):
    thin = QueueConfig(backlog="thin:2")
    ids = _queue(conn, stack, "run-t", (100, 200, 300, 400, 500, 600), config=thin)
    st = status(conn)
    assert [(s["step"], s["job_id"]) for s in st["skipped"]] == [(100, ids[0]), (300, ids[2]), (500, ids[4])]
    assert all(fetch_job(conn, ids[i]).get_status() == JobStatus.CANCELED for i in (0, 2, 4))
    assert cli(["status", "--redis-url", redis_url]) == 0
    assert "skipped by the backlog policy (3):" in capsys.readouterr().out
    _work(conn, stack)
    # the newest (the train-end checkpoint here) and every 2nd are evaluated; nothing else ran
    assert sorted(e.step for e in Ledger(stack["results"]).entries("run-t")) == [200, 400, 600]
    report = requeue_run(conn, "run-t", [300])
    assert [o.status for o in report.outcomes] == ["enqueued"]
    _work(conn, stack, name="w2")
    assert sorted(e.step for e in Ledger(stack["results"]).entries("run-t")) == [200, 300, 400, 600]


def test_backlog_policy_newest_first_serves_each_runs_newest_then_fills_in_newest_first(conn, stack):
    nf = QueueConfig(backlog="newest-first")
    order = [("run-n", 100), ("run-m", 100), ("run-n", 200), ("run-m", 200), ("run-n", 300), ("run-n", 400)]
    ids = {(run, step): _queue(conn, stack, run, (step,), config=nf)[0] for run, step in order}
    plain = _queue(conn, stack, "run-all", (100, 200))  # a run with the default policy: unchanged
    _work(conn, stack)
    started = _started(conn, list(ids.values()) + plain)
    by_id = {v: k for k, v in ids.items()}
    newest_first = [by_id[i] for i in started if i in by_id]
    # each run's newest in the order they were published, then the rest newest first
    assert newest_first == [("run-m", 200), ("run-n", 400), ("run-n", 300), ("run-n", 200), ("run-m", 100),
                            ("run-n", 100)]
    assert [i for i in started if i in plain] == plain
    # older checkpoints are filled in only after every fresh one: none ran before a newest one
    assert started.index(ids[("run-n", 300)]) > max(started.index(i) for i in plain)


def test_eval_lag_in_status_the_ledger_record_and_the_wandb_run(conn, stack, wandb_offline, redis_url, capsys):
    t0 = time.time()
    _queue(conn, stack, "run-l", (100, 200, 300))
    spread = time.time() - t0
    assert status(conn)["runs"] == {}  # nothing evaluated: no lag shown yet
    _work(conn, stack, max_jobs=1)  # FIFO: step 100 only
    lag = status(conn)["runs"]["run-l"]["eval_lag"]
    assert lag["lag_steps"] == 200 and lag["newest_published_step"] == 300
    assert 0 <= lag["lag_s"] <= spread + 0.01
    assert cli(["status", "--redis-url", redis_url]) == 0
    assert "eval lag 200 steps" in capsys.readouterr().out
    _work(conn, stack, name="w2")
    by_step = {r.step: r for r in load_run("run-l", stack["results"])}
    # each record carries the lag when it was written: 300 - 100, 300 - 200, 0
    assert {s: r.queue["eval_lag"]["lag_steps"] for s, r in by_step.items()} == {100: 200, 200: 100, 300: 0}
    assert status(conn)["runs"]["run-l"]["eval_lag"]["lag_steps"] == 0
    # the sink logs it at each checkpoint's step
    assert cli(["publish", "--run", "run-l", "--results", str(stack["results"]), "--wandb-dir",
                str(wandb_offline)]) == 0
    pointer = json.loads((wandb_offline / "run-l-eval.json").read_text())
    log = read_run(pointer["wandb_file"])
    assert log.points("eval/lag_steps") == {100: 200.0, 200: 100.0, 300: 0.0}


def test_backlog_per_target_one_targets_policy_never_holds_back_anothers_newest(conn, stack):
    """One run on two targets, each with its own policy (issue 35 item 10): T1 `thin:2`, T2
    `newest-first`, both routed by target. On main the policies shared one stream per run: T2's
    enqueue demoted T1's step-600 job (T1's newest) to a backlog queue. Now each (run, target) is a
    stream of its own: each target's newest stays next in line, and only its own older job moves."""
    t1, t2 = stack["targets"]["qwen-a"], stack["targets"]["qwen-b"]
    thin = QueueConfig(route_by_target=True, backlog="thin:2")
    nf = QueueConfig(route_by_target=True, backlog="newest-first")
    ids1 = _queue(conn, stack, "run-two", (300, 600), target=t1, config=thin)
    ids2 = _queue(conn, stack, "run-two", (300, 600), target=t2, config=nf)
    fam1, fam2 = routing.routed_base(BASE, str(t1)), routing.routed_base(BASE, str(t2))
    # T1: step 300 was its 1st of 2 (thin:2 skips it), step 600 its newest: queued where it was
    assert fetch_job(conn, ids1[1]).origin == fam1 and fetch_job(conn, ids1[1]).get_status() == JobStatus.QUEUED
    assert [i.decode() for i in conn.lrange(f"rq:queue:{fam1}", 0, -1)] == [ids1[1]]
    # T2: its newest (600) next in line on its own queue, its older one (300) in its own backlog
    queued2 = [i.decode() for i in conn.lrange(f"rq:queue:{fam2}", 0, -1)]
    assert queued2 == [ids2[1]], queued2
    assert [i.decode() for i in conn.lrange(f"rq:queue:{routing.backlog_queue(fam2)}", 0, -1)] == [ids2[0]]
    assert [s["job_id"] for s in status(conn)["skipped"]] == [ids1[0]]
    # every newest checkpoint of every target is evaluated
    _work(conn, stack, serve_targets=[t1, t2], default_target=t1, name="wtwo")
    assert fetch_job(conn, ids1[1]).get_status() == JobStatus.FINISHED
    assert fetch_job(conn, ids2[1]).get_status() == JobStatus.FINISHED


def _records(stack, run: str) -> list[int]:
    return sorted(e.step for e in Ledger(stack["results"]).entries(run, all_attempts=True))


def test_requeue_target_evaluates_a_skipped_job_on_its_own_target_only(conn, stack, capsys, redis_url):
    """Issue 35 item 9: one run on two targets, T1 `thin:2` skipped its step 300. The hint `status` gave,
    `requeue --run R --steps 300`, evaluated step 300 again on both targets (T2's was finished), and the
    skipped job stayed listed as skipped. Now the hint names T1, `requeue --target` takes T1's job alone,
    and a requeued skipped job leaves the skipped list (RQ keeps it canceled, its description says by which
    job it was evaluated)."""
    t1, t2 = stack["targets"]["qwen-a"], stack["targets"]["qwen-b"]
    ids1 = _queue(conn, stack, "run-rq", (300, 600), target=t1, config=QueueConfig(route_by_target=True,
                                                                                    backlog="thin:2"))
    _queue(conn, stack, "run-rq", (300, 600), target=t2, config=QueueConfig(route_by_target=True))
    _work(conn, stack, serve_targets=[t1, t2], default_target=t1, name="wrq")
    # the two (empty) stand-in targets have one fingerprint, so their records share keys: count every attempt
    assert _records(stack, "run-rq") == [300, 600, 600]
    assert cli(["status", "--redis-url", redis_url]) == 0
    out = capsys.readouterr().out
    hint = f"dflash-eval requeue --run run-rq --steps 300 --target {t1}"
    assert f"(`{hint}` evaluates it)" in out, out
    assert f"run=run-rq step=300 target={t1}:" in out

    assert cli(["requeue", *hint.split()[2:], "--redis-url", redis_url]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert len(lines) == 1 and lines[0].startswith("enqueued") and ids1[0] in lines[0], out  # T2's: left alone
    assert status(conn)["skipped"] == []
    assert "skipped by the backlog policy" not in (cli(["status", "--redis-url", redis_url]) or
                                                    capsys.readouterr().out)
    old = fetch_job(conn, ids1[0])
    assert old.get_status() == JobStatus.CANCELED and "[requeued as " in old.description
    _work(conn, stack, serve_targets=[t1, t2], default_target=t1, name="wrq2")
    assert _records(stack, "run-rq") == [300, 300, 600, 600]  # before: 300 three times (T2's again)
    # a target that has no job of the run: said, nothing requeued
    assert cli(["requeue", "--run", "run-rq", "--steps", "300", "--target", str(stack["tmp"] / "other"),
                "--redis-url", redis_url]) == 2
    assert "on target" in capsys.readouterr().err


def test_backlog_thin_skip_is_named_where_rq_shows_canceled(conn, stack):
    """A thin-skipped job is `canceled` to RQ: rq-dashboard and `rq info` show "Canceled" and its
    description, which names the skip; the reason reads "every 2nd", not "a 2-th" (item 17)."""
    ids = _queue(conn, stack, "run-skip", (100, 200), config=QueueConfig(backlog="thin:2"))
    skipped = fetch_job(conn, ids[0])
    assert skipped.get_status() == JobStatus.CANCELED
    assert skipped.description.startswith("SKIPPED by the backlog policy (thin:2 keeps every 2nd checkpoint")
    assert "2-th" not in skipped.meta["skipped"]
    assert [routing._ordinal(k) for k in (2, 3, 4, 11, 12, 13, 21, 22, 23, 101)] == [
        "2nd", "3rd", "4th", "11th", "12th", "13th", "21st", "22nd", "23rd", "101st"]
