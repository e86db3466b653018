"""Property-based fuzzing (hypothesis) of everything a job brings in: payloads, checkpoint paths,
suite files, checkpoint configs and markers. Each case is either accepted (and then valid) or
refused with the module's own error and a message; nothing else escapes. Then the same payloads
and raw job-hash fields are planted in a real queue: the worker never crashes.
"""
from __future__ import annotations

import json
import os
import re
import string
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dflash_train.checkpoints.checkpoint import load_drafter, publish_checkpoint
from dflash_train.checkpoints.publication import CheckpointError, read_manifest
from dflash_train.core.config import ConfigError, DrafterConfig
from eval_worker.engine.suite import SuiteError, load_suite, parse_suite
from eval_worker.service.jobs.builder import make_job
from eval_worker.service.jobs.confinement import confine
from eval_worker.service.jobs.ids import job_id_for, suite_fingerprint
from eval_worker.service.jobs.schema import DEFAULTS, FIELDS, SCHEMA, JobError, validate_job
from eval_worker.service.queueing.queue import JOB_FUNC
from tests.support import soak, soak_stack

FUZZ = settings(max_examples=150, deadline=5000, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

scalars = (st.none() | st.booleans() | st.integers(min_value=-2**70, max_value=2**70)
           | st.floats(allow_nan=True, allow_infinity=True) | st.text(max_size=12))
json_values = st.recursive(scalars,
                           lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=6), c, max_size=3),
                           max_leaves=6)
paths = st.sampled_from(["/abs/ok", "relative/path", "", "/", "/a/../b", "/x\x00y", "~/x",
                         "C:\\x"]) | st.text(max_size=20)


# --------------------------------------------------------------------------- job payloads

VALID = {"schema": SCHEMA, "run_id": "run-1", "step": 100, "checkpoint": "/ckpts/run-1/step-00000100",
         "checkpoint_digest": "a" * 64, "suite": "builtin:coding-v1", "target": "/models/t", "baseline": None,
         "wandb": {"project": "p", "mode": "offline"}, "requested_by": "hook", "priority": "default", "attempt": 0,
         "train_metrics": {"loss": 1.5}, "options": {"max_new_tokens": 8}}
FIELD_VALUES = {
    "schema": st.sampled_from([SCHEMA, "dflash-eval-job/2", ""]) | scalars,
    "run_id": st.text(alphabet=string.ascii_letters + string.digits + "._-/ \u00e9", max_size=140) | scalars,
    "step": st.integers(min_value=-5, max_value=2**64) | scalars,
    "checkpoint": paths | scalars, "baseline": paths | scalars, "target": paths | scalars,
    "checkpoint_digest": st.text(alphabet="0123456789abcdefABCDEF", min_size=63, max_size=65) | scalars,
    "suite": st.text(max_size=30) | scalars,
    "wandb": st.dictionaries(st.sampled_from(["project", "group", "entity", "mode", "name", "tags", "x"]), scalars,
                             max_size=4) | scalars,
    "requested_by": st.sampled_from(["hook", "user", "requeue", "root"]) | scalars,
    "priority": st.sampled_from(["high", "default", "low", "urgent"]) | scalars,
    "attempt": st.integers(min_value=-2, max_value=2**40) | scalars,
    "train_metrics": st.dictionaries(st.text(max_size=6), scalars, max_size=3) | scalars,
    "options": st.dictionaries(st.text(max_size=8), json_values, max_size=3) | scalars,
}


@st.composite
def payloads(draw):
    kind = draw(st.integers(0, 9))
    if kind == 0:
        return draw(json_values)
    if kind == 1:
        return draw(st.text(max_size=40) | st.binary(max_size=40))  # raw JSON text or bytes
    p = dict(VALID)
    for key in draw(st.lists(st.sampled_from(sorted(FIELD_VALUES) + ["extra_field"]), max_size=4, unique=True)):
        action = draw(st.integers(0, 3))
        if action == 0:
            p.pop(key, None)
        else:
            p[key] = draw(FIELD_VALUES.get(key, json_values))
    return p


