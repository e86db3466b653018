"""Reliability of the job service: pins and fast workers, suite size limits, clock skew between
worker boxes, a hook whose outbox disk is full, secrets in URLs (docs/reliability.md rows).

Real parts throughout: a real redis-server (tests/conftest.py), real RQ workers (in-process
`serve(burst=True)` or `dflash-eval worker` subprocesses), the stand-in engine
tests.support.fake_evaluator (no model: these tests are about the service, not the number).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis
from rq import Queue
from rq.job import JobStatus

from eval_worker.service.jobs.builder import make_job
from eval_worker.service.jobs.schema import JobError
from eval_worker.service.queueing.client import enqueue
from eval_worker.service.queueing.queue import fetch_job
from eval_worker.service.worker.evaluators import WorkerSettings
from eval_worker.service.worker.worker import serve
from tests.support.sidecar_support import REPO_ROOT, publish_random

FAKE = "tests.support.fake_evaluator:FakeEvaluator"
GATED = "tests.support.sidecar_support:gated_fake_evaluator"



def _settings(tmp_path: Path, root: Path, *, gated: bool = False, **kw) -> WorkerSettings:
    return WorkerSettings(results_dir=tmp_path / "results", roots=[root, tmp_path], default_target=str(tmp_path),
                          evaluator_factory=GATED if gated else FAKE, **kw)


def _pins(checkpoint: Path) -> list[str]:
    d = checkpoint / ".pins"
    return sorted(p.name for p in d.iterdir()) if d.is_dir() else []


# --------------------------------------------------------------------------- pin before enqueue

def test_pin_race_a_worker_done_before_enqueue_returns_leaves_no_pin(conn, tmp_path, monkeypatch):
    """A worker (real RQ worker, in-process, burst) takes the job, records it and unpins before
    `enqueue_call` has returned to the enqueuer. The enqueuer must not pin after that."""
    monkeypatch.setenv("DFLASH_SINKS", "none")
    root = tmp_path / "ck"
    path = publish_random(root, "run-pin", 5, seed=5)
    settings = _settings(tmp_path, root)
    real = Queue.enqueue_call
    ran = []

    def with_a_fast_worker(self, *args, **kwargs):
        job = real(self, *args, **kwargs)
        serve(conn, [self.name], settings, burst=True, preload=False, with_scheduler=False, name="w-fast")
        ran.append(job.get_status(refresh=True))
        return job

    monkeypatch.setattr(Queue, "enqueue_call", with_a_fast_worker)
    out = enqueue(conn, make_job(path, suite="builtin:coding-v1", target=str(tmp_path)))
    assert out.status == "enqueued" and ran == [JobStatus.FINISHED]
    assert _pins(path) == []  # retention may remove the checkpoint now: its only job is recorded

    # more enqueuers of the same checkpoint, now that it is done: each pins first, sees the job
    # finished (or recorded), and takes its pin back
    monkeypatch.setattr(Queue, "enqueue_call", real)
    for _ in range(3):
        again = enqueue(conn, make_job(path, suite="builtin:coding-v1", target=str(tmp_path)))
        assert again.status in ("duplicate", "evaluated")
    assert _pins(path) == []

    # and an enqueue that fails takes its pin back: nothing was queued to release it
    other = publish_random(root, "run-pin", 6, seed=6)

    def refused(self, *args, **kwargs):
        raise redis.exceptions.ConnectionError("connection refused")

    monkeypatch.setattr(Queue, "enqueue_call", refused)
    with pytest.raises(redis.exceptions.ConnectionError):
        enqueue(conn, make_job(other, suite="builtin:coding-v1", target=str(tmp_path)))
    assert _pins(other) == []




# --------------------------------------------------------------------------- clock skew between boxes

SKEW_S = 300


def _skewed_maintenance(conn, monkeypatch, skew: float) -> None:
    """One maintenance pass of a real RQ worker (EvalWorker) on a box whose clock is `skew` s off:
    the time source of RQ's registry cleanup in this process is patched (the running worker is
    another process, on the true clock)."""
    import rq.registry
    from rq.serializers import JSONSerializer

    from eval_worker.service.queueing.queue import get_queue
    from eval_worker.service.worker.job_guard import EvalJob
    from eval_worker.service.worker.worker import EvalWorker
    from tests.support.sidecar_support import wait_for

    queue = get_queue(conn, "dflash-eval")
    worker = EvalWorker([queue], connection=conn, serializer=JSONSerializer, job_class=EvalJob,
                        name=f"w-skewed{skew:+.0f}", maintenance_interval=1, job_monitoring_interval=1,
                        heartbeat_grace=2)
    true_clock = rq.registry.current_timestamp
    with monkeypatch.context() as mp:
        mp.setattr(rq.registry, "current_timestamp", lambda: true_clock() + skew)
        # the running worker's own maintenance holds the queue's lock for a moment now and then
        wait_for(lambda: conn.set(queue.registry_cleaning_key, 1, nx=True, ex=60), 30, "the maintenance lock")
        conn.delete(queue.registry_cleaning_key)
        worker.clean_registries()
    assert worker.last_cleaned_at is not None


def _running_worker(tmp_path, redis_url, root, name):
    from tests.support.sidecar_support import WorkerProcess

    # its own maintenance only at start: the skewed box is the one that cleans
    return WorkerProcess(tmp_path, redis_url, [root, tmp_path], name=name, target=tmp_path,
                         args=["--evaluator-factory", "tests.support.sidecar_support:gated_fake_evaluator",
                               "--maintenance-interval", "3600"],
                         env={"SIDECAR_GATE": str(tmp_path / "gate"), "SIDECAR_CALLS": str(tmp_path / "calls.jsonl")})


def test_clock_skew_a_box_ahead_does_not_take_a_running_job_for_abandoned(conn, redis_url, tmp_path, monkeypatch):
    from eval_worker.service.queueing.queue import QueueConfig, get_queue
    from tests.support.sidecar_support import read_calls, wait_for

    root = tmp_path / "ck"
    path = publish_random(root, "run-skew", 7, seed=7)
    calls = tmp_path / "calls.jsonl"
    a = _running_worker(tmp_path, redis_url, root, "w-true-clock")
    try:
        a.wait_registered(conn)
        out = enqueue(conn, make_job(path, suite="builtin:coding-v1", target=str(tmp_path)),
                      config=QueueConfig(retry_max=2, retry_intervals=[]))
        wait_for(lambda: read_calls(calls), 60, "the job to start on the first worker")

        _skewed_maintenance(conn, monkeypatch, +SKEW_S)  # 300 s ahead: far past the 3 s heartbeat TTL
        job = fetch_job(conn, out.job_id)
        assert job.get_status() == JobStatus.STARTED and job.worker_name == "w-true-clock"
        assert job.retries_left == 2 and get_queue(conn, "dflash-eval").count == 0  # not retried, not queued

        # let it finish; then a second real worker (burst, same gated engine) takes whatever is queued
        (tmp_path / "gate").touch()
        wait_for(lambda: fetch_job(conn, out.job_id).get_status() == JobStatus.FINISHED, 60, "the job to finish")
        monkeypatch.setenv("SIDECAR_CALLS", str(calls))
        monkeypatch.setenv("DFLASH_SINKS", "none")
        serve(conn, ["dflash-eval"], _settings(tmp_path, root, gated=True), burst=True, preload=False,
              with_scheduler=False, name="w-second")
        executions = read_calls(calls)
        assert len(executions) == 1, executions  # main: 2 (the skewed box re-queued the running job)
        assert fetch_job(conn, out.job_id).retries_left == 2  # no retry burnt either
        assert len(list((tmp_path / "results").rglob("attempt-*.json"))) == 1
    finally:
        a.stop()


def test_clock_skew_a_box_behind_still_recovers_a_dead_workers_job(conn, redis_url, tmp_path, monkeypatch):
    """The other direction: the worker dies (SIGKILL); a box whose clock lags 300 s takes the job
    for abandoned as soon as its heartbeat key lapsed in Redis (on main it waited 300 s more)."""
    from rq.registry import StartedJobRegistry

    from eval_worker.service.queueing.queue import QueueConfig, get_queue
    from tests.support.sidecar_support import read_calls, wait_for

    root = tmp_path / "ck"
    path = publish_random(root, "run-skew", 8, seed=8)
    a = _running_worker(tmp_path, redis_url, root, "w-doomed")
    try:
        a.wait_registered(conn)
        out = enqueue(conn, make_job(path, suite="builtin:coding-v1", target=str(tmp_path)),
                      config=QueueConfig(retry_max=2, retry_intervals=[]))
        wait_for(lambda: read_calls(tmp_path / "calls.jsonl"), 60, "the job to start")
        [entry] = conn.zrange(StartedJobRegistry("dflash-eval", connection=conn).key, 0, -1)
        a.kill_group()
        # the heartbeat TTL (1 s interval + 2 s grace) runs out on the Redis server's clock
        wait_for(lambda: not conn.exists(b"rq:execution:" + entry), 30, "the execution key to lapse")
        _skewed_maintenance(conn, monkeypatch, -SKEW_S)
        job = fetch_job(conn, out.job_id)
        assert job.get_status() == JobStatus.QUEUED and job.retries_left == 1
        assert get_queue(conn, "dflash-eval").get_job_ids() == [out.job_id]
    finally:
        a.stop()


# --------------------------------------------------------------------------- suite files within the job's limits

def _suite_file(path: Path, header: dict, prompts: list[dict] | None = None) -> Path:
    prompts = prompts or [{"name": "p0", "ids": [1, 2, 3]}]
    path.write_text("".join(json.dumps(x) + "\n" for x in [{"suite": "big", "version": "1", **header}, *prompts]))
    return path


def test_suite_limits_max_new_tokens_has_the_job_options_cap():
    """Property: a suite header's max_new_tokens is accepted exactly where the option's is."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from eval_worker.engine.options import EvalOptions, OptionsError
    from eval_worker.engine.suite import SuiteError, parse_suite

    def option_ok(n):
        try:
            EvalOptions.from_dict({"max_new_tokens": n})
            return True
        except OptionsError:
            return False

    @settings(max_examples=60, deadline=None)
    @given(st.one_of(st.integers(-5, 1 << 40), st.sampled_from([0, 1, 1 << 16, (1 << 16) + 1, 10 ** 9])))
    def check(n):
        lines = [json.dumps({"suite": "s", "max_new_tokens": n}), json.dumps({"ids": [1, 2]})]
        try:
            suite_ok = parse_suite(lines, "s.jsonl").max_new_tokens == n
        except SuiteError as e:
            assert "max_new_tokens" in str(e) and "65536" in str(e)
            suite_ok = False
        assert suite_ok == option_ok(n)

    check()


