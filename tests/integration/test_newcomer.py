"""A new user's first hour: leftover daemons, state that can be found, checks before a long run."""
from __future__ import annotations

import pytest

from dflash_train.common.fsutil import pid_alive
from dflash_train.common.settings import Settings
from eval_worker.cli import main as cli


def _settings(home, **env) -> Settings:
    return Settings.from_env({"DFLASH_HOME": str(home), **env})


# --------------------------------------------------------------------------- embedded redis: notice, status, stop


def test_redis_stop_notice_status_and_stop(tmp_path, capsys):
    """The command that starts the server says so first (stderr); `redis status` finds it and `redis stop` ends it.
    (`status`, read-only, starts none: tests/unit/service/test_small_commands.py.)"""
    from eval_worker.service.local_redis.server import LocalRedis

    settings = _settings(tmp_path)
    try:
        assert cli(["dismiss", "--all", "--json"], settings=settings) == 0
        first = capsys.readouterr()
        assert first.err.splitlines()[0].startswith("note: started a local redis-server")
        assert "dflash-eval redis stop" in first.err
        pid = LocalRedis(settings.redis_dir).attach() and LocalRedis(settings.redis_dir)._read_state()["pid"]
        assert pid and pid_alive(pid)
        # the next command reuses it and says nothing
        assert cli(["status", "--json"], settings=settings) == 0
        assert "started" not in capsys.readouterr().err
        assert cli(["redis", "status"], settings=settings) == 0
        assert f"pid {pid}" in capsys.readouterr().out
        assert cli(["redis", "stop"], settings=settings) == 0
        assert f"stopped the local redis-server (pid {pid})" in capsys.readouterr().out
        assert not pid_alive(pid) or not LocalRedis(settings.redis_dir).attach()
        assert cli(["redis", "status"], settings=settings) == 0
        assert "no local redis-server running" in capsys.readouterr().out
        assert cli(["redis", "stop"], settings=settings) == 0  # nothing to stop is not an error
    finally:
        LocalRedis(settings.redis_dir).stop()


def test_redis_stop_refuses_while_a_worker_is_served_unless_forced(tmp_path, capsys):
    from rq.serializers import JSONSerializer
    from rq.worker import Worker

    from eval_worker.redis_client import connect
    from eval_worker.service.local_redis.server import LocalRedis

    settings = _settings(tmp_path)
    local = LocalRedis(settings.redis_dir).start()
    try:
        conn = connect(local.url)
        worker = Worker(["dflash-eval"], connection=conn, serializer=JSONSerializer, name="w-newcomer")
        worker.register_birth()  # a registered worker whose process (this one) is alive
        assert cli(["redis", "stop"], settings=settings) == 1
        err = capsys.readouterr().err
        assert "w-newcomer" in err and "--force" in err
        assert local.is_running()
        assert cli(["redis", "status", "--json"], settings=settings) == 0
        assert '"w-newcomer"' in capsys.readouterr().out
        assert cli(["redis", "stop", "--force"], settings=settings) == 0
        assert not local.is_running()
    finally:
        LocalRedis(settings.redis_dir).stop()


# --------------------------------------------------------------------------- repeated warnings


def test_warning_rate_one_line_per_window_per_message():
    """35 identical warnings in 35 s (Redis down) show as 2 lines, the second with the count held back;
    another message, and INFO, are never held back."""
    import logging

    from dflash_train.common.progress import RepeatLimiter, limit_repeated_warnings

    now = [0.0]
    shown: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            shown.append(record.getMessage())

    logger = logging.getLogger("test.warning_rate")
    logger.propagate, handler, second = False, Keep(), Keep()  # two handlers: each record counted once
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    logger.addHandler(second)
    try:
        limiter = limit_repeated_warnings(logger=logger)
        limiter._clock = lambda: now[0]
        assert limit_repeated_warnings(logger=logger) is limiter and handler.filters == [limiter]  # idempotent
        assert second.filters == [limiter]
        for i in range(35):
            logger.warning("could not connect to Redis: %s, retrying in %d seconds", "refused", 2)
            logger.warning("heartbeat failed")
            logger.info("line %d", i)
            now[0] += 1.0
        warned = [m for m in shown if not m.startswith("line")][::2]  # each record reached both handlers
        assert shown.count("heartbeat failed") == 2 * 1
        assert warned[:2] == ["could not connect to Redis: refused, retrying in 2 seconds", "heartbeat failed"]
        assert len(warned) == 4
        assert "[29 more like this in the last 30s not shown]" in warned[2]
        assert len([m for m in shown if m.startswith("line")]) == 2 * 35
    finally:
        logger.removeHandler(handler)
        logger.removeHandler(second)
    assert isinstance(limiter, RepeatLimiter)