@FUZZ
@given(payloads())
def test_job_payloads_are_valid_or_refused_with_a_reason(payload):
    try:
        job = validate_job(payload)
    except JobError as e:
        assert str(e).strip()
        return
    data = job.to_json()
    given = json.loads(payload) if isinstance(payload, (str, bytes)) else payload
    assert set(data) == FIELDS
    # the JSON on the wire and on disk: the payload as given, defaults filled (text compared: 1 is not 1.0)
    assert json.dumps(data, sort_keys=True) == json.dumps({**DEFAULTS, **given}, sort_keys=True)
    json.dumps(data, allow_nan=False)  # plain JSON data
    assert validate_job(data) == job  # and stable
    assert re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}", job.run_id) and ".." not in job.run_id
    assert isinstance(job.step, int) and not isinstance(job.step, bool) and job.step >= 0
    for where in (job.checkpoint, job.baseline, job.target):
        assert where is None or (os.path.isabs(where) and "\x00" not in where)
    job_id = job_id_for(job, "0123abcd")
    assert re.fullmatch(r"[A-Za-z0-9_-]+", job_id), job_id  # RQ-safe


# --------------------------------------------------------------------------- checkpoint paths

@pytest.fixture(scope="module")
def tree(tmp_path_factory):
    """root/ holding a run, a symlink that leads out, one that stays in; outside/ next to it."""
    base = tmp_path_factory.mktemp("tree")
    root, outside = base / "root", base / "outside"
    (root / "run" / "step-00000001").mkdir(parents=True)
    (outside / "secret").mkdir(parents=True)
    (root / "out").symlink_to(outside)
    (root / "in").symlink_to(root / "run")
    (root / "run" / "up").symlink_to(base)
    return base, root


SEGMENTS = ["..", ".", "root", "run", "step-00000001", "out", "in", "up", "outside", "secret", "nope", ""]


@FUZZ
@given(st.lists(st.sampled_from(SEGMENTS), max_size=8), st.booleans())
def test_checkpoint_paths_never_leave_the_roots(tree, segments, from_base):
    base, root = tree
    path = os.path.join(str(base) if from_base else str(root), *segments) if segments else str(root)
    real = Path(os.path.realpath(path))
    inside = real == root or root in real.parents
    try:
        got = confine(path, [root])
    except JobError as e:
        assert not inside, f"{path} resolves inside the root ({real}) but was refused: {e}"
        assert "outside the checkpoint roots" in str(e)
        return
    assert inside, f"{path} resolves to {real}, outside {root}, and was accepted"
    assert got == real


# --------------------------------------------------------------------------- suite files

HEADER_KEYS = ["suite", "version", "chat_template", "max_new_tokens", "chat_template_kwargs", "description", "bogus"]
PROMPT_KEYS = ["name", "prompt", "messages", "ids"]
suite_lines = st.one_of(
    st.dictionaries(st.sampled_from(HEADER_KEYS), json_values | st.just("x"), min_size=1, max_size=4).map(
        lambda d: {"suite": "fz", **d}),
    st.dictionaries(st.sampled_from(PROMPT_KEYS), json_values | st.lists(st.integers(-3, 10**6), max_size=4)
                    | st.lists(st.fixed_dictionaries({"role": st.text(max_size=5), "content": st.text(max_size=5)}),
                               max_size=2), max_size=3),
    json_values,
).map(lambda v: json.dumps(v)) | st.text(max_size=30)


@FUZZ
@given(st.lists(suite_lines, max_size=6))
def test_suite_files_are_valid_or_refused_with_a_reason(lines):
    try:
        suite = parse_suite(lines, "fuzz.jsonl")
    except SuiteError as e:
        assert str(e).strip()
        return
    assert suite.prompts and suite.max_new_tokens >= 1
    assert re.fullmatch(r"[0-9a-f]{16}", suite.fingerprint())
    for p in suite.prompts:
        assert sum(x is not None for x in (p.prompt, p.messages, p.ids)) == 1
        if p.ids is not None:
            assert p.ids and all(isinstance(i, int) and i >= 0 for i in p.ids)
    json.dumps(suite.to_dict())