@pytest.mark.parametrize("header, prompts, match", [
    ({"max_new_tokens": 1_000_000_000}, None, "max_new_tokens must be >= 1 and <= 65536"),
    ({"max_new_tokens": 1e9}, None, "max_new_tokens"),
    ({"max_new_tokens": True}, None, "max_new_tokens"),
    ({"suite": "n" * 300}, None, "at most 256 characters"),
    ({}, [{"name": "p" * 300, "ids": [1]}], "longer than 256 characters"),
    ({}, [{"name": "p", "ids": [1, 1 << 40]}], "token ids"),
    ({"description": "d" * 5000}, None, "description"),
])
def test_suite_limits_an_oversized_suite_file_is_refused_at_enqueue(conn, tmp_path, header, prompts, match):
    root = tmp_path / "ck"
    path = publish_random(root, "run-suite", 3, seed=3)
    suite = _suite_file(root / "big.jsonl", header, prompts)
    with pytest.raises(JobError, match=match):
        enqueue(conn, make_job(path, suite=str(suite), target=str(tmp_path)))
    assert _pins(path) == []  # refused before anything was pinned or queued


def test_suite_limits_a_suite_grown_after_enqueue_fails_its_job_once(conn, tmp_path, monkeypatch):
    """The worker applies the limits too: a suite file rewritten after its job was queued fails
    that job at once (no retries, the reason names the limit), and the worker carries on."""
    monkeypatch.setenv("DFLASH_SINKS", "none")
    from eval_worker.service.queueing.queue import QueueConfig, failure_reason, status

    root = tmp_path / "ck"
    path = publish_random(root, "run-suite", 4, seed=4)
    suite = _suite_file(root / "grows.jsonl", {"max_new_tokens": 16})
    out = enqueue(conn, make_job(path, suite=str(suite), target=str(tmp_path)), config=QueueConfig(retry_max=2))
    _suite_file(suite, {"max_new_tokens": 1_000_000_000})
    serve(conn, ["dflash-eval"], _settings(tmp_path, root), burst=True, preload=False, with_scheduler=False,
          name="w-suite")
    job = fetch_job(conn, out.job_id)
    assert job.get_status() == JobStatus.FAILED and job.retries_left == 0 and len(job.results()) == 1
    assert "max_new_tokens must be >= 1 and <= 65536" in failure_reason(job)
    assert [f["job_id"] for f in status(conn)["failed"]] == [out.job_id]