def test_warning_rate_report_slot_counts_match_the_walk():
    """The n shown beside each per-position point is the count behind P(accept k | k-1)."""
    import random

    from eval_worker.engine import metrics
    from eval_worker.results.report_figures import slot_counts

    rng = random.Random(0)
    for _ in range(50):
        B = rng.randint(2, 16)
        lengths = [rng.randint(1, B) for _ in range(rng.randint(1, 40))]
        counts = slot_counts(metrics.histogram(lengths, B))
        cond = metrics.conditional_accept(lengths, B)
        for k, (n, c) in enumerate(zip(counts, cond, strict=False), start=1):
            assert n == sum(1 for L in lengths if L >= k)
            assert (c is None) == (n == 0)
            if n:
                assert c == sum(1 for L in lengths if L >= k + 1) / n


# --------------------------------------------------------------------------- job identity


@pytest.fixture(scope="module")
def identity_ckpts(tmp_path_factory):
    from tests.support.sidecar_support import publish_random

    root = tmp_path_factory.mktemp("identity")
    return root, [publish_random(root, "run-id", step, seed=step) for step in (100, 200)]


def test_job_identity_baseline_and_target_spelling(redis_url, identity_ckpts, tmp_path, capsys):
    """A baseline changes the result (Δτ), so it is a different job; one target spelled two ways, or
    named explicitly vs. left to the worker that has it as its own --target, is the same job."""
    from rq.serializers import JSONSerializer
    from rq.worker import Worker

    from eval_worker.redis_client import connect
    from eval_worker.service.jobs.builder import make_job
    from eval_worker.service.jobs.ids import canonical_target
    from eval_worker.service.queueing.client import enqueue
    from eval_worker.service.queueing.queue import TARGET_FIELD

    root, (c100, c200) = identity_ckpts
    conn = connect(redis_url)
    make = lambda **kw: make_job(c200, suite="builtin:coding-v1", roots=[root], **kw)  # noqa: E731
    plain = enqueue(conn, make())
    with_baseline = enqueue(conn, make(baseline=c100))
    assert (plain.status, with_baseline.status) == ("enqueued", "enqueued")
    assert plain.job_id != with_baseline.job_id
    assert enqueue(conn, make(baseline=str(c100) + "/")).status == "duplicate"  # one spelling

    target = tmp_path / "target"
    target.mkdir()
    (tmp_path / "link").symlink_to(target)
    explicit = enqueue(conn, make(target=target))
    assert enqueue(conn, make(target=str(tmp_path / "link") + "/")).job_id == explicit.job_id
    # a worker serving the queue with that target as its own: a job naming no target is the same job
    conn.flushall()
    worker = Worker(["dflash-eval"], connection=conn, serializer=JSONSerializer, name="w-identity")
    worker.register_birth()
    conn.hset(worker.key, TARGET_FIELD, canonical_target(target))
    import json

    argv = ["enqueue", str(c200), "--checkpoint-root", str(root), "--redis-url", redis_url, "--json"]
    assert cli(argv) == 0  # `enqueue` without --target
    [implicit] = json.loads(capsys.readouterr().out)["outcomes"]
    assert implicit["job_id"] == explicit.job_id and implicit["status"] == "enqueued"
    assert enqueue(conn, make(target=target)).status == "duplicate"
    conn.close()


def test_job_identity_baseline_property(identity_ckpts):
    """Property: the fingerprint changes with each part that changes the result, and only with those."""
    from hypothesis import given
    from hypothesis import settings as hsettings
    from hypothesis import strategies as st

    from eval_worker.service.jobs.ids import suite_fingerprint

    @hsettings(max_examples=40, deadline=None)
    @given(st.sampled_from([None, "/t/a", "/t/b"]), st.sampled_from([None, "/b/x", "s3://b/r/run/step-00000001"]),
           st.sampled_from([None, {"tree_budget": 4}, {"tree_budget": 8}]))
    def check(target, baseline, options):
        fp = suite_fingerprint("builtin:coding-v1", options, target, baseline)
        assert fp == suite_fingerprint("builtin:coding-v1", options, target, baseline)
        for other_b in (None, "/b/x", "/b/y"):
            if other_b != baseline:
                assert suite_fingerprint("builtin:coding-v1", options, target, other_b) != fp
        # tree_budget 8 is the default: spelled or not, the same evaluation
        if options == {"tree_budget": 8}:
            assert fp == suite_fingerprint("builtin:coding-v1", None, target, baseline)

    check()