@settings(max_examples=40, deadline=5000, database=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.binary(max_size=60))
def test_suite_file_bytes_are_a_suite_error_never_a_crash(tmp_path, data):
    path = tmp_path / "fuzz.jsonl"
    path.write_bytes(data)
    try:
        load_suite(str(path))
    except SuiteError as e:
        assert str(e).strip()
    try:
        suite_fingerprint(str(path))
    except JobError as e:
        assert "fuzz.jsonl" in str(e)


# --------------------------------------------------------------------------- checkpoint configs and markers

@pytest.fixture(scope="module")
def published(tmp_path_factory):
    """A real published checkpoint of the micro-target shape: its config, weights and marker."""
    target = soak_stack.shared_target()
    cfg = soak_stack.drafter_config(target)
    from dflash_train.core.model import DFlashDrafter

    path = publish_checkpoint(DFlashDrafter(cfg).eval(), tmp_path_factory.mktemp("ckpt"), "fz", 1)
    return path, json.loads((path / "config.json").read_text()), json.loads((path / "COMPLETE.json").read_text())


CONFIG_KEYS = ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
               "head_dim", "vocab_size", "num_target_layers", "block_size", "rms_norm_eps", "rope_theta",
               "rope_scaling", "rope_parameters", "max_position_embeddings", "target_hidden_size", "torch_dtype",
               "dflash_config", "target_layer_ids", "mask_token_id"]
numbers = st.integers(min_value=-3, max_value=2**40) | st.sampled_from([0, 1, 2, 3, 64, 128, 10**12]) \
    | st.floats(allow_nan=True, allow_infinity=True)


@st.composite
def configs(draw, base):
    cfg = json.loads(json.dumps(base))
    for key in draw(st.lists(st.sampled_from(CONFIG_KEYS), min_size=1, max_size=4, unique=True)):
        action = draw(st.integers(0, 3))
        if action == 0:
            cfg.pop(key, None)
        elif key == "dflash_config" and action == 1:
            cfg[key] = {"mask_token_id": draw(numbers | scalars),
                        "target_layer_ids": draw(st.lists(numbers | scalars, max_size=4) | scalars)}
        else:
            cfg[key] = draw(numbers | json_values)
    return cfg


def _write_config(directory: Path, cfg) -> None:
    # json.dumps writes NaN/Infinity, which Python's reader accepts: a config can carry them
    (directory / "config.json").write_text(json.dumps(cfg))