# --------------------------------------------------------------------------- the hook's outbox on a full disk

@pytest.fixture
def full_outbox(tmp_path):
    """A run directory whose `.eval-outbox` is a real, full filesystem (a 64 KiB tmpfs filled up);
    the checkpoints beside it are on the ordinary disk. Root only (skips elsewhere)."""
    from tests.support import soak

    why = soak.can_mount()
    if why:
        pytest.skip(why)
    from eval_worker.service.queueing.outbox import OUTBOX_DIRNAME

    root = tmp_path / "ck"
    box = root / "run-full" / OUTBOX_DIRNAME
    box.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k,mode=0700", "tmpfs", str(box)], check=True, timeout=30)
    filler = box / ".filler"
    try:
        with open(filler, "wb", buffering=0) as fh:
            try:
                while True:
                    fh.write(b"\0" * 4096)
            except OSError:
                pass  # ENOSPC: the disk is full
        yield root, box, filler
    finally:
        subprocess.run(["umount", "-l", str(box)], check=False, timeout=30)


def _hook_user(conn, redis_url: str, *, queue_writes: bool) -> str:
    """A Redis user for the hook that may write its owed-job notes, and the queue only when
    `queue_writes`: a real server refusing the queue's writes (NOPERM), as one out of memory does."""
    from urllib.parse import urlsplit

    conn.execute_command("ACL", "SETUSER", "hook", "reset", "on", ">hook-pw", "+@all", "&*", "~dflash:owed:*",
                         *(["~*"] if queue_writes else []))
    u = urlsplit(redis_url)
    return f"redis://hook:hook-pw@{u.hostname}:{u.port}{u.path or ''}"


