"""Numbers that differ stay tellable apart in every sink and view (issue 35 item 1, issue 34 D15), MLflow's
own faults (issue 34 D2, D8; issue 35 item 3), and what the views print (issue 35 items 2 and 4, issue 34 D9).

Real backends: TensorBoard event files read back, a local MLflow sqlite store, W&B offline read back from its
transaction log, the real ledger and Redis index.
"""
from __future__ import annotations

import dataclasses
import json
import shutil
import sqlite3

import pytest

from dflash_train.common.settings import Settings
from eval_worker.results.ledger import read_record
from tests.support.eval_results import fake_checkpoint, make_result, write_ledger

RULES = {"response": 0.5, "sglang": 0.7, "deepspec": 0.3}  # one checkpoint, three counting rules, three τ


_made = iter(range(10**6))


def _record(tmp_path, run_id, step, p, *, options=None, target=None, suite="coding", queue=None):
    """A result recorded through the real ledger, each one created after the one before."""
    _, digest = fake_checkpoint(tmp_path / "ckpt", run_id, step)
    res = make_result(run_id, step, p=p, checkpoint_root=str(tmp_path / "ckpt"), digest=digest, suite=suite)
    res["provenance"]["created_at"] = f"2026-01-01T00:00:00.{next(_made):06d}+00:00"
    if target:
        res["target"] = {**res["target"], **target}
    return res, read_record(write_ledger(tmp_path / "results", res, options=options, queue=queue))


def _counting_run(tmp_path, run_id="run-c"):
    """Step 300 with the default rule; step 600 under each rule (the default one first)."""
    out = {("response", 300): _record(tmp_path, run_id, 300, 0.4)[0]}
    for rule, p in RULES.items():
        options = None if rule == "response" else {"counting": rule}
        out[(rule, 600)] = _record(tmp_path, run_id, 600, p, options=options)[0]
    return out


def _events(run_dir):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return acc


@pytest.fixture(scope="session")
def _mlflow_template(tmp_path_factory):
    """One MLflow sqlite store made once (its migrations take seconds), copied per test."""
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    db = tmp_path_factory.mktemp("mlflow-template") / "mlflow.db"
    MlflowClient(tracking_uri=f"sqlite:///{db}").search_experiments()
    return db


@pytest.fixture
def mlflow_uri(tmp_path, _mlflow_template):
    db = tmp_path / "mlflow" / "mlflow.db"
    db.parent.mkdir()
    shutil.copy(_mlflow_template, db)
    return f"sqlite:///{db}"


def _mlflow_publish(tmp_path, uri, run_id, **kw):
    from eval_worker.results.sinks.mlflow_sink import MlflowTarget, publish_run

    target = MlflowTarget(tracking_uri=uri, lock_dir=str(tmp_path / "mlflow"), report=False)
    return publish_run(run_id, target, results_dir=tmp_path / "results", **kw)


def _mlflow_run(uri, run_id):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()],
                                filter_string=f"tags.`dflash.train_run` = '{run_id}'")
    return client, run


def _history(client, run, key):
    return {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}


# --------------------------------------------------------------------------- issue 35.1: counting rules, targets


def test_counting_keyed_tensorboard_mlflow_and_results(tmp_path, mlflow_uri):
    """Five counting rules once gave five points under one `eval/coding/tau` at step 600 and one MLflow param
    (the last writer's): each rule is its own series now, named by its key; the default keeps its old names."""
    from eval_worker.commands.results import rows
    from eval_worker.results.sinks.tensorboard_sink import TensorBoardTarget, publish_run

    expected = _counting_run(tmp_path)
    publish_run("run-c", TensorBoardTarget(root=tmp_path / "tb", images=False), results_dir=tmp_path / "results")
    acc = _events(tmp_path / "tb" / "run-c-eval")
    tags = set(acc.Tags()["scalars"])
    for key in ("eval/tau", "eval/coding/tau"):  # the common case: the names of earlier versions, default only
        assert {e.step: e.value for e in acc.Scalars(key)} == pytest.approx(
            {300: expected[("response", 300)]["tau"]["macro"], 600: expected[("response", 600)]["tau"]["macro"]})
    for rule in ("sglang", "deepspec"):
        key = f"eval/coding.counting-{rule}/tau"
        assert key in tags and f"eval/coding.counting-{rule}/accept_length" in tags
        assert [(e.step, e.value) for e in acc.Scalars(key)] == [
            (600, pytest.approx(expected[(rule, 600)]["tau"]["macro"]))]

    _mlflow_publish(tmp_path, mlflow_uri, "run-c")
    client, run = _mlflow_run(mlflow_uri, "run-c")
    assert _history(client, run, "eval/coding/tau") == pytest.approx(
        {300: expected[("response", 300)]["tau"]["macro"], 600: expected[("response", 600)]["tau"]["macro"]})
    for rule in ("sglang", "deepspec"):
        assert _history(client, run, f"eval/coding.counting-{rule}/tau") == pytest.approx(
            {600: expected[(rule, 600)]["tau"]["macro"]})
        assert run.data.params[f"coding.counting-{rule}.options"] == f"counting-{rule}"
    assert "coding.options" not in run.data.params  # the default series has no options to name

    table = [r for r in rows(["run-c"], tmp_path / "results") if r["step"] == 600]
    assert sorted(r["options_label"] for r in table) == ["counting-deepspec", "counting-sglang", "default"]
    assert len({r["series"] for r in table}) == 3