# --------------------------------------------------------------------------- import and the worker's roots


def test_import_roots_unchecked_import_names_the_roots_the_worker_needs(tmp_path, capsys):
    """Without configured roots `import --into` cannot check; it says, loudly, which roots the worker needs,
    and those roots are exactly what makes the worker's check pass (the record root alone does not)."""
    import re
    from pathlib import Path

    from dflash_train.checkpoints.checkpoint import save_drafter
    from dflash_train.checkpoints.publication import CheckpointError
    from eval_worker.service.jobs.builder import make_job
    from eval_worker.service.jobs.schema import JobError
    from tests.support.factories import drafter_for, qwen3_target

    drafter = drafter_for(qwen3_target(layers=2), layers=1, features=1, block_size=4)
    src = tmp_path / "downloads" / "someone-dflash"
    save_drafter(drafter, src)
    no_roots = _settings(tmp_path / "home").replace(checkpoint_roots=None)
    assert cli(["import", str(src), "--into", str(tmp_path / "records")], settings=no_roots) == 0
    err = capsys.readouterr().err
    assert err.startswith("WARNING: no checkpoint roots configured")
    named = [Path(p) for p in re.findall(r"--checkpoint-root (\S+?)[` ]", err.split("e.g.")[1])]
    assert set(named) == {tmp_path / "records", src.parent}
    record = next((tmp_path / "records").glob("*/step-*"))
    with pytest.raises((JobError, CheckpointError)):
        make_job(record, suite="builtin:coding-v1", roots=[tmp_path / "records"])
    assert make_job(record, suite="builtin:coding-v1", roots=named).checkpoint == str(record)
    # with roots configured the same import is checked, and says nothing more
    roots = _settings(tmp_path / "home").replace(checkpoint_roots=tuple(named))
    assert cli(["import", str(src), "--into", str(tmp_path / "records")], settings=roots) == 0
    assert "WARNING" not in capsys.readouterr().err


# --------------------------------------------------------------------------- offline Hub, fast


def _closed_port() -> int:
    import socket

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()  # nothing listens there now: a connection is refused at once
    return port


def test_offline_fast_probe_tells_offline_refused_and_reachable_apart(monkeypatch):
    import socket

    from huggingface_hub import constants

    from dflash_train.checkpoints.hub import unreachable

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    assert unreachable() == "HF_HUB_OFFLINE is set"
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    for var in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy", "HTTP_PROXY", "http_proxy"):
        monkeypatch.delenv(var, raising=False)
    port = _closed_port()
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{port}")
    assert f"http://127.0.0.1:{port} did not accept a connection" in unreachable()
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{server.getsockname()[1]}")
        assert unreachable() is None
    monkeypatch.setenv("HTTPS_PROXY", "http://proxy.invalid:3128")  # a proxy may reach it: no verdict
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{port}")
    assert unreachable() is None


def test_offline_fast_unreachable_hub_is_read_from_the_cache_only(tmp_path, monkeypatch):
    """Offline mode not set, Hub endpoint refusing: the benchmark load goes straight to the datasets
    cache (offline), and the message says the Hub cannot be reached, instead of half a minute of retries."""
    import datasets
    from huggingface_hub import constants

    from eval_worker.engine.suite import SuiteError, load_suite

    for var in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy", "HTTP_PROXY", "http_proxy"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:{_closed_port()}")
    with pytest.raises(SuiteError) as e:
        load_suite("hf:math500", hf_datasets_dir=tmp_path)
    msg = str(e.value)
    assert "the Hub cannot be reached" in msg and "not available offline" in msg
    assert constants.HF_HUB_OFFLINE is False and datasets.config.HF_HUB_OFFLINE is False  # restored


# --------------------------------------------------------------------------- what `make demo` installs

_DEMO_IMPORTS = """
import sys
for name in sys.argv[1:]:  # not installed by `make demo`: `import` fails and find_spec says None, as there
    sys.modules[name] = None
import eval_worker.cli, eval_worker.commands.demo, eval_worker.service.local_redis.demo_stack
import eval_worker.service.worker.worker
import eval_worker.service.worker.eval_job, eval_worker.engine.acceptance, eval_worker.results.report
import eval_worker.results.sinks.wandb_sink, hooks.eval_on_checkpoint, hooks.eval_flags
import dflash_train.training.trainer, dflash_train.training.cli
from eval_worker.results import report_figures
report_figures._plt()
import jinja2, markupsafe
print(" ".join(sorted({m.split('.')[0] for m, mod in list(sys.modules.items()) if mod is not None})))
"""


