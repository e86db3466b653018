"""W&B sink: what lands in the offline run, read back from the .wandb log itself."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from dflash_train.common.settings import Settings
from eval_worker.results.ledger import Ledger, read_record
from eval_worker.results.sinks import publish_result
from eval_worker.results.sinks.names import scalars
from eval_worker.results.sinks.wandb_lock import LockTimeout, writer_lock
from eval_worker.results.sinks.wandb_payload import marked_html, marked_text
from tests.support.eval_results import fake_checkpoint, make_result, write_ledger
from tests.support.sidecar_support import read_calls, wait_for
from tests.support.wandb_reader import read_run

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture
def env(tmp_path, wandb_offline, monkeypatch):
    results = tmp_path / "results"
    monkeypatch.setenv("DFLASH_RESULTS_DIR", str(results))
    monkeypatch.delenv("DFLASH_SINKS", raising=False)
    return {"results": results, "ckpt": tmp_path / "ckpt", "wandb": wandb_offline}


def record_for(env, run_id: str, step: int, p: float, **kw) -> tuple[dict, dict]:
    ck, digest = fake_checkpoint(env["ckpt"], run_id, step)
    res = make_result(run_id, step, p=p, checkpoint_root=str(env["ckpt"]), digest=digest, **kw)
    record = read_record(write_ledger(env["results"], res))
    return record, res


def current_run(wandb_root: Path, run_id: str):
    pointer = json.loads((wandb_root / f"{run_id}-eval.json").read_text())
    link = wandb_root / f"{run_id}-eval"
    assert link.resolve() == Path(pointer["run_dir"]).resolve(), "symlink and pointer disagree"
    return pointer, read_run(pointer["wandb_file"])


def assert_points(log, expected: dict[int, dict]) -> None:
    """Every scalar of every result at its own train/step, and nothing else."""
    assert sorted(log.points("eval/tau")) == sorted(expected)
    for step, res in expected.items():
        for key, value in scalars(res).items():
            assert log.points(key)[step] == pytest.approx(value), (key, step)


def test_out_of_order_results_land_at_their_training_step(env):
    expected = {}
    for step, p in ((300, 0.75), (100, 0.35), (200, 0.55)):  # a re-queued old checkpoint arrives late
        record, res = record_for(env, "run-a", step, p, baseline_tau=2.0)
        outcome = publish_result(record, record["job"], Settings.from_env())
        assert outcome["wandb"]["ok"], outcome
        expected[step] = res
        pointer, log = current_run(env["wandb"], "run-a")
        assert_points(log, expected)  # each publication is one complete run

    pointer, log = current_run(env["wandb"], "run-a")
    assert (log.run_id, log.group, log.job_type, log.exit_code) == ("run-a-eval", "run-a", "eval", 0)
    # x comes from train/step in the same dict; W&B's own _step is just the row counter (never step=)
    assert all("train/step" in row for row in log.history)
    assert [row["_step"] for row in log.history] == list(range(len(log.history)))
    assert {"glob_name": "eval/*", "step_metric": "train/step"}.items() <= next(
        m for m in log.metrics if m["glob_name"] == "eval/*").items()
    tau_def = next(m for m in log.metrics if m["name"] == "eval/tau")
    assert tau_def["summary_max"] and tau_def["step_metric"] == "train/step"
    assert log.summary["eval/tau"] == {"max": pytest.approx(expected[300]["tau"]["macro"])}

    # the field's names beside ours (sinks/names.py): DeepSpec's/SpecForge's accept_length, accept_rate@i
    from eval_worker.results.sinks.names import aliases

    for step, res in expected.items():
        for key, value in aliases(res).items():
            assert log.points(key)[step] == pytest.approx(value), (key, step)
    assert any(k.endswith("/accept_rate@0") for k in aliases(expected[100]))

    # histogram over accept lengths 1..B, baseline delta, per-position curve, per-prompt table
    for step, res in expected.items():
        row = next(r for r in log.history if r["train/step"] == step)
        assert row["eval/accept_hist/values"] == res["acceptance_histogram"]
        assert row["eval/accept_hist/bins"][0] == 0.5 and len(row["eval/accept_hist/bins"]) == 17
        assert row["eval/delta_tau_vs_baseline"] == pytest.approx(res["baseline"]["delta_tau"])
        assert row["eval/pos_accept/15"] == pytest.approx(res["per_position"]["conditional_accept"][14])
        assert row["eval/prompts/_type"] == "table-file" and row["eval/prompts/nrows"] == len(res["prompts"])
        assert row["eval/pos_curve_table/_type"] == "table-file"
        assert row["eval/accept_len_bar_table/nrows"] == 16
        table = json.loads((Path(pointer["run_dir"]) / "files" / row["eval/prompts/path"]).read_text())
        assert table["columns"][:6] == ["train_step", "prompt", "tau", "baseline_tau", "verify_steps",
                                        "reference_marked"]
        assert [r[0] for r in table["data"]] == [step] * len(res["prompts"])
        first = res["prompts"][0]
        assert table["data"][0][5] == marked_text(first["reference_text"], first["accepted_spans"])

    # checkpoints: reference artifacts (file:// URIs, no upload), best-tau on the best one only
    models = [a for a in log.artifacts if a["type"] == "model"]
    assert len(models) == 3
    for art in models:
        assert all(ref.startswith("file://") for ref in art["refs"]) and len(art["refs"]) == 3
    best = [a for a in models if "best-tau" in a["aliases"]]
    assert len(best) == 1 and "step-300" in best[0]["aliases"]
    assert any(ref.endswith("step-00000300/model.safetensors") for ref in best[0]["refs"])

    # exactly one build is kept: it is the complete run that `wandb sync` should upload
    builds = (env["wandb"] / "builds" / "run-a-eval").iterdir()
    assert [p.name for p in builds] == [Path(pointer["run_dir"]).parents[1].name]
    keys = {e.step: e.key for e in Ledger(env["results"]).entries("run-a")}  # the ledger's record keys
    assert pointer["records"] == [f"{s}:{keys[s]}:0" for s in (100, 200, 300)]


def test_newer_attempt_replaces_the_point_and_best_alias_moves(env):
    r1, res1 = record_for(env, "run-b", 100, 0.7)
    r2, res2 = record_for(env, "run-b", 200, 0.5)
    assert publish_result(r2, r2["job"], Settings.from_env())["wandb"]["ok"]
    # re-evaluation of step 100 (attempt 1) with a worse τ: the ledger's latest attempt wins
    worse = make_result("run-b", 100, p=0.2, checkpoint_root=str(env["ckpt"]), digest=res1["checkpoint"]["digest"])
    r3 = read_record(write_ledger(env["results"], worse, attempt=1))
    assert publish_result(r3, r3["job"], Settings.from_env())["wandb"]["ok"]
    pointer, log = current_run(env["wandb"], "run-b")
    assert log.points("eval/tau") == {100: pytest.approx(worse["tau"]["macro"]),
                                      200: pytest.approx(res2["tau"]["macro"])}
    best = [a for a in log.artifacts if a["type"] == "model" and "best-tau" in a["aliases"]]
    assert len(best) == 1 and "step-200" in best[0]["aliases"]
    assert f"100:{r3['key']}:1" in pointer["records"]


def test_marked_text_and_html_escape_and_survive_bad_spans():
    text = "<b>x</b> & y"
    assert marked_text(text, [[0, 3], [3, 8]]) == "⟦<b>⟧⟦x</b>⟧ & y"
    html = marked_html(text, [[0, 3], [2, 99], ["bad"], [20, 30]])
    assert "<b>" not in html.replace('<pre style="white-space:pre-wrap;font-family:monospace">', "")
    assert "&lt;b&gt;" in html and "&amp;" in html
    assert html.count("<span") == 2  # overlapping span clipped, junk and out-of-range dropped


def test_sink_off_by_env_and_disabled_mode(env, monkeypatch):
    record, _ = record_for(env, "run-c", 100, 0.5)
    monkeypatch.setenv("DFLASH_SINKS", "none")
    assert publish_result(record, record["job"], Settings.from_env()) == {}
    monkeypatch.setenv("DFLASH_SINKS", "wandb")
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert publish_result(record, record["job"], Settings.from_env()) == {"wandb": {"ok": True, "mode": "disabled"}}
    assert not (env["wandb"] / "run-c-eval.json").exists()


def test_sink_failure_is_reported_not_raised(env, monkeypatch):
    record, _ = record_for(env, "run-d", 100, 0.5)
    (env["results"] / "run-d" / "step-00000100" / record["key"] / "attempt-0.json").write_text("{torn")
    out = publish_result(record, record["job"], Settings.from_env())
    assert out["wandb"]["ok"] is False and "attempt-0.json" in out["wandb"]["error"]


def test_redis_lock_excludes_a_second_writer(redis_url, tmp_path):
    inside = threading.Event()
    release = threading.Event()

    def holder():
        with writer_lock("run-x-eval", redis_url=redis_url, lock_dir=tmp_path / "a"):
            inside.set()
            release.wait(10)

    t = threading.Thread(target=holder)
    t.start()
    assert inside.wait(10)
    try:  # a different lock dir: only Redis can stop this writer (another machine)
        with pytest.raises(LockTimeout, match="still held"):
            with writer_lock("run-x-eval", redis_url=redis_url, lock_dir=tmp_path / "b", wait_s=0.5):
                pass
    finally:
        release.set()
        t.join()
    with writer_lock("run-x-eval", redis_url=redis_url, lock_dir=tmp_path / "b", wait_s=2) as kinds:
        assert kinds == ["redis", "file"]


def test_two_worker_processes_publish_to_one_eval_run_without_loss(env, redis_url, tmp_path):
    """Two real `dflash-eval worker` processes take jobs of one run at once; every point lands once.

    The engine is replaced by tests.support.fake_evaluator (seconds, not minutes); queue, worker,
    ledger, sink child processes, Redis lock and W&B are all real.
    """
    from eval_worker.redis_client import connect
    from eval_worker.service.jobs.builder import make_job
    from eval_worker.service.queueing.client import enqueue

    target = tmp_path / "target"
    target.mkdir()
    conn = connect(redis_url)
    steps = list(range(100, 500, 100))
    for step in steps:
        ck, _ = fake_checkpoint(env["ckpt"], "run-w", step)
        job = make_job(ck, suite="builtin:coding-v1", target=target,
                       wandb={"project": "dflash-eval", "group": "run-w", "entity": None, "mode": "offline"})
        assert enqueue(conn, job, roots=[env["ckpt"]]).enqueued
    cmd = [sys.executable, "-m", "eval_worker.cli", "worker", "--redis-url", redis_url, "--burst", "--no-scheduler",
           "--checkpoint-root", str(env["ckpt"]), "--results-dir", str(env["results"]), "--target", str(target),
           "--evaluator-factory", "tests.support.sidecar_support:gated_fake_evaluator", "--log-level", "WARNING"]
    # each engine call waits at a gate until two are in flight: a worker runs one job at a time, so two calls
    # at the gate are two workers, and neither can drain the queue before the other has started (CI once saw it)
    calls, gate = tmp_path / "calls.jsonl", tmp_path / "gate"
    child_env = {**os.environ, "PYTHONPATH": str(REPO), "SIDECAR_CALLS": str(calls), "SIDECAR_GATE": str(gate)}
    child_env.pop("REDIS_URL", None)  # the sink must find the worker's Redis through the RQ job
    workers = [subprocess.Popen(cmd + ["--name", f"w{i}"], env=child_env, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True) for i in range(2)]
    try:
        wait_for(lambda: len(read_calls(calls)) >= 2, 120, "both workers to start a job")
    finally:
        gate.touch()
    for w in workers:
        out, _ = w.communicate(timeout=300)
        assert w.returncode == 0, out[-3000:]
        assert "sink failed" not in out, out[-3000:]

    records = [read_record(p) for p in sorted(env["results"].glob("run-w/step-*/*/attempt-0.json"))]
    assert sorted(r["step"] for r in records) == steps
    assert len({r["worker"]["name"] for r in records}) == 2, "both workers should have taken jobs"

    pubs = [json.loads(line) for line in (env["wandb"] / "run-w-eval.publications.jsonl").read_text().splitlines()]
    # a job whose run has another job queued next leaves the publication to it (eval_job._next_job_of_run)
    assert 1 <= len(pubs) <= len(steps) and all(p["lock"] == ["redis", "file"] for p in pubs)
    spans = sorted((p["locked_at"], p["unlocked_at"]) for p in pubs)
    assert all(a_end <= b_start for (_, a_end),
               (b_start, _) in zip(spans, spans[1:], strict=False)), "two writers held the lock"

    _, log = current_run(env["wandb"], "run-w")
    assert sorted(log.points("eval/tau")) == steps
    for r in records:
        for key, value in scalars(r["result"]).items():
            assert log.points(key)[r["step"]] == pytest.approx(value), (key, r["step"])
    assert len(list((env["wandb"] / "builds" / "run-w-eval").iterdir())) == 1


def test_several_suites_side_by_side_under_their_own_keys(env):
    """eval/<suite>/tau for every suite at each train/step; the first suite also keeps plain eval/tau."""
    expected: dict[str, dict[int, dict]] = {"coding": {}, "gsm8k": {}}
    for step in (100, 200):
        for suite, p, day in (("coding", 0.4, "01"), ("gsm8k", 0.7, "02")):
            ck, digest = fake_checkpoint(env["ckpt"], "run-m", step)
            res = make_result("run-m", step, p=p, checkpoint_root=str(env["ckpt"]), digest=digest, suite=suite)
            res["provenance"]["created_at"] = f"2026-01-{day}T00:00:{step // 100:02d}+00:00"  # coding came first
            record = read_record(write_ledger(env["results"], res))
            assert publish_result(record, record["job"], Settings.from_env())["wandb"]["ok"]
            expected[suite][step] = res
    _, log = current_run(env["wandb"], "run-m")
    for suite, by_step in expected.items():
        points = log.points(f"eval/{suite}/tau")
        assert points == {s: pytest.approx(r["tau"]["macro"]) for s, r in by_step.items()}
        for step, res in by_step.items():
            for key, value in scalars(res, f"eval/{suite}/").items():
                assert log.points(key)[step] == pytest.approx(value), key
        tau_def = next(m for m in log.metrics if m["name"] == f"eval/{suite}/tau")
        assert tau_def["summary_max"] and tau_def["step_metric"] == "train/step"
    # the single-suite keys stay: the primary (first evaluated) suite under plain eval/...
    assert log.points("eval/tau") == {s: pytest.approx(r["tau"]["macro"]) for s, r in expected["coding"].items()}
    rows = [r for r in log.history if "eval/gsm8k/prompts/_type" in r]
    assert len(rows) == 2 and all("eval/tau" not in r for r in rows)  # gsm8k never lands on the primary's curve


def test_object_store_checkpoint_is_logged_by_its_url(env):
    """A result whose checkpoint was pulled from a store names the URL: the artifact records it
    (a small checkpoint.json), no file:// reference to the worker's cache, no credentials."""
    url = "s3://bucket/runs/run-s3/step-00000100"
    res = make_result("run-s3", 100, p=0.5, checkpoint_root=str(env["ckpt"]), digest="ab" * 32)
    res["checkpoint"]["path"] = url  # what the worker records for a pulled checkpoint
    record = read_record(write_ledger(env["results"], res))
    assert publish_result(record, record["job"], Settings.from_env())["wandb"]["ok"]
    pointer, log = current_run(env["wandb"], "run-s3")
    (art,) = [a for a in log.artifacts if a["type"] == "model"]
    assert "step-100" in art["aliases"] and not any(ref and ref.startswith("file://") for ref in art["refs"])
    assert sorted(art["paths"]) == sorted(["checkpoint.json", "config.json", "model.safetensors", "COMPLETE.json"])
    assert art["metadata"]["uri"] == url
    # native s3:// references: artifact.download() fetches the weights from the store, wherever it runs
    assert sorted(r for r in art["refs"] if r) == sorted(f"{url}/{f}" for f in
                                                         ("config.json", "model.safetensors", "COMPLETE.json"))
    staged = art["local_paths"][art["paths"].index("checkpoint.json")]
    if staged and Path(staged).is_file():  # the staged file, until synced
        assert json.loads(Path(staged).read_text())["uri"] == url


def test_local_checkpoint_upload_is_opt_in(env, monkeypatch):
    """By default a local checkpoint is a file:// reference; with DFLASH_WANDB_UPLOAD_CHECKPOINTS=1
    its files are in the artifact itself (usable away from the worker box)."""
    record, _ = record_for(env, "run-up", 100, 0.5)
    assert publish_result(record, record["job"], Settings.from_env())["wandb"]["ok"]
    (art,) = [a for a in current_run(env["wandb"], "run-up")[1].artifacts if a["type"] == "model"]
    assert all(r.startswith("file://") for r in art["refs"])
    monkeypatch.setenv("DFLASH_WANDB_UPLOAD_CHECKPOINTS", "1")
    record, _ = record_for(env, "run-up", 200, 0.6)
    assert publish_result(record, record["job"], Settings.from_env())["wandb"]["ok"]
    arts = [a for a in current_run(env["wandb"], "run-up")[1].artifacts if a["type"] == "model"]
    assert len(arts) == 2 and all(not any(a["refs"]) and "model.safetensors" in a["paths"] for a in arts)