def test_target_keyed_wandb_status_and_results(tmp_path, wandb_offline, monkeypatch, conn, redis_url, capsys):
    """One run on two targets: W&B had duplicate rows at each step, `results` repeated rows, `status` mixed both
    targets in one line. The second target is its own series everywhere, named by its directory and fingerprint."""
    from eval_worker.cli import main as cli
    from eval_worker.commands.results import rows
    from eval_worker.results.ledger import Ledger
    from eval_worker.results.sinks import publish_result
    from eval_worker.service.queueing.queue import status
    from tests.support.wandb_reader import read_run

    monkeypatch.setenv("DFLASH_SINKS", "wandb")
    monkeypatch.setenv("DFLASH_RESULTS_DIR", str(tmp_path / "results"))
    other = {"path": "/targets/other", "fingerprint": "b" * 16}
    taus = {}
    for step, p in ((300, 0.4), (600, 0.6)):
        taus[("first", step)] = _record(tmp_path, "run-t", step, p)[0]["tau"]["macro"]
        res, record = _record(tmp_path, "run-t", step, p + 0.2, target=other)
        taus[("other", step)] = res["tau"]["macro"]
    assert publish_result(record, record["job"], Settings.from_env())["wandb"]["ok"]
    pointer = json.loads((wandb_offline / "run-t-eval.json").read_text())
    log = read_run(pointer["wandb_file"])
    assert log.points("eval/tau") == pytest.approx({s: taus[("first", s)] for s in (300, 600)})
    assert log.points("eval/coding.target-other-bbbbbbbb/tau") == pytest.approx(
        {s: taus[("other", s)] for s in (300, 600)})

    table = rows(["run-t"], tmp_path / "results")
    assert sorted((r["step"], r["target"]) for r in table) == [
        (300, "other-bbbbbbbb"), (300, "tiny-ffffffff"), (600, "other-bbbbbbbb"), (600, "tiny-ffffffff")]
    ledger = Ledger(tmp_path / "results", connection=conn)
    ledger.reindex()
    series = status(conn, run="run-t")["runs"]["run-t"]["suites"]
    assert sorted(series) == ["builtin:coding-v1 [target other-bbbbbbbb]", "builtin:coding-v1 [target tiny-ffffffff]"]
    assert all(t["evaluated"] == 2 for t in series.values())
    assert cli(["status", "--run", "run-t", "--redis-url", redis_url]) == 0
    out = capsys.readouterr().out
    assert "run-t: 4 evaluated on 2 series" in out and "[target other-bbbbbbbb]: 2 evaluated" in out


def test_target_fingerprint_series(tmp_path, capsys):
    """Issue 34 D15: two workers with different target files under one path. The records carry two
    fingerprints; `results` warns, the report says it, and TensorBoard draws two series, not one."""
    from eval_worker.commands.results import rows
    from eval_worker.results.report import build_report
    from eval_worker.results.sinks.tensorboard_sink import TensorBoardTarget, publish_run

    swapped = {"fingerprint": "c" * 16}  # same path /targets/tiny, other bytes
    _record(tmp_path, "run-fp", 100, 0.4)
    _record(tmp_path, "run-fp", 200, 0.5, target=swapped)
    table = rows(["run-fp"], tmp_path / "results")
    assert sorted(r["target"] for r in table) == ["tiny-cccccccc", "tiny-ffffffff"]
    err = capsys.readouterr().err
    assert "target /targets/tiny changed during the run: 2 different files" in err
    html = build_report("run-fp", results_dir=tmp_path / "results", out_dir=tmp_path / "report").read_text()
    assert "target /targets/tiny changed during the run" in html
    publish_run("run-fp", TensorBoardTarget(root=tmp_path / "tb", images=False), results_dir=tmp_path / "results")
    acc = _events(tmp_path / "tb" / "run-fp-eval")
    assert [e.step for e in acc.Scalars("eval/coding/tau")] == [100]
    assert [e.step for e in acc.Scalars("eval/coding.target-tiny-cccccccc/tau")] == [200]


