"""Small commands as a new user meets them (issue 35 items 12, 15, 16, 17): quick refusals, the offline
`suites` message, `status` on a fresh home, the demo's line in `status`, rq-dashboard's Jobs tab, `enqueue`'s
line, the dashboard's log.

Real parts: the CLI entry point (in-process, or a fresh interpreter where imports are measured), the
session's redis-server, the real rq-dashboard Flask app.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from dflash_train.common.settings import Settings
from eval_worker.cli import main as cli
from tests.support.sidecar_support import REPO_ROOT

HEAVY = ("torch", "transformers")


def _settings(home, **env) -> Settings:
    return Settings.from_env({"DFLASH_HOME": str(home), **env})


# --------------------------------------------------------------------------- item 12: refuse first

def _fresh_cli(argv: list[str], cwd) -> dict:
    """`dflash-eval ARGV` in a fresh interpreter: its exit status, output, and the heavy modules it imported."""
    code = ("import json, sys\nfrom eval_worker.cli import main\nrc = main(sys.argv[1:])\n"
            f"print(json.dumps({{'rc': rc, 'heavy': [m for m in {HEAVY!r} if m in sys.modules]}}))")
    proc = subprocess.run([sys.executable, "-c", code, *argv], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=300, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO_ROOT),
                                            "DFLASH_HOME": str(cwd / "home"), "HOME": str(cwd)})
    return {**json.loads(proc.stdout.strip().splitlines()[-1]), "err": proc.stdout + proc.stderr}


def test_quick_refusal_import_and_enqueue_refuse_outside_the_roots_before_loading_torch(tmp_path):
    """A record root outside the checkpoint roots (the one roots rule of docs/adoption.md: a drafter outside them
    is converted into the record root, the record root itself must be a root). On main `import` and
    `enqueue --external` imported torch (and more) before saying so: 16-31 s on a loaded 2-core box. Now the
    refusal comes first and neither torch nor transformers is imported (`python -X importtime` agrees)."""
    roots = tmp_path / "roots"
    roots.mkdir()
    drafter = tmp_path / "elsewhere" / "drafter"
    drafter.mkdir(parents=True)
    (drafter / "config.json").write_text("{}")
    (drafter / "model.safetensors").write_bytes(b"\0" * 16)
    outside = tmp_path / "elsewhere" / "records"
    for argv in (["import", str(drafter), "--into", str(outside), "--checkpoint-root", str(roots)],
                 ["enqueue", str(drafter), "--external", "--into", str(outside), "--checkpoint-root", str(roots),
                  "--redis-url", "redis://127.0.0.1:1/0"]):
        got = _fresh_cli(argv, tmp_path)
        assert got["rc"] == 2 and "outside the checkpoint roots" in got["err"], (argv, got)
        assert got["heavy"] == [], (argv[0], got["heavy"])  # main: ['torch'] (and transformers for some)


# --------------------------------------------------------------------------- item 15: offline suites

def test_offline_message_for_an_hf_suite_is_one_sentence_naming_the_hf_command(tmp_path, monkeypatch, capsys):
    """`dflash-eval suites hf:gsm8k` offline with an empty datasets cache. On main: "... the datasets cache
    has no copy is not available offline (...)", and a `huggingface-cli` hint (not installed: the venv
    has `hf`)."""
    pytest.importorskip("datasets")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "empty-cache"))
    assert cli(["suites", "hf:gsm8k"], settings=_settings(tmp_path / "home")) == 2
    err = capsys.readouterr().err
    assert "has no copy is not" not in err and "huggingface-cli" not in err, err
    assert "is not available offline: the Hub cannot be reached" in err, err
    assert "`hf download --repo-type dataset" in err


# --------------------------------------------------------------------------- item 16: read-only, starts nothing

def test_status_starts_nothing_on_a_fresh_home(tmp_path, capsys):
    """`status` on an empty DFLASH_HOME without REDIS_URL. On main it started a detached redis-server
    (left running) only to print an empty queue. Now it says there is no Redis, and starts nothing."""
    from eval_worker.service.local_redis.server import LocalRedis

    home = tmp_path / "home"
    try:
        assert cli(["status"], settings=_settings(home)) == 0
        out = capsys.readouterr().out
        assert "no Redis: REDIS_URL is not set and no local redis-server runs" in out, out
        assert cli(["status", "--json"], settings=_settings(home)) == 0
        assert json.loads(capsys.readouterr().out)["redis"] is None
        assert not (home / "redis").exists()  # main: a server's data directory, and the server running
    finally:
        if (home / "redis").exists():
            LocalRedis(home / "redis").stop()


# --------------------------------------------------------------------------- item 17: the demo in `status`

def test_status_names_a_running_demos_redis_as_its_own(tmp_path, capsys, redis_url):
    """While the demo runs, `status` said "its Redis stopped with it" about it."""
    from eval_worker.results import latest_demo

    settings = _settings(tmp_path / "home")
    demo = tmp_path / "demo"
    for state, said in (("running", "runs on a Redis of its own"), ("finished", "its Redis stopped with it")):
        latest_demo.record(settings, run_id="demo-1", workdir=demo, results=demo / "results",
                           report=demo / "report.html", state=state)
        assert cli(["status", "--redis-url", redis_url], settings=settings) == 0
        out = capsys.readouterr().out
        assert said in out, (state, out)
    assert "stopped with it" in out  # the finished one


# --------------------------------------------------------------------------- item 17: rq-dashboard's Jobs tab

def test_dashboard_jobs_tab_opens_on_the_eval_queue(conn, redis_url, monkeypatch, tmp_path):
    """rq-dashboard's Jobs tab opened on RQ's `default` queue, which our jobs never use: empty. Now it
    opens on the eval queue that holds jobs (a routed target's included), else the base queue."""
    pytest.importorskip("rq_dashboard")
    from rq_dashboard import web

    from eval_worker.commands.dashboard import dashboard_app
    from eval_worker.service.queueing.client import enqueue
    from eval_worker.service.queueing.queue import QueueConfig
    from eval_worker.service.queueing.routing import routed_base
    from tests.support.eval_results import fake_checkpoint

    monkeypatch.setattr(web.config, "serializer", web.config.serializer)  # restored after the test
    monkeypatch.setattr(web, "Worker", web.Worker)
    for var in ("RQ_DASHBOARD_REDIS_URL", "RQ_DASHBOARD_JSON_SERIALIZER", "RQ_DASHBOARD_URL_PREFIX"):
        monkeypatch.setenv(var, "")
    client = dashboard_app(redis_url).test_client()
    tab = client.get("/0/view/jobs")
    assert tab.status_code == 302 and tab.headers["Location"].endswith("/0/view/jobs/dflash-eval/queued/8/asc/1")

    from eval_worker.service.jobs.builder import make_job

    target = tmp_path / "target"
    target.mkdir()
    ck, _ = fake_checkpoint(tmp_path / "ck", "run-dash", 1)
    enqueue(conn, make_job(ck, suite="builtin:coding-v1", target=str(target)),
            config=QueueConfig(route_by_target=True))
    family = routed_base("dflash-eval", str(target))
    tab = client.get("/0/view/jobs")
    assert tab.headers["Location"].endswith(f"/0/view/jobs/{family.replace('@', '%40')}/queued/8/asc/1")
    page = client.get(tab.headers["Location"])
    assert page.status_code == 200


# --------------------------------------------------------------------------- item 17: enqueue's line

def test_enqueue_prints_the_job_id_once(tmp_path, capsys, redis_url):
    """`enqueue` printed `enqueued  ID  enqueued ID on QUEUE`: the id twice on one line. Now the status and
    the id once each, on every outcome line (`enqueued`, then `duplicate` on a second enqueue)."""
    from tests.support.eval_results import fake_checkpoint

    root = tmp_path / "ck"
    ck, _ = fake_checkpoint(root, "run-once", 100)
    argv = ["enqueue", str(ck), "--checkpoint-root", str(root), "--target", str(tmp_path), "--redis-url", redis_url]
    for status in ("enqueued", "duplicate"):
        assert cli(argv, settings=_settings(tmp_path / "home")) == 0
        (line,) = capsys.readouterr().out.splitlines()
        job_id = next(w for w in line.split() if w.startswith("eval-run-once-100-"))
        assert line.split()[0] == status and line.count(job_id) == 1 and line.count(status) == 1, line


# --------------------------------------------------------------------------- item 17: the dashboard's log

def test_dashboard_log_banner_is_text_not_bytes(capfd):
    """`dflash-eval dashboard` logged `b''b" * Serving Flask app 'rq_dashboard.cli'\\n"`: the commands' redacting
    stdout accepted `write(b"")`, click's probe for a binary stream, so click wrote bytes to it. Now it
    refuses bytes as a text stream does, and Flask's real banner reads as text (still redacted)."""
    pytest.importorskip("flask")
    from flask.cli import show_server_banner

    from dflash_train.common.redaction import redacted_output

    with redacted_output():
        show_server_banner(False, "rq_dashboard.cli")
        print("on redis://:hunter2@host:6379/0")
    out = capfd.readouterr().out
    assert "b'" not in out and 'b"' not in out, out
    assert " * Serving Flask app 'rq_dashboard.cli'\n * Debug mode: off\n" in out, out
    assert "hunter2" not in out and "redis://:***@host:6379/0" in out