def test_outbox_disk_full_a_hook_request_is_owed_reported_then_queued(conn, redis_url, full_outbox, tmp_path,
                                                                      capsys):
    from eval_worker.cli import main as cli
    from eval_worker.service.queueing.queue import status
    from hooks.eval_on_checkpoint import EvalOnCheckpoint
    from tests.support.sidecar_support import wait_for

    root, box, filler = full_outbox
    ckpts = {s: publish_random(root, "run-full", s, seed=s) for s in (11, 12, 13)}
    with pytest.raises(OSError):  # the disk really is full
        (box / "probe").write_bytes(b"x" * 8192)
    url = _hook_user(conn, redis_url, queue_writes=False)
    hook = EvalOnCheckpoint(every_n_steps=1, suite="builtin:coding-v1", target=str(tmp_path), redis_url=url,
                            min_backoff=0.05, max_backoff=0.2, reconcile_interval=0.2)
    try:
        # 1. disk full, queue refusing: the request is owed in memory, shown by `status`, its pin kept
        hook.on_checkpoint_published(None, 11, ckpts[11], None)
        assert list(box.glob("*.json")) == [] and any("step 11" in e and "No space" in e for e in hook.errors)
        owed = wait_for(lambda: status(conn)["owed"], 30, "status to list the owed job")
        assert [(o["run_id"], o["step"], o["lost"]) for o in owed] == [("run-full", 11, False)]
        assert "No space left on device" in owed[0]["why"]
        assert cli(["status", "--redis-url", redis_url]) == 0
        text = capsys.readouterr().out
        assert "owed by a trainer, not queued" in text and "run=run-full step=11" in text, text
        assert hook.protects(ckpts[11]) and _pins(ckpts[11])  # retention keeps it while it is owed

        # 2. the queue takes writes again, the disk is still full: queued straight from memory
        _hook_user(conn, redis_url, queue_writes=True)
        wait_for(lambda: [j["step"] for j in status(conn)["queued"]] == [11], 30, "step 11 to be queued")
        wait_for(lambda: status(conn)["owed"] == [], 30, "the owed note to be cleared")
        assert not hook.protects(ckpts[11]) and list(box.glob("*.json")) == []

        # 3. space returns: the next request is durable on disk first, then queued
        filler.unlink()
        hook.on_checkpoint_published(None, 12, ckpts[12], None)
        wait_for(lambda: sorted(j["step"] for j in status(conn)["queued"]) == [11, 12], 30, "step 12 to be queued")
    finally:
        hook.close()