# --------------------------------------------------------------------------- issue 35.3: lag, finished runs


def test_lag_all_sinks_and_mlflow_run_finished(tmp_path, mlflow_uri):
    """Eval lag reached W&B only; TensorBoard and MLflow carry it too. MLflow's eval run ends FINISHED after a
    publication (it stayed RUNNING forever), and a later publication still appends to it."""
    from eval_worker.results.sinks.tensorboard_sink import TensorBoardTarget, publish_run

    lag = {"eval_lag": {"lag_steps": 200, "lag_s": 31.5, "newest_published_step": 500}}
    _record(tmp_path, "run-l", 300, 0.5, queue=lag)
    publish_run("run-l", TensorBoardTarget(root=tmp_path / "tb", images=False), results_dir=tmp_path / "results")
    acc = _events(tmp_path / "tb" / "run-l-eval")
    assert [(e.step, e.value) for e in acc.Scalars("eval/lag_steps")] == [(300, 200.0)]
    assert [(e.step, e.value) for e in acc.Scalars("eval/lag_s")] == [(300, 31.5)]

    _mlflow_publish(tmp_path, mlflow_uri, "run-l")
    client, run = _mlflow_run(mlflow_uri, "run-l")
    assert _history(client, run, "eval/lag_steps") == {300: 200.0}
    assert run.info.status == "FINISHED"
    _record(tmp_path, "run-l", 400, 0.6, queue={"eval_lag": {"lag_steps": 0, "lag_s": 2.0}})
    assert len(_mlflow_publish(tmp_path, mlflow_uri, "run-l")["logged"]) == 1
    client, run = _mlflow_run(mlflow_uri, "run-l")
    assert run.info.status == "FINISHED" and _history(client, run, "eval/lag_steps") == {300: 200.0, 400: 0.0}


# --------------------------------------------------------------------------- issue 34 D8, D2: MLflow's faults


def test_mlflow_param_keys_a_refused_suite_name_blocks_nothing(tmp_path, mlflow_uri):
    """A suite named `code review (v2) τ ✓` made MLflow refuse the params batch, and the run's other suite lost
    its points too; param keys are made MLflow-safe like metric keys, and both suites are logged."""
    odd = "code review (v2) τ ✓"
    _record(tmp_path, "run-p", 100, 0.5, suite=odd)
    _record(tmp_path, "run-p", 100, 0.6, suite="coding")
    assert len(_mlflow_publish(tmp_path, mlflow_uri, "run-p")["logged"]) == 2  # what `publish --sink mlflow` runs
    client, run = _mlflow_run(mlflow_uri, "run-p")
    assert 100 in _history(client, run, "eval/coding/tau")
    assert 100 in _history(client, run, "eval/code_review_v2_/tau")
    assert run.data.params["code review _v2_ _ _.block_size"] == "16"


def test_mlflow_store_recovery_after_a_kill_during_its_creation(tmp_path, _mlflow_template):
    """A kill while MLflow created its default sqlite store left a half-made one (tables, no finished
    migration): every later publication failed with `table ... already exists`. It is set aside and created
    again (atomically now: built under a temporary name, then linked into place)."""
    db = tmp_path / "mlflow" / "mlflow.db"
    db.parent.mkdir()
    shutil.copy(_mlflow_template, db)
    with sqlite3.connect(db) as c:  # what a kill inside the migrations leaves: no schema version, a table missing
        c.execute("DROP TABLE alembic_version")
        last = c.execute("SELECT name FROM sqlite_master WHERE type='table' ORDER BY rowid DESC LIMIT 1").fetchone()[0]
        c.execute(f'DROP TABLE "{last}"')
    uri = f"sqlite:///{db}"
    _record(tmp_path, "run-k", 100, 0.5)
    info = _mlflow_publish(tmp_path, uri, "run-k")
    assert len(info["logged"]) == 1
    client, run = _mlflow_run(uri, "run-k")
    assert 100 in _history(client, run, "eval/tau")
    assert len(list(db.parent.glob("mlflow.db.half-made-*"))) == 1  # kept aside, not deleted
    assert not list(db.parent.glob(".mlflow.db.creating-*"))
    _record(tmp_path, "run-k", 200, 0.6)  # the never-killed path: the store just works
    assert len(_mlflow_publish(tmp_path, uri, "run-k")["logged"]) == 1


