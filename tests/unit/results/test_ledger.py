"""The results ledger: atomic, idempotent per attempt, latest pointer, Redis index."""
from __future__ import annotations

import json
import multiprocessing as mp

import pytest

from eval_worker.results.ledger import Ledger, LedgerError, read_record, record_key, tau_of
from eval_worker.service.jobs.schema import validate_job

DIGEST = "ab" * 32


def _job(step=100, attempt=0, run="run-a", **changes):
    return validate_job({"schema": "dflash-eval-job/1", "run_id": run, "step": step,
                         "checkpoint": f"/ck/{run}/step-{step:08d}", "checkpoint_digest": DIGEST,
                         "suite": "builtin:coding-v1", "attempt": attempt, **changes})


def _result(tau, fp="fp0123456789abcd"):
    return {"schema": "dflash-eval-result/1", "suite": {"name": "coding", "version": "1", "fingerprint": fp},
            "tau": {"macro": tau, "pooled": tau, "ci95": [tau - 0.1, tau + 0.1]}}


def test_write_layout_and_read_back(tmp_path):
    ledger = Ledger(tmp_path)
    path, record, created = ledger.write(job=_job(), job_id="eval-a", result=_result(2.5))
    assert created
    key = record_key(_job(), _result(2.5))
    assert path == tmp_path / "run-a" / "step-00000100" / key / "attempt-0.json"
    assert record["key"] == key and record["suite_fingerprint"] == "fp0123456789abcd"
    assert Ledger.root_of(path) == tmp_path.resolve()  # the sinks find the ledger from a record's path
    assert read_record(path) == record and tau_of(record) == 2.5
    assert record["job"]["checkpoint_digest"] == DIGEST and record["job_id"] == "eval-a"
    latest = json.loads((path.parent / "latest.json").read_text())
    assert latest["attempt"] == 0 and latest["path"] == "attempt-0.json"
    assert not [p for p in path.parent.iterdir() if p.name.startswith(".tmp-")]  # no temporary left


def test_same_attempt_is_recorded_once(tmp_path):
    ledger = Ledger(tmp_path)
    p1, r1, c1 = ledger.write(job=_job(), job_id="eval-a", result=_result(2.5))
    p2, r2, c2 = ledger.write(job=_job(), job_id="eval-a", result=_result(9.9))
    assert (c1, c2) == (True, False)
    assert p1 == p2 and r2 == r1 and tau_of(read_record(p1)) == 2.5  # the first record wins, untouched
    assert ledger.find_job(_job(), "eval-a")[0] == p1
    assert ledger.find_job(_job(), "eval-other") is None


def _race(root, tau, queue):
    path, record, created = Ledger(root).write(job=_job(), job_id="eval-a", result=_result(tau))
    queue.put((created, tau_of(record)))