def _requirement_closure(names) -> set[str]:
    """Installed distributions reachable from `names` through their unconditional requirements."""
    import re
    from importlib import metadata

    norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()  # noqa: E731
    seen, todo = set(), [norm(n) for n in names]
    while todo:
        name = todo.pop()
        if name in seen:
            continue
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        seen.add(name)
        for req in requires:
            if "extra ==" in req:
                continue
            todo.append(norm(re.split(r"[\s<>=!~;\[(]", req.strip(), maxsplit=1)[0]))
    return seen


def test_demo_extras_cover_what_the_demo_imports_and_no_test_tools():
    """Every third-party module the demo's code imports comes with the core requirements or the `demo`
    extra; pytest, moto, hypothesis, scipy and rq-dashboard (the dev extra) are not pulled in by them."""
    import configparser
    import re
    import subprocess
    import sys
    from importlib import metadata

    from tests.support.sidecar_support import REPO_ROOT

    cfg = configparser.ConfigParser()
    cfg.read(REPO_ROOT / "setup.cfg")
    lines = lambda text: [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.strip().startswith("#")]  # noqa: E731
    core = [re.split(r"[<>=!~\[]", r)[0] for r in lines(cfg["options"]["install_requires"])]
    demo = [re.split(r"[<>=!~\[]", r)[0] for r in lines(cfg["options.extras_require"]["demo"])]
    allowed = _requirement_closure(core + demo)
    for tool in ("pytest", "moto", "hypothesis", "scipy", "rq-dashboard", "pytest-timeout"):
        assert tool not in allowed, f"{tool} comes with the demo's install"

    dists = metadata.packages_distributions()
    norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()  # noqa: E731
    ours = ("dflash_train", "eval_worker", "hooks", "tests")
    absent = sorted(m for m, owners in dists.items() if m.isidentifier() and m not in sys.stdlib_module_names
                    and m not in ours and not {norm(d) for d in owners} & allowed)
    assert "pytest" in absent and "moto" in absent
    run = subprocess.run([sys.executable, "-c", _DEMO_IMPORTS, *absent], capture_output=True, text=True,
                         cwd=REPO_ROOT, timeout=600)
    assert run.returncode == 0, "the demo's modules do not import with only the demo's install:\n" + run.stderr[-3000:]
    imported = set(run.stdout.split())
    assert not imported & set(absent)
    assert {"matplotlib", "jinja2", "torch", "rq"} <= imported  # the check saw the demo's real imports


# --------------------------------------------------------------------------- rq-dashboard with a job running

from tests.integration.test_sidecar_worker import ctx, setup  # noqa: E402,F401 - the worker stack fixtures


def test_dashboard_workers_view_while_a_job_runs(ctx, monkeypatch):  # noqa: F811 - the imported fixture
    """A real worker holds a real job (its evaluation gated): rq-dashboard's workers view and data
    answer 200 and name the running job; the stock app, JSON switch and all, answers 500."""
    pytest.importorskip("rq_dashboard")
    from rq_dashboard import web
    from rq_dashboard.app import create_app

    from eval_worker.commands.dashboard import dashboard_app
    from eval_worker.service.queueing.client import enqueue
    from tests.support.sidecar_support import read_calls, wait_for

    monkeypatch.setattr(web.config, "serializer", web.config.serializer)  # restored after the test
    monkeypatch.setattr(web, "Worker", web.Worker)
    for var in ("RQ_DASHBOARD_REDIS_URL", "RQ_DASHBOARD_JSON_SERIALIZER", "RQ_DASHBOARD_URL_PREFIX"):
        monkeypatch.setenv(var, "")
    w = ctx.start("w-dash", gated=True)
    w.wait_registered(ctx.conn)
    out = enqueue(ctx.conn, ctx.job(10))
    wait_for(lambda: read_calls(ctx.calls), 300, "the job to start evaluating")  # the job is running now

    monkeypatch.setenv("RQ_DASHBOARD_REDIS_URL", ctx.url)
    monkeypatch.setenv("RQ_DASHBOARD_JSON_SERIALIZER", "true")
    stock = create_app().test_client()
    assert stock.get("/0/data/workers.json").status_code == 500  # what the docs' launch line gave

    client = dashboard_app(ctx.url).test_client()
    data = client.get("/0/data/workers.json")
    assert data.status_code == 200
    [worker] = [x for x in data.get_json()["workers"] if x["name"] == "w-dash"]
    assert worker["current_job"]["job_id"] == out.job_id and worker["state"] == "busy"
    view = client.get("/0/view/workers")
    assert view.status_code == 200 and b"Connection Error" not in view.data
    assert client.get(f"/0/data/job/{out.job_id}.json").get_json()["status"] == "started"
    ctx.gate.touch()
    assert ctx.finished(out.job_id).get_status().value == "finished"