# --------------------------------------------------------------------------- views: issue 35.2, 35.4, 34 D9


def test_sink_catch_up_mlflow_kill_before_the_record_artifact(tmp_path, mlflow_uri, monkeypatch):
    """A publication killed after a record's points and its "logged" tag, before the record's JSON artifact:
    every later publication took the record for logged, and the artifact never came (found by reading the
    kill windows of the sink-phase soak, tests/support/soak_sinks.py). The tag now comes last."""
    from mlflow.tracking import MlflowClient

    _record(tmp_path, "run-k", 100, 0.5)

    class Killed(BaseException):  # kill -9: nothing after it runs
        pass

    def killed(self, *args, **kwargs):
        raise Killed

    with monkeypatch.context() as m:
        m.setattr(MlflowClient, "log_artifact", killed)
        with pytest.raises(Killed):
            _mlflow_publish(tmp_path, mlflow_uri, "run-k")
    assert len(_mlflow_publish(tmp_path, mlflow_uri, "run-k")["logged"]) == 1  # the retry logs the record
    client, run = _mlflow_run(mlflow_uri, "run-k")
    assert [a.path.split("/")[1].split("-")[1] for a in client.list_artifacts(run.info.run_id, "results")] == ["100"]
    assert [m.step for m in client.get_metric_history(run.info.run_id, "eval/coding/tau")] == [100]  # once
    assert _mlflow_publish(tmp_path, mlflow_uri, "run-k")["logged"] == []  # then up to date


def test_results_run_merge_reads_every_ledger_holding_the_run(tmp_path, monkeypatch, capsys):
    """`results --run demo-…` printed only the default ledger's rows once it held that run name too, with no
    note: both ledgers' rows now, each naming its ledger, with prompt count and max tokens as columns."""
    from eval_worker.cli import main as cli
    from eval_worker.results import latest_demo

    home = tmp_path / "home"
    monkeypatch.setenv("DFLASH_HOME", str(home))
    monkeypatch.delenv("DFLASH_RESULTS_DIR", raising=False)
    settings = Settings.from_env()
    demo_results = tmp_path / "demo" / "results"
    big = make_result("demo-x", 100, p=0.6)
    write_ledger(demo_results, big)
    small = make_result("demo-x", 100, p=0.4, suite_fp="0123abcd")
    small["suite"]["num_prompts"], small["settings"]["max_new_tokens"] = 2, 32
    write_ledger(settings.results_dir, small)
    latest_demo.record(settings, run_id="demo-x", workdir=tmp_path / "demo", results=demo_results,
                       report=tmp_path / "demo" / "report", state="finished")
    assert cli(["results", "--run", "demo-x"]) == 0
    out, err = capsys.readouterr()
    lines = [ln for ln in out.splitlines() if ln.startswith("demo-x")]
    assert len(lines) == 2, out
    assert "prompts" in out and "max tok" in out
    assert "run demo-x is in 2 ledgers" in err and str(demo_results) in err
    assert cli(["results", "--run", "demo-x", "--json"]) == 0
    table = json.loads(capsys.readouterr().out)
    assert sorted((r["prompts"], r["max_new_tokens"]) for r in table) == [(2, 32), (4, 128)]
    assert {r["ledger"] for r in table} == {str(settings.results_dir), str(demo_results)}


