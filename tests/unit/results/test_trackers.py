"""The TensorBoard and MLflow sinks over real backends, and the field's metric names.

TensorBoard: event files read back with `tensorboard.backend.event_processing`. MLflow: a real local
tracking store (sqlite) and an `mlflow server` on 127.0.0.1.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from dflash_train.common.settings import Settings
from eval_worker.engine import metrics
from eval_worker.results.ledger import read_record
from eval_worker.results.sinks import publish_result
from eval_worker.results.sinks.names import aliases, points
from tests.support.eval_results import fake_checkpoint, make_result, write_ledger
from tests.unit.core.test_counting_rules import (
    SpecDecodingStats,
    deepspec_generate_like,
    deepspec_metrics_row,
    vllm_serve_like,
)


def record_for(tmp_path, run_id, step, p, **kw):
    ck, digest = fake_checkpoint(tmp_path / "ckpt", run_id, step)
    res = make_result(run_id, step, p=p, checkpoint_root=str(tmp_path / "ckpt"), digest=digest, **kw)
    return read_record(write_ledger(tmp_path / "results", res)), res


def read_events(run_dir):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0, "histograms": 0, "images": 0})
    acc.Reload()
    return acc


# --------------------------------------------------------------------------- metric aliases


def test_metric_aliases_equal_deepspec_and_vllm_figures():
    """accept_length is DeepSpec's acceptance_length under --counting deepspec; accept_rate@i is vLLM's
    per-position rate under --counting vllm (both read off a result built from our walks)."""
    rng = np.random.default_rng(7)
    B, max_new, eos = 5, 20, 0
    for _ in range(30):
        prompts = []
        for _ in range(3):
            raw = rng.integers(0, 3, size=max_new + B).tolist()
            tokens = raw[:max_new]
            if eos in tokens:
                tokens = tokens[:tokens.index(eos) + 1]
            ext = tokens + raw[len(tokens):len(tokens) + B - 1]
            drafts = rng.integers(0, 3, size=(len(tokens), B - 1)).tolist()
            prompts.append((tokens, ext, drafts))

        def result(counting, prompts=prompts):
            from eval_worker.engine.drafting import AnchorDrafts
            from eval_worker.engine.scoring import score_prompt

            per = [score_prompt("x", ext, len(t), AnchorDrafts(np.arange(len(t)), np.array(d)), B, counting=counting,
                                ends_with_stop=t[-1] == eos, stop_offset=ext.index(eos) if eos in ext else None
                                ).online.accept_lengths for t, ext, d in prompts]
            steps = [a for p in per for a in p]
            return {"suite": {"name": "gsm8k"}, "settings": {"block_size": B},
                    "tau": {"pooled": metrics.macro_pooled(per)[1]},
                    "acceptance_histogram": metrics.histogram(steps, B) if steps else []}

        ds = deepspec_metrics_row([deepspec_generate_like(e, d, max_new, eos) for _, e, d in prompts], B - 1)
        a = aliases(result("deepspec"))
        if ds[0]:
            assert a["eval/gsm8k/accept_length"] == pytest.approx(ds[0], rel=1e-12)
        stats = SpecDecodingStats(B - 1)
        for _, e, d in prompts:
            vllm_serve_like(e, d, max_new, eos, stats)
        a = aliases(result("vllm"))
        if stats.num_drafts:
            assert [a[f"eval/gsm8k/accept_rate@{i}"] for i in range(B - 1)] == pytest.approx(stats.rates(), rel=1e-12)
            assert a["eval/gsm8k/accept_length"] == pytest.approx(stats.acceptance_len(), rel=1e-12)


def test_metric_aliases_documented_in_one_table():
    """Every alias key a result produces is a row of the docs' table."""
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[3] / "docs" / "design.md").read_text()
    table = doc[doc.index("### Metric names and aliases"):]
    keys = {k.split("/", 2)[2].split("@")[0] for k in aliases(make_result("r", 1, block_size=4))}
    assert keys == {"accept_length", "accept_rate", "verify_rate"}
    for k in keys:
        assert f"`eval/<suite>/{k}" in table, k


# --------------------------------------------------------------------------- TensorBoard


