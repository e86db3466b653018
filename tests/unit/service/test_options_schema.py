"""One schema for a job and its options, at enqueue and at the worker; oversized fields refused early and briefly.

Observed before: a 10 MB string in `chat_template` (a flag) was accepted and made a
21 MB ledger record; a typo was enqueued, pinned and hashed before it failed in the engine; a
10 MB `suite` failed with `OSError: File name too long` (retried) and `dflash-eval status`
printed the whole 10 MB line.
"""
from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rq.job import JobStatus

from dflash_train.checkpoints.publication import is_pinned
from eval_worker.cli import main as cli
from eval_worker.engine import acceptance, options
from eval_worker.redis_client import connect
from eval_worker.service.jobs.builder import make_job
from eval_worker.service.jobs.schema import JobError, validate_job
from eval_worker.service.queueing.client import enqueue
from eval_worker.service.queueing.queue import JOB_FUNC, MAX_REASON, fetch_job, get_queue, status
from tests.support.sidecar_support import publish_random

BIG = "x" * 10_000_000

BAD_OPTIONS = [
    ({"max_new_token": 16}, "unknown eval options ['max_new_token']"),    # a typo
    ({"max_new_tokens": "16"}, "options.max_new_tokens must be a valid integer"),
    ({"max_new_tokens": 0}, "options.max_new_tokens must be greater than or equal to 1"),
    ({"tree_budget": True}, "options.tree_budget must be a valid integer"),
    ({"chat_template": BIG}, "options.chat_template must be a valid boolean"),
    ({"mode": BIG}, "options.mode must be 'online' or 'stride'"),
    ({"draft_verify_cost_ratio": float("inf")}, "options.draft_verify_cost_ratio must be a finite number"),
    ({"seed": -1}, "options.seed must be greater than or equal to 0"),
    ({"backend": "cuda"}, "options.backend must be 'auto', 'flex' or 'sdpa'"),
]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return publish_random(tmp_path_factory.mktemp("ck"), "run-o", 100)


@pytest.mark.parametrize("bad, reason", BAD_OPTIONS, ids=[r[:30] for _, r in BAD_OPTIONS])
def test_options_schema_refuses_at_enqueue_before_anything_is_pinned(ckpt, redis_url, bad, reason):
    conn = connect(redis_url)
    with pytest.raises(JobError) as err:
        job = make_job(ckpt, suite="builtin:coding-v1", options=bad)  # the hook and the CLI build jobs here
    assert reason in str(err.value) and len(str(err.value)) < 1000
    job = make_job(ckpt, suite="builtin:coding-v1")
    with pytest.raises(JobError, match="invalid eval options|unknown eval options"):
        enqueue(conn, {**job.to_json(), "options": bad})  # a hand-made payload: same schema
    assert not is_pinned(ckpt) and get_queue(conn, "dflash-eval").count == 0
    assert not list(conn.scan_iter("dflash:*"))  # nothing remembered, nothing hashed into Redis


def test_options_schema_refuses_an_oversized_option_on_the_command_line(ckpt, redis_url, capsys):
    rc = cli(["enqueue", str(ckpt), "--redis-url", redis_url, "--option", "chat_template=" + "y" * 100_000])
    err = capsys.readouterr()
    assert rc == 2 and "options.chat_template must be a valid boolean" in err.out + err.err
    assert len(err.out + err.err) < 2000 and get_queue(connect(redis_url), "dflash-eval").count == 0


def test_options_schema_is_the_engines_own():
    assert acceptance.EvalOptions is options.EvalOptions  # enqueue, worker and engine: one class
    opts = options.EvalOptions.from_dict({"validate": True, "tree_budget": 4})
    assert opts.validate is True and opts.tree_budget == 4 and opts.head_rows is None


JSON = st.recursive(st.none() | st.booleans() | st.integers(-2**40, 2**40) | st.floats(allow_nan=False)
                    | st.text(max_size=20), lambda inner: st.lists(inner, max_size=3)
                    | st.dictionaries(st.text(max_size=5), inner, max_size=3), max_leaves=5)