def test_tensorboard_default_dir_docs_match_the_code(tmp_path, monkeypatch):
    """The README and the design doc gave `./tensorboard-eval`; the event files go to `$DFLASH_HOME/tensorboard`."""
    from pathlib import Path

    from eval_worker.cli import build_parser

    monkeypatch.setenv("DFLASH_HOME", str(tmp_path))
    monkeypatch.delenv("DFLASH_TENSORBOARD_DIR", raising=False)
    assert Settings.from_env().tensorboard_dir == (tmp_path / "tensorboard").resolve()
    repo = Path(__file__).resolve().parents[3]
    for doc in ("README.md", "docs/design.md"):
        text = (repo / doc).read_text()
        assert "tensorboard-eval" not in text and "default `$DFLASH_HOME/tensorboard`" in text, doc
    assert "tensorboard --logdir ~/.cache/dflash-eval/tensorboard" in (repo / "README.md").read_text()
    publish = next(a for a in _subparser(build_parser(), "publish")._actions if "--tensorboard-dir" in a.option_strings)
    assert "$DFLASH_HOME/tensorboard" in publish.help and "tensorboard-eval" not in publish.help


def _subparser(parser, name):
    import argparse

    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def test_control_characters_refused_in_suites_and_escaped_on_output(tmp_path, capsys):
    """ESC sequences from a suite file reached the terminal through `results`: a suite with a control character
    in a suite or prompt name is refused where it is read; a name already recorded is printed escaped."""
    from eval_worker.cli import main as cli
    from eval_worker.engine.suite import SuiteError, load_suite

    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"name": "ok\x1b[2J\x1b[31mred", "prompt": "def f():"}) + "\n")
    with pytest.raises(SuiteError, match="control character"):
        load_suite(str(bad))
    res = make_result("run-esc", 100, p=0.5, suite="old\x1b]0;pwned\x07name")  # recorded before the check
    write_ledger(tmp_path / "results", res)
    assert cli(["results", "--run", "run-esc", "--results", str(tmp_path / "results")]) == 0
    out = capsys.readouterr().out
    assert "\x1b" not in out and "\x07" not in out and "old\\x1b]0;pw" in out


def test_help_redaction_keeps_the_url_syntax_readable():
    """Every `--redis-url` help showed `redis://***@]host:port/db`: a syntax template is not a URL to mask;
    a real password is still masked."""
    import subprocess
    import sys

    from dflash_train.common.redaction import redact

    out = subprocess.run([sys.executable, "-m", "eval_worker.cli", "status", "--help"], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and "redis://[:password@]host:port/db" in " ".join(out.stdout.split()), out.stdout
    assert redact("see redis://:hunter2@host:6379/0 and redis://[:password@]host") == (
        "see redis://:***@host:6379/0 and redis://[:password@]host")


def test_rediss_sink_url_keeps_tls_and_user(redis_url):
    """The sink's child got `redis://` without the user for a worker on `rediss://user:...@` (a TLS downgrade):
    it gets the URL the worker connected with; one rebuilt from a client opened elsewhere keeps TLS and user."""
    import redis
    from redis.connection import SSLConnection

    from eval_worker.redis_client import connect
    from eval_worker.results.sinks import _redis_url

    settings = Settings.from_env()
    assert settings.redis_url is None
    url = "rediss://alice:s3cret@redis.example:6380/2?ssl_cert_reqs=required&ssl_ca_certs=%2Fetc%2Fca.pem"
    client = connect(url, ping=False)
    assert _redis_url(settings, client) == url
    # the connection wins over $REDIS_URL: the worker may have been started with --redis-url
    assert _redis_url(dataclasses.replace(settings, redis_url="redis://other:6379/0"), client) == url
    elsewhere = redis.Redis.from_url(url)  # a plain `rq worker --url`: not opened by our connect
    rebuilt = _redis_url(settings, elsewhere)
    assert rebuilt.startswith("rediss://alice:s3cret@redis.example:6380/2?")
    pool = redis.Redis.from_url(rebuilt).connection_pool  # opens as the worker's: TLS, user and CA kept
    assert issubclass(pool.connection_class, SSLConnection)
    assert {k: pool.connection_kwargs.get(k) for k in ("username", "password", "host", "port", "db", "ssl_cert_reqs",
                                                        "ssl_ca_certs")} == {
        "username": "alice", "password": "s3cret", "host": "redis.example", "port": 6380, "db": 2,
        "ssl_cert_reqs": "required", "ssl_ca_certs": "/etc/ca.pem"}
    sock = redis.Redis.from_url("unix:///run/redis.sock?db=3&password=pw")  # its password was dropped
    assert redis.Redis.from_url(_redis_url(settings, sock)).connection_pool.connection_kwargs["password"] == "pw"
    plain = connect(redis_url)
    assert _redis_url(settings, plain) == redis_url