@pytest.mark.slow  # 13-31 s (an MLflow store or TensorBoard reader starting): CI's slow pass
def test_tensorboard_sink_out_of_order_steps_read_back(tmp_path, monkeypatch):
    """Results published out of order (a re-queued old checkpoint arrives last) read back in step order,
    every scalar and alias at its training step, the histogram and the per-position image present;
    republishing is idempotent; a newer attempt replaces its step's points."""
    monkeypatch.setenv("DFLASH_SINKS", "tensorboard")
    monkeypatch.setenv("DFLASH_RESULTS_DIR", str(tmp_path / "results"))
    monkeypatch.setenv("DFLASH_TENSORBOARD_DIR", str(tmp_path / "tb"))
    expected = {}
    for step, p in ((300, 0.75), (100, 0.35), (200, 0.55)):
        record, res = record_for(tmp_path, "run-a", step, p)
        outcome = publish_result(record, record["job"], Settings.from_env())
        assert outcome["tensorboard"]["ok"], outcome
        expected[step] = res
    run_dir = tmp_path / "tb" / "run-a-eval"
    assert len(list(run_dir.glob("events.out.tfevents.*"))) == 1  # one complete file, swapped in
    acc = read_events(run_dir)
    for step, res in expected.items():
        for key, value in points(res, res["suite"]["name"]).items():
            got = {e.step: e.value for e in acc.Scalars(key)}
            assert got[step] == pytest.approx(value, rel=1e-6), (key, step)
    assert [e.step for e in acc.Scalars("eval/tau")] == [100, 200, 300]
    name = expected[100]["suite"]["name"]
    assert f"eval/{name}/accept_length" in acc.Tags()["scalars"]
    hist = {e.step: e.histogram_value for e in acc.Histograms(f"eval/{name}/accept_hist")}
    assert sorted(hist) == [100, 200, 300]
    assert list(hist[200].bucket) == expected[200]["acceptance_histogram"]
    assert [e.step for e in acc.Images(f"eval/{name}/pos_curve")] == [100, 200, 300]
    assert acc.Images(f"eval/{name}/pos_curve")[0].encoded_image_string[:8] == b"\x89PNG\r\n\x1a\n"

    from eval_worker.results.sinks.tensorboard_sink import TensorBoardTarget, publish_run

    target = TensorBoardTarget(root=tmp_path / "tb")
    assert publish_run("run-a", target, results_dir=tmp_path / "results")["skipped"] == "up to date"
    # a newer attempt at step 200: the rebuild replaces the point (no duplicate at that step)
    ck, digest = fake_checkpoint(tmp_path / "ckpt", "run-a", 200)
    newer = make_result("run-a", 200, p=0.9, checkpoint_root=str(tmp_path / "ckpt"), digest=digest)
    write_ledger(tmp_path / "results", newer, attempt=1)
    publish_run("run-a", target, results_dir=tmp_path / "results")
    acc = read_events(run_dir)
    taus = [(e.step, e.value) for e in acc.Scalars("eval/tau")]
    assert [s for s, _ in taus] == [100, 200, 300]
    assert dict(taus)[200] == pytest.approx(newer["tau"]["macro"], rel=1e-6) != pytest.approx(
        expected[200]["tau"]["macro"], rel=1e-6)