def test_outbox_disk_full_train_end_lists_every_owed_step_and_drops_its_pin(conn, redis_url, full_outbox,
                                                                           tmp_path, caplog):
    import logging

    from eval_worker.service.queueing.queue import status
    from hooks.eval_on_checkpoint import EvalOnCheckpoint

    root, box, _ = full_outbox
    ckpts = {s: publish_random(root, "run-full", s, seed=s) for s in (20, 21)}
    url = _hook_user(conn, redis_url, queue_writes=False)
    hook = EvalOnCheckpoint(every_n_steps=1, suite="builtin:coding-v1", target=str(tmp_path), redis_url=url,
                            min_backoff=0.05, max_backoff=0.2, train_end_timeout=1.0, eval_final=False)
    caplog.set_level(logging.ERROR, logger="hooks.eval_on_checkpoint")
    for s in (20, 21):
        hook.on_checkpoint_published(None, s, ckpts[s], None)
    hook.on_train_end(None)
    for s in (20, 21):
        assert any(f"step {s} was never queued" in e for e in hook.errors), hook.errors
        assert _pins(ckpts[s]) == []  # nothing will queue it: its pin does not keep the checkpoint for ever
    assert any("NOT QUEUED for step(s) [20, 21]" in r.getMessage() for r in caplog.records)
    owed = status(conn)["owed"]
    assert [(o["step"], o["lost"]) for o in owed] == [(20, True), (21, True)]  # still visible after the trainer left


# --------------------------------------------------------------------------- no secret of a URL in any output

SECRET = "pl4nted-S3CRET-value"
STORE_URL = f"s3://AKIAPLANTED:{SECRET}@bkt/runs/run-sec/step-00000001"


def _cli(args: list[str], env: dict | None = None) -> str:
    """`dflash-eval ARGS` as a user runs it; stdout and stderr together."""
    full = {**os.environ, "PYTHONPATH": str(REPO_ROOT), **(env or {})}
    out = subprocess.run([sys.executable, "-m", "eval_worker", *args], cwd=REPO_ROOT, env=full,
                         capture_output=True, text=True, timeout=300)
    return out.stdout + out.stderr


def test_secret_redaction_redact_masks_every_url_in_any_text():
    """Property: whatever surrounds a URL with credentials, neither its secret nor the pair survives."""
    from hypothesis import given, settings
    from hypothesis import strategies as st

    from dflash_train.checkpoints.storage import redact  # = dflash_train.common.redaction.redact

    secret_chars = st.text(alphabet=st.characters(whitelist_categories=("Ll", "Lu", "Nd"),
                                                  whitelist_characters="-_.~!$"),
                           min_size=6, max_size=30)

    @settings(max_examples=200, deadline=None)
    @given(st.sampled_from(["s3", "gs", "redis", "rediss", "https", "hf"]), secret_chars,
           st.sampled_from(["", "user", "AKIA1"]), st.sampled_from(["{}", "'{}'", '"{}"', "({})", "{}: gone", "x={},"]),
           st.text(alphabet=" abc\n:", max_size=20))
    def check(scheme, secret, user, shape, noise):
        url = f"{scheme}://{user + ':' if user else ''}{secret}@host.example/a/b?x=1"
        text = noise + shape.format(url) + noise
        out = redact(text)
        # the secret may also occur by chance in what surrounds it ("?x=1" + "aaaaa" holds "1aaaaa")
        by_chance = (noise + shape.format(url.replace(f"{secret}@", "@")) + noise).count(secret)
        assert out.replace("***", "").count(secret) <= by_chance
        assert f"{scheme}://" in out  # still says which location

    check()
    assert redact("redis://:pw@h?password=pw2") == "redis://:***@h?password=***"