# --------------------------------------------------------------------------- store preflight


def test_store_preflight_missing_bucket_fails_at_once_everywhere(s3_server, tmp_path, capsys):
    """A missing bucket: trainer and worker stop before any work with one sentence naming the bucket and how
    to create it; with the bucket there the probe object is written, deleted, and leaves nothing."""
    from dflash_train.checkpoints import storage
    from dflash_train.training.cli import main as train_cli

    with pytest.raises(storage.StoreError, match=r"bucket 'nobucket' does not exist .*aws s3 mb s3://nobucket"):
        storage.preflight("s3://nobucket/runs")
    storage.preflight("hf://org/repo")  # read-only: nothing to probe

    rc = train_cli(["--config", "demo", "--max-steps", "1", "--publish-to", "s3://nobucket/runs",
                    "--checkpoint-root", str(tmp_path / "ckpts"), "--run-id", "r"], settings=_settings(tmp_path))
    err = capsys.readouterr().err
    assert rc == 2 and "dflash-train: --publish-to: bucket 'nobucket' does not exist" in err
    assert "Traceback" not in err and not (tmp_path / "ckpts" / "r").exists()  # nothing trained or published

    assert cli(["worker", "--checkpoint-root", "s3://nobucket/runs", "--redis-url", "redis://127.0.0.1:1/0"],
               settings=_settings(tmp_path)) == 2
    err = capsys.readouterr().err
    assert "--checkpoint-root s3://nobucket/runs: bucket 'nobucket' does not exist" in err

    s3_server.make_bucket("okbucket")
    storage.preflight("s3://okbucket/runs/deep")
    assert storage.store_for("s3://okbucket").list_names("s3://okbucket/runs/deep") == []  # probe deleted


# --------------------------------------------------------------------------- the latest demo, found without flags


def test_demo_pointer_results_report_status_find_the_latest_demo(tmp_path, redis_url, capsys):
    """What `dflash-eval demo` records (its own ledger under its workdir): `results` lists it, `results --run`
    and `report` read it, `status` shows its τ; a run in the configured ledger is still read from there."""
    import json

    from eval_worker.results import latest_demo
    from tests.support.eval_results import make_result, write_ledger

    settings = _settings(tmp_path / "home")
    work = tmp_path / "demo-output"
    for step, p in ((150, 0.3), (300, 0.5)):
        write_ledger(work / "results", make_result("demo-x", step, p=p))
    write_ledger(settings.results_dir, make_result("mine", 10))
    latest_demo.record(settings, run_id="demo-x", workdir=work, results=work / "results",
                       report=work / "report" / "demo-x" / "report.html", state="finished")

    assert cli(["results"], settings=settings) == 0
    listed = capsys.readouterr().out
    assert "demo-x" in listed and "latest demo" in listed and "mine" in listed
    assert cli(["results", "--run", "demo-x", "--json"], settings=settings) == 0
    out = capsys.readouterr()
    assert [r["step"] for r in json.loads(out.out)] == [150, 300] and "latest demo's ledger" in out.err
    assert cli(["results", "--run", "mine", "--json"], settings=settings) == 0
    assert [r["run"] for r in json.loads(capsys.readouterr().out)] == ["mine"]
    assert cli(["report"], settings=settings) == 0
    assert (work / "report" / "demo-x" / "report.html").is_file()
    capsys.readouterr()
    assert cli(["status", "--redis-url", redis_url], settings=settings) == 0
    shown = capsys.readouterr().out
    assert "latest demo (finished" in shown and "run demo-x, 2 evaluated" in shown
    assert cli(["status", "--redis-url", redis_url, "--json"], settings=settings) == 0
    assert json.loads(capsys.readouterr().out)["latest_demo"]["run_id"] == "demo-x"