def test_tensorboard_sink_failure_keeps_the_result_and_publish_rebuilds(tmp_path, monkeypatch):
    """An unwritable root fails the sink, not the job; `dflash-eval publish --sink tensorboard` rebuilds."""
    blocked = tmp_path / "blocked"
    blocked.write_text("a file where the directory should be")
    monkeypatch.setenv("DFLASH_SINKS", "tensorboard")
    monkeypatch.setenv("DFLASH_RESULTS_DIR", str(tmp_path / "results"))
    monkeypatch.setenv("DFLASH_TENSORBOARD_DIR", str(blocked))
    record, res = record_for(tmp_path, "run-b", 50, 0.5)
    outcome = publish_result(record, record["job"], Settings.from_env())
    assert not outcome["tensorboard"]["ok"] and "tensorboard" in outcome["tensorboard"]["error"].lower()
    out = subprocess.run([sys.executable, "-m", "eval_worker.cli", "publish", "--run", "run-b", "--sink", "tensorboard",
                          "--results", str(tmp_path / "results"), "--tensorboard-dir", str(tmp_path / "tb")],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    acc = read_events(tmp_path / "tb" / "run-b-eval")
    assert [(e.step, round(e.value, 6)) for e in acc.Scalars("eval/tau")] == [(50, round(res["tau"]["macro"], 6))]


# --------------------------------------------------------------------------- MLflow

def _mlflow_run(client, run_id):
    exps = client.search_experiments()
    runs = client.search_runs([e.experiment_id for e in exps], filter_string=f"tags.`dflash.train_run` = '{run_id}'")
    assert len(runs) == 1, runs  # one MLflow run per training run
    return runs[0]


@pytest.mark.slow  # 13-31 s (an MLflow store or TensorBoard reader starting): CI's slow pass
def test_mlflow_sink_local_sqlite_store(tmp_path, monkeypatch):
    """Out-of-order results into a local sqlite tracking store: one run, each metric at its training
    step, params = the eval settings, every record and the report as artifacts; republishing logs
    nothing new (the metric history keeps one point per step)."""
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow' / 'mlflow.db'}"
    monkeypatch.setenv("DFLASH_SINKS", "mlflow")
    monkeypatch.setenv("DFLASH_RESULTS_DIR", str(tmp_path / "results"))
    monkeypatch.setenv("DFLASH_MLFLOW_TRACKING_URI", uri)
    expected = {}
    for step, p in ((300, 0.75), (100, 0.35), (200, 0.55)):
        record, res = record_for(tmp_path, "run-m", step, p)
        outcome = publish_result(record, record["job"], Settings.from_env())
        assert outcome["mlflow"]["ok"], outcome
        expected[step] = res
    client = MlflowClient(tracking_uri=uri)
    run = _mlflow_run(client, "run-m")
    assert run.info.run_name == "run-m-eval"
    name = expected[100]["suite"]["name"]
    for step, res in expected.items():
        for key, value in points(res, name).items():
            hist = {m.step: m.value for m in client.get_metric_history(run.info.run_id, key.replace("@", "_at_"))}
            assert hist[step] == pytest.approx(value, rel=1e-9), (key, step)
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "eval/tau")) == [100, 200, 300]
    assert f"eval/{name}/accept_rate_at_0" in run.data.metrics and f"eval/{name}/accept_length" in run.data.metrics
    assert run.data.params[f"{name}.block_size"] == str(expected[100]["settings"]["block_size"])
    arts = sorted(a.path for a in client.list_artifacts(run.info.run_id, "results"))
    assert [a.split("/")[1].split("-")[1] for a in arts] == ["100", "200", "300"]
    (first,) = client.list_artifacts(run.info.run_id, arts[0])
    local = client.download_artifacts(run.info.run_id, first.path, str(tmp_path / "dl"))
    assert json.loads(open(local).read())["result"]["tau"] == expected[100]["tau"]
    assert "report/report.html" in {a.path for a in client.list_artifacts(run.info.run_id, "report")}

    out = subprocess.run([sys.executable, "-m", "eval_worker.cli", "publish", "--run", "run-m", "--sink", "mlflow",
                          "--results", str(tmp_path / "results"), "--mlflow-uri", uri],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "logged 0 missing record(s), 3 in total" in out.stdout
    assert len(client.get_metric_history(run.info.run_id, "eval/tau")) == 3  # idempotent


@pytest.mark.slow  # 13-31 s (an MLflow store or TensorBoard reader starting): CI's slow pass
def test_mlflow_sink_server_on_loopback_nested_under_trainer_run(tmp_path, monkeypatch):
    """Against `mlflow server` on 127.0.0.1: a publication while the server is down fails the sink, not
    the job; once it is up, `publish --sink mlflow --mlflow-parent-run` logs every ledger record into an
    eval run nested under the trainer's run (its experiment, `mlflow.parentRunId`); the worker path with
    the job's `mlflow.parent_run_id` then appends the next record to the same run."""
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    from tests.support.mlflow_server import MlflowServer
    from tests.support.s3_server import free_port

    port = free_port()
    uri = f"http://127.0.0.1:{port}"
    monkeypatch.setenv("DFLASH_SINKS", "mlflow")
    monkeypatch.setenv("DFLASH_RESULTS_DIR", str(tmp_path / "results"))
    monkeypatch.setenv("DFLASH_MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # fail fast while the server is down
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
    record, first = record_for(tmp_path, "run-s", 100, 0.4)
    down = publish_result(record, record["job"], Settings.from_env())
    assert not down["mlflow"]["ok"] and "mlflow" in down["mlflow"]["error"].lower()

    server = MlflowServer(tmp_path / "server", port=port)
    try:
        client = MlflowClient(tracking_uri=uri)
        exp = client.create_experiment("trainer-runs")
        parent = client.create_run(exp, run_name="hf-trainer").info.run_id  # the trainer's own run
        record_for(tmp_path, "run-s", 200, 0.6)
        out = subprocess.run([sys.executable, "-m", "eval_worker.cli", "publish", "--run", "run-s", "--sink", "mlflow",
                              "--results", str(tmp_path / "results"), "--mlflow-parent-run", parent],
                             capture_output=True, text=True, timeout=300, env={**os.environ})
        assert out.returncode == 0, out.stderr
        assert "logged 2 missing record(s), 2 in total" in out.stdout
        run = _mlflow_run(client, "run-s")
        assert run.info.experiment_id == exp and run.data.tags["mlflow.parentRunId"] == parent

        record, third = record_for(tmp_path, "run-s", 150, 0.5)  # late, between the two
        job = {**record["job"], "mlflow": {"parent_run_id": parent}}
        assert publish_result(record, job, Settings.from_env())["mlflow"]["ok"]
        taus = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "eval/tau")}
        assert taus == pytest.approx({100: first["tau"]["macro"], 150: third["tau"]["macro"],
                                      200: taus[200]}, rel=1e-9) and len(taus) == 3
        arts = {a.path for a in client.list_artifacts(run.info.run_id, "results")}
        assert len(arts) == 3  # served by the tracking server (--serve-artifacts)
    finally:
        server.stop()