def test_concurrent_writers_of_one_attempt_record_it_once(tmp_path):
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    procs = [ctx.Process(target=_race, args=(tmp_path, 1.0 + i, q)) for i in range(4)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(30)
    outcomes = [q.get(timeout=5) for _ in procs]
    assert sum(created for created, _ in outcomes) == 1
    winner = next(t for created, t in outcomes if created)
    assert {t for _, t in outcomes} == {winner}  # every writer got the one record back
    assert len(list(tmp_path.rglob("attempt-*.json"))) == 1


def test_attempts_latest_and_best(tmp_path):
    ledger = Ledger(tmp_path)
    ledger.write(job=_job(100), job_id="j100", result=_result(2.0))
    ledger.write(job=_job(200), job_id="j200", result=_result(3.0))
    ledger.write(job=_job(300), job_id="j300", result=_result(2.5))
    ledger.write(job=_job(200, attempt=1), job_id="j200-r1", result=_result(3.2))
    entries = ledger.entries("run-a")
    assert [(e.step, e.attempt) for e in entries] == [(100, 0), (200, 1), (300, 0)]
    assert len(ledger.entries("run-a", all_attempts=True)) == 4
    key = record_key(_job(200), _result(3.0))
    latest_200 = json.loads((ledger.record_dir("run-a", 200, key) / "latest.json").read_text())
    assert latest_200["attempt"] == 1
    assert ledger.latest("run-a")["step"] == 300
    best = ledger.best("run-a")
    assert (best["step"], best["attempt"], tau_of(best)) == (200, 1, 3.2)
    assert ledger.runs() == ["run-a"]


def test_redis_index_and_reindex(tmp_path, redis_url):
    from eval_worker.redis_client import connect

    conn = connect(redis_url)
    ledger = Ledger(tmp_path, connection=conn)
    ledger.write(job=_job(100), job_id="eval-x", result=_result(2.0))
    ledger.write(job=_job(100, attempt=2), job_id="eval-x-r2", result=_result(2.4))
    ledger.write(job=_job(100, attempt=1), job_id="eval-x-r1", result=_result(2.2))  # older attempt, later write
    key = record_key(_job(100), _result(2.0))
    s = ledger.lookup("run-a", 100, key)
    assert (s["attempt"], s["tau"]) == (2, 2.4)  # newest attempt wins, whatever the write order
    assert ledger.lookup_job("eval-x")["attempt"] == 2
    assert [x["step"] for x in ledger.indexed("run-a")] == [100]
    conn.flushall()
    assert ledger.lookup("run-a", 100, key) is None
    assert ledger.reindex() == 3
    assert ledger.lookup("run-a", 100, key)["attempt"] == 2


def test_names_that_would_escape_the_results_dir_are_refused(tmp_path):
    ledger = Ledger(tmp_path)
    with pytest.raises(LedgerError, match="cannot name a ledger directory"):
        # a validated job never names such a run; the ledger refuses it all the same (model_copy skips validation)
        ledger.write(job=_job().model_copy(update={"run_id": "../x"}), job_id="j", result=_result(1.0))
    with pytest.raises(LedgerError, match="no suite.fingerprint"):
        ledger.write(job=_job(), job_id="j", result={"tau": {}})


def test_unreadable_record_is_a_clear_error(tmp_path):
    bad = tmp_path / "attempt-0.json"
    bad.write_text("{not json")
    with pytest.raises(LedgerError, match="unreadable"):
        read_record(bad)


# ---- record identity: a write never claims another job's record ----------------------------

def test_ledger_collision_other_options_are_another_record(tmp_path):
    """Same checkpoint, other options (max_new_tokens 16, then 32): two records, each its own τ and job id."""
    ledger = Ledger(tmp_path)
    j16 = _job(options={"max_new_tokens": 16})
    j32 = _job(options={"max_new_tokens": 32})
    p16, r16, c16 = ledger.write(job=j16, job_id="eval-16", result=_result(2.0))
    p32, r32, c32 = ledger.write(job=j32, job_id="eval-32", result=_result(3.0))
    assert c16 and c32 and p16 != p32
    assert (r32["job_id"], tau_of(r32), r32["job"]["options"]) == ("eval-32", 3.0, {"max_new_tokens": 32})
    assert tau_of(read_record(p16)) == 2.0  # the first record is untouched
    assert len(ledger.entries("run-a")) == 2  # both shown
    assert ledger.find_job(j32, "eval-32")[0] == p32


def test_ledger_collision_other_checkpoint_at_the_same_step_is_recorded_next_to_it(tmp_path, redis_url):
    from eval_worker.redis_client import connect

    ledger = Ledger(tmp_path, connection=connect(redis_url))
    other = _job(checkpoint_digest="cd" * 32)
    pa, ra, _ = ledger.write(job=_job(), job_id="eval-a", result=_result(2.0))
    pb, rb, created = ledger.write(job=other, job_id="eval-b", result=_result(4.0))
    assert created and pa != pb
    assert read_record(pa)["checkpoint_digest"] == DIGEST and rb["checkpoint_digest"] == "cd" * 32
    assert sorted(s["checkpoint_digest"] for s in ledger.at_step("run-a", 100)) == sorted([DIGEST, "cd" * 32])
    assert ledger.lookup_job("eval-b")["tau"] == 4.0  # indexed under its own job id: never run again


def test_ledger_collision_same_evaluation_of_another_job_becomes_the_next_attempt(tmp_path):
    """Two job ids, one identity (the options differ only in how the work is done): never claimed."""
    ledger = Ledger(tmp_path)
    a = _job(options={"head_rows": 64})
    b = _job(options={"head_rows": 128, "tree_budget": 8})  # 8 is the default: same evaluation
    pa, ra, _ = ledger.write(job=a, job_id="eval-a", result=_result(2.0))
    pb, rb, created = ledger.write(job=b, job_id="eval-b", result=_result(2.1))
    assert created and pb.parent == pa.parent and (ra["attempt"], rb["attempt"]) == (0, 1)
    assert rb["job_id"] == "eval-b" and read_record(pa)["job_id"] == "eval-a"
    # the same job again (an execution that died after writing) still gets its own record back
    again, rec, created = ledger.write(job=b, job_id="eval-b", result=_result(9.9))
    assert (again, created, tau_of(rec)) == (pb, False, 2.1)
    assert json.loads((pa.parent / "latest.json").read_text())["attempt"] == 1


def test_ledger_collision_identity_covers_digest_suite_target_and_result_options(tmp_path):
    base = record_key(_job(), _result(1.0))
    assert record_key(_job(checkpoint_digest="cd" * 32), _result(1.0)) != base
    assert record_key(_job(), _result(1.0, fp="fedcba9876543210")) != base
    assert record_key(_job(), {**_result(1.0), "target": {"fingerprint": "t2"}}) != base
    assert record_key(_job(options={"mode": "stride"}), _result(1.0)) != base
    assert record_key(_job(options={"backend": "sdpa", "tree_budget": 8}), _result(1.0)) == base
    with pytest.raises(LedgerError, match="checkpoint changed"):
        record_key(_job(), {**_result(1.0), "checkpoint": {"digest": "ee" * 32}})


def test_ledger_files_are_shared_readable(tmp_path):
    import os
    import stat

    old = os.umask(0o077)
    try:
        path, _, _ = Ledger(tmp_path / "results").write(job=_job(), job_id="eval-a", result=_result(2.5))
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644
    assert stat.S_IMODE((path.parent / "latest.json").stat().st_mode) == 0o644
    for d in (path.parent, path.parent.parent, path.parent.parent.parent, tmp_path / "results"):
        assert stat.S_IMODE(d.stat().st_mode) == 0o755, d