@given(data=st.data())
@settings(max_examples=120, deadline=10000, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
def test_checkpoint_configs_load_or_are_refused_with_a_reason(published, tmp_path_factory, data):
    path, base, _ = published
    cfg = data.draw(configs(base))
    d = tmp_path_factory.mktemp("cfg")
    for f in ("model.safetensors",):
        os.link(path / f, d / f)
    _write_config(d, cfg)
    try:
        DrafterConfig.load(d)
    except ConfigError as e:
        assert str(e).strip()
    try:
        drafter = load_drafter(d)
    except CheckpointError as e:
        assert str(e).strip()
        return
    assert sum(p.numel() for p in drafter.parameters()) > 0  # loaded: the weights matched this config


@FUZZ
@given(data=st.data())
def test_completion_markers_are_valid_or_refused(published, tmp_path_factory, data):
    path, _, marker = published
    bad = json.loads(json.dumps(marker))
    for key in data.draw(st.lists(st.sampled_from(sorted(marker) + ["extra"]), min_size=1, max_size=3, unique=True)):
        if data.draw(st.booleans()):
            bad.pop(key, None)
        else:
            bad[key] = data.draw(json_values)
    d = tmp_path_factory.mktemp("marker")
    for f in ("model.safetensors", "config.json"):
        os.link(path / f, d / f)
    (d / "COMPLETE.json").write_text(json.dumps(bad) if data.draw(st.integers(0, 9)) else json.dumps(bad)[:-3])
    try:
        manifest = read_manifest(d)
    except CheckpointError as e:
        assert str(e).strip()
    else:
        assert isinstance(manifest["step"], int) and len(manifest["digest"]) == 64
    try:
        job = make_job(d, suite="builtin:coding-v1", roots=[d.parent])
    except JobError as e:
        assert str(e).strip()
    else:
        assert job.checkpoint_digest == bad["digest"] and job.step == bad["step"]


# --------------------------------------------------------------------------- the worker never crashes

@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """One worker, kept across examples (a long-running worker fed hostile input)."""
    s = soak_stack.Stack(tmp_path_factory.mktemp("fuzzq"), zygote=soak_stack.shared_zygote(),
                         target=soak_stack.shared_target())
    try:
        w = s.start_worker()
        s.counter = [0]
        yield s, w
    finally:
        s.close()


def _valid_job_runs(s) -> None:
    s.counter[0] += 1
    jid = s.enqueue(s.publish(1000 + s.counter[0]))
    s.wait_settled([jid], 60)
    assert s.statuses([jid])[jid] == "finished"


@settings(max_examples=3, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(st.lists(payloads(), min_size=12, max_size=12))
def test_fuzzed_payloads_in_the_queue_never_crash_the_worker(live, batch):
    from eval_worker.service.queueing.queue import failure_reason, fetch_job, get_queue

    s, w = live
    q = get_queue(s.conn, "dflash-eval")
    ids = []
    for payload in batch:
        s.counter[0] += 1
        jid = f"fuzz-{s.counter[0]}"
        try:
            q.enqueue_call(JOB_FUNC, args=(payload,), job_id=jid)
        except (TypeError, ValueError):
            continue  # not JSON-serialisable: cannot even be queued
        ids.append(jid)
    s.wait_settled(ids, 120)
    for jid in ids:
        job = fetch_job(s.conn, jid)
        assert job.get_status().value == "failed", jid  # none of these names a real checkpoint
        reason = failure_reason(job)
        assert reason and reason != "(no reason recorded)" and len(job.results()) == 1, (jid, reason)
    assert w.alive(), w.log()[-3000:]
    _valid_job_runs(s)


HASH_FIELDS = ["data", "status", "origin", "created_at", "enqueued_at", "started_at", "timeout", "result_ttl",
               "failure_ttl", "meta", "retries_left", "retry_intervals", "dependency_ids", "description",
               "success_callback_name", "failure_callback_name", "webhooks", "result", "ttl", "worker_name"]


@settings(max_examples=4, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(st.lists(st.dictionaries(st.sampled_from(HASH_FIELDS), st.binary(max_size=24) | st.text(max_size=24)
                                | st.sampled_from(["queued", "failed", "1", "-1", "[]", "{}", "null"]),
                                min_size=1, max_size=6), min_size=6, max_size=6))
def test_garbage_job_hashes_never_crash_the_worker(live, hashes):
    """Raw job hashes with random fields: each is run and failed, set aside, or skipped; the worker
    stays up, `status` still works, and a real job afterwards finishes."""
    from eval_worker.service.queueing.queue import status

    s, w = live
    for fields in hashes:
        s.counter[0] += 1
        soak.plant(s.conn, f"junk-{s.counter[0]}", fields)
    soak_stack.wait_for(lambda: s.conn.llen("rq:queue:dflash-eval") == 0, 60, "the junk to be taken")
    _valid_job_runs(s)
    assert w.alive(), w.log()[-3000:]
    status(s.conn)  # the status command copes with whatever is left in the registries
    assert "unhandled exception" not in w.log()