def test_tensorboard_sink_chosen_per_job_over_the_workers(tmp_path, monkeypatch):
    """A job's `sinks` list wins over the worker's: W&B configured, the job asks for TensorBoard only."""
    from eval_worker.service.jobs.schema import JobError, validate_job

    monkeypatch.setenv("DFLASH_SINKS", "wandb")
    monkeypatch.setenv("DFLASH_RESULTS_DIR", str(tmp_path / "results"))
    monkeypatch.setenv("DFLASH_TENSORBOARD_DIR", str(tmp_path / "tb"))
    record, res = record_for(tmp_path, "run-j", 10, 0.5)
    job = validate_job({**record["job"], "sinks": ["tensorboard"]}).to_json()  # sinks read the job's JSON
    outcome = publish_result(record, job, Settings.from_env())
    assert set(outcome) == {"tensorboard"} and outcome["tensorboard"]["ok"], outcome
    assert [e.step for e in read_events(tmp_path / "tb" / "run-j-eval").Scalars("eval/tau")] == [10]
    assert publish_result(record, validate_job({**record["job"], "sinks": []}).to_json(), Settings.from_env()) == {}
    with pytest.raises(JobError, match="sinks"):
        validate_job({**record["job"], "sinks": ["tensorbored"]})


@pytest.mark.parametrize("command",
                         [["worker", "--checkpoint-root", "/tmp"], ["enqueue", "/tmp/x"], ["publish", "--run", "r"],
                                     ["demo"]])
def test_sink_flag_refuses_unknown_names(command, tmp_path):
    """`--sink` on every command that takes it names the unknown sink and the known ones, before any work."""
    out = subprocess.run([sys.executable, "-m", "eval_worker.cli", *command, "--sink", "wandb,tensorbored"],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path,
                         env={**os.environ, "DFLASH_HOME": str(tmp_path / "home")})
    assert out.returncode != 0
    assert "tensorbored" in out.stderr and "wandb, tensorboard, mlflow" in out.stderr, out.stderr


def test_tensorboard_sink_concurrent_writers_leave_one_complete_file(tmp_path, redis_url):
    """Three processes publish the same run at once (the Redis + file writer lock): each succeeds, and the
    run directory ends with one event file holding every ledger point, no staging debris."""
    from eval_worker.results.sinks.tensorboard_sink import TensorBoardTarget

    for step, p in ((1, 0.3), (2, 0.5), (3, 0.7)):
        record_for(tmp_path, "run-c", step, p)
    target = json.dumps(TensorBoardTarget(root=tmp_path / "tb").to_json())
    cmd = [sys.executable, "-m", "eval_worker.results.sinks.child", "--sink", "tensorboard", "--run", "run-c",
           "--results", str(tmp_path / "results")]
    procs = [subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for _ in range(3)]
    outs = [p.communicate(input=redis_url + "\n" + target + "\n", timeout=300) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [o[1][-500:] for o in outs]
    infos = [json.loads(o[0].strip().splitlines()[-1]) for o in outs]
    assert sum(not i.get("skipped") for i in infos) == 1  # the writers that waited found it up to date
    (event_file,) = (tmp_path / "tb" / "run-c-eval").glob("events.out.tfevents.*")
    assert [e.step for e in read_events(event_file.parent).Scalars("eval/tau")] == [1, 2, 3]
    assert sorted(p.name for p in (tmp_path / "tb").iterdir()) == [".tensorboard-run-c-eval.lock", "run-c-eval",
                                                                    "run-c-eval.tensorboard.json"]
    assert not any((tmp_path / ".tb-staging").iterdir())  # staged beside the logdir, nothing left