KEYS = st.sampled_from(sorted(options.EvalOptions.known()) + ["max_new", "extra"])


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(KEYS, JSON, max_size=4))
def test_options_schema_accepts_at_enqueue_exactly_what_the_engine_accepts(opts):
    job = {"schema": "dflash-eval-job/1", "run_id": "r", "step": 1, "checkpoint": "/ck/r/step-1",
           "checkpoint_digest": "a" * 64, "suite": "builtin:coding-v1", "options": opts}
    try:
        options.EvalOptions.from_dict(opts)
        engine_ok = True
    except options.OptionsError as e:
        engine_ok = False
        assert len(str(e)) < 1500
    try:
        validate_job(job)
        assert engine_ok
    except JobError as e:
        assert not engine_ok and len(str(e)) < 1500


@pytest.mark.parametrize("field, value", [
    ("suite", BIG), ("checkpoint", "/" + BIG), ("target", "/" + BIG), ("baseline", "/" + BIG),
    ("run_id", BIG), ("wandb", {"project": BIG}), ("wandb", {"tags": ["t"] * 10_000}),
    ("train_metrics", {BIG: 1.0}), ("train_metrics", {f"m{i}": 1.0 for i in range(10_000)}),
])
def test_options_schema_size_limits_on_every_string_field(ckpt, field, value):
    job = make_job(ckpt, suite="builtin:coding-v1")
    with pytest.raises(JobError) as err:
        validate_job({**job.to_json(), field: value})
    assert field in str(err.value) and len(str(err.value)) < 1000


def test_options_schema_oversized_fields_fail_once_at_the_worker_and_status_stays_short(ckpt, redis_url, tmp_path,
                                                                                        capsys, worker_evaluators):
    """Hand-pushed payloads with a 10 MB suite / option: a non-retryable job error (ValueError) at the
    worker, before any file is touched; `status` shows a short reason."""
    from eval_worker.service.worker.eval_job import run_eval_job
    from eval_worker.service.worker.evaluators import WorkerSettings

    job = make_job(ckpt, suite="builtin:coding-v1")
    worker_evaluators(WorkerSettings(results_dir=tmp_path / "results", roots=[ckpt.parents[1]]))
    for bad in ({**job.to_json(), "suite": BIG}, {**job.to_json(), "options": {"chat_template": BIG}}):
        with pytest.raises(JobError) as err:  # a ValueError: run_eval_job stops RQ's retries for it
            run_eval_job(bad)
        assert isinstance(err.value, ValueError) and len(str(err.value)) < 1000
        assert "File name too long" not in str(err.value)
    assert not (tmp_path / "results").exists()

    # a failure whose text is huge anyway (any exception): `status` shows the start of it
    conn = connect(redis_url)
    rq_job = get_queue(conn, "dflash-eval").enqueue_call(JOB_FUNC, args=(job.to_json(),), job_id="huge-failure",
                                                         meta={"run_id": "run-o", "step": 100})
    with conn.pipeline() as pipe:
        rq_job.set_status(JobStatus.FAILED, pipeline=pipe)
        rq_job._handle_failure("Traceback (most recent call last):\n  File \"x\"\nOSError: " + BIG, pipe)
        pipe.execute()
    reason = status(conn)["failed"][0]["reason"]
    assert reason.startswith("OSError: xxx") and len(reason) < MAX_REASON + 100
    assert cli(["status", "--redis-url", redis_url]) == 0
    out = capsys.readouterr().out
    assert "huge-failure" in out and len(out) < 5000
    assert cli(["status", "--json", "--redis-url", redis_url]) == 0
    assert len(json.loads(capsys.readouterr().out)["failed"][0]["reason"]) < MAX_REASON + 100
    assert fetch_job(conn, "huge-failure").get_status() == JobStatus.FAILED