def test_secret_redaction_no_output_shows_a_planted_secret(conn, redis_url, tmp_path):
    """A store URL with `key:secret@` given to `enqueue`, planted in a job, named in the environment:
    CLI stdout/stderr, RQ's failure text, `status` (text and JSON) and the worker log never show it."""
    from eval_worker.service.queueing.queue import JOB_FUNC, QueueConfig, failure_reason, get_queue
    from tests.support.sidecar_support import WorkerProcess

    root = tmp_path / "ck"
    path = publish_random(root, "run-sec", 1, seed=1)
    outputs = {}
    outputs["enqueue"] = _cli(["enqueue", STORE_URL, "--redis-url", redis_url])
    outputs["enqueue --json"] = _cli(["enqueue", STORE_URL, "--json", "--redis-url", redis_url])
    outputs["status (env)"] = _cli(["status", "--redis-url", redis_url],
                                   env={"DFLASH_CHECKPOINT_ROOTS": f"s3://AKIAPLANTED:{SECRET}@bkt/runs"})
    assert "***@bkt/runs/run-sec/step-00000001" in outputs["enqueue"]  # the location is still named

    # a job planted straight into RQ (as any client of the queue could), naming the URL
    job = {**make_job(path, suite="builtin:coding-v1", target=str(tmp_path)).to_json(), "checkpoint": STORE_URL}
    get_queue(conn, "dflash-eval").enqueue_call(JOB_FUNC, args=(job,), job_id="planted", retry=QueueConfig().retry(),
                                               meta={"run_id": "run-sec", "step": 1})
    w = WorkerProcess(tmp_path, redis_url, [root, tmp_path], name="w-sec", target=tmp_path,
                      args=["--evaluator-factory", FAKE, "--burst", "--no-preload"])
    assert w.wait(120) == 0
    w.stop()
    planted = fetch_job(conn, "planted")
    assert planted.get_status() == JobStatus.FAILED
    outputs["RQ failure text"] = planted.latest_result().exc_string
    outputs["failure reason"] = failure_reason(planted)
    outputs["status"] = _cli(["status", "--redis-url", redis_url])
    outputs["status --json"] = _cli(["status", "--json", "--redis-url", redis_url])
    outputs["worker log"] = w.log()
    leaks = {name: text for name, text in outputs.items() if SECRET in text or f"AKIAPLANTED:{SECRET[:4]}" in text}
    assert not leaks, {k: [ln for ln in v.splitlines() if SECRET in ln][:3] for k, v in leaks.items()}
    assert "***@bkt/runs/run-sec" in outputs["RQ failure text"] and "***@bkt" in outputs["worker log"]  # it said why


@pytest.mark.slow  # ~10 s: CI's slow pass (the default suite stays under 10 min on 2 cores)
def test_clock_skew_soak_two_workers_one_box_ahead(tmp_path, zygote, target):
    """The soak scenario at its small size: real worker processes on the micro target, one of them
    with its maintenance clock 300 s ahead; on main 1 of 6 jobs ran twice."""
    from tests.support import soak

    row = soak.scenario_clock_skew(tmp_path, zygote, target, **soak.QUICK["skew"])
    assert row.lost == 0 and row.duplicated == 0 and row.recorded == row.accepted == 6
    assert row.details["duplicate_executions"] == 0 and row.details["executions"] == 6, row.observed
    assert row.details["duplicate_evaluations"] == 0, row.observed
    assert not row.details["problems"], row.observed
