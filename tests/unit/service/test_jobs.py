"""Job schema, deterministic ids and checkpoint checks (no Redis)."""
from __future__ import annotations

import json
import os

import pytest

from eval_worker.results.attempts import strip_attempt
from eval_worker.service.jobs.builder import make_job
from eval_worker.service.jobs.checkpoints import check_checkpoint
from eval_worker.service.jobs.ids import base_job_id, job_id_for, suite_fingerprint
from eval_worker.service.jobs.schema import SCHEMA, JobError, validate_job
from tests.support.sidecar_support import publish_random


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpts")
    return root, publish_random(root, "run-a", 100)


def _job(ckpt, **kw):
    return make_job(ckpt, suite="builtin:coding-v1", **kw)


def test_make_job_reads_the_marker(published):
    root, ckpt = published
    job = _job(ckpt)
    manifest = json.loads((ckpt / "COMPLETE.json").read_text())
    assert job.to_json()["schema"] == SCHEMA
    assert (job.run_id, job.step, job.checkpoint_digest) == ("run-a", 100, manifest["digest"])
    assert job.checkpoint == str(ckpt) and os.path.isabs(job.checkpoint)
    assert job.train_metrics["loss"] == pytest.approx(1.1)
    assert json.loads(json.dumps(job.to_json())) == job.to_json()  # plain JSON data
    assert validate_job(job.to_json()) == job  # the JSON round trip gives the same job


def test_suite_files_are_made_absolute(published, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "s.jsonl").write_text("")
    assert make_job(published[1], suite="s.jsonl").suite == str(tmp_path / "s.jsonl")
    assert make_job(published[1], suite="builtin:coding-v1").suite == "builtin:coding-v1"


@pytest.mark.parametrize("mutate, reason", [
    (lambda j: j.update(schema="dflash-eval-job/2"), "unknown job schema version"),
    (lambda j: j.pop("schema"), "no 'schema' field"),
    (lambda j: j.pop("checkpoint_digest"), "missing required field(s): checkpoint_digest"),
    (lambda j: j.update(step=-1), "step must be a non-negative integer"),
    (lambda j: j.update(step="100"), "step must be a non-negative integer"),
    (lambda j: j.update(run_id="../etc"), "run_id"),
    (lambda j: j.update(checkpoint="relative/path"), "checkpoint must be an absolute path"),
    (lambda j: j.update(checkpoint_digest="abc"), "checkpoint_digest must be 64"),
    (lambda j: j.update(priority="urgent"), "priority must be one of"),
    (lambda j: j.update(requested_by="cron"), "requested_by must be one of"),
    (lambda j: j.update(chekpoint="/x"), "unknown field(s) ['chekpoint']"),
    (lambda j: j.update(train_metrics={"loss": float("nan")}), "finite numbers"),
    (lambda j: j.update(wandb={"mode": "sideways"}), "wandb.mode"),
])
def test_invalid_payloads_are_refused_with_the_reason(published, mutate, reason):
    job = _job(published[1]).to_json()
    mutate(job)
    with pytest.raises(JobError, match=None) as err:
        validate_job(job)
    assert reason in str(err.value)


def test_non_object_and_bad_json_payloads():
    with pytest.raises(JobError, match="must be a JSON object"):
        validate_job([1, 2])
    with pytest.raises(JobError, match="not valid JSON"):
        validate_job("{nope")


def test_job_id_is_deterministic_and_rq_safe(published):
    job = _job(published[1])
    a = job_id_for(job, "0123456789abcdef")
    assert a == job_id_for(validate_job(job.to_json()), "0123456789abcdef")
    assert a == f"eval-run-a-100-{job.checkpoint_digest[:12]}-01234567"
    assert job_id_for(job.replace(attempt=3), "0123456789abcdef") == a + "-r3"
    assert strip_attempt(a + "-r3") == a
    # characters RQ refuses are replaced, and distinct runs stay distinct
    b = base_job_id("exp.1", 5, "f" * 64, "ab" * 8)
    c = base_job_id("exp_1", 5, "f" * 64, "ab" * 8)
    assert b != c and all(ch.isalnum() or ch in "_-" for ch in b)


def test_suite_fingerprint_depends_on_suite_and_options():
    a = suite_fingerprint("builtin:coding-v1")
    assert a == suite_fingerprint("builtin:coding-v1")
    assert suite_fingerprint("builtin:coding-v1", {"max_new_tokens": 16}) != a
    with pytest.raises(JobError, match="unknown or unreadable suite"):
        suite_fingerprint("builtin:nope")


def test_checkpoint_outside_roots_is_refused(published, tmp_path):
    root, ckpt = published
    job = _job(ckpt)
    manifests = check_checkpoint(job, [root])
    assert list(manifests) == [os.path.realpath(ckpt)]  # the manifests read, by real path (for the engine)
    assert manifests[os.path.realpath(ckpt)]["digest"] == job.checkpoint_digest
    with pytest.raises(JobError, match="outside the checkpoint roots"):
        check_checkpoint(job, [tmp_path])


def test_symlink_escape_is_refused(published, tmp_path):
    _, ckpt = published
    inside = tmp_path / "root"
    inside.mkdir()
    link = inside / "step-00000100"
    link.symlink_to(ckpt, target_is_directory=True)
    job = _job(ckpt).replace(checkpoint=str(link))
    with pytest.raises(JobError, match="resolves to .* outside the checkpoint roots"):
        check_checkpoint(job, [inside])


def test_file_symlink_escape_inside_a_checkpoint_is_refused(tmp_path):
    root = tmp_path / "root"
    ckpt = publish_random(root, "run-s", 7)
    outside = tmp_path / "elsewhere.safetensors"
    os.replace(ckpt / "model.safetensors", outside)
    (ckpt / "model.safetensors").symlink_to(outside)
    job = make_job(ckpt, suite="builtin:coding-v1")
    check_checkpoint(job, [root])  # cheap enqueue-side check passes (marker only)
    with pytest.raises(JobError, match="outside the checkpoint roots"):
        check_checkpoint(job, [root], verify_digest=True)


def test_missing_marker_and_digest_mismatch(tmp_path):
    root = tmp_path / "root"
    ckpt = publish_random(root, "run-m", 3)
    job = make_job(ckpt, suite="builtin:coding-v1")
    with pytest.raises(JobError, match="digest in COMPLETE.json .* differs"):
        check_checkpoint(job.replace(checkpoint_digest="0" * 64), [root])
    data = bytearray((ckpt / "model.safetensors").read_bytes())
    data[-1] ^= 0xFF
    (ckpt / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(JobError, match="digest mismatch"):
        check_checkpoint(job, [root], verify_digest=True)
    (ckpt / "COMPLETE.json").unlink()
    with pytest.raises(JobError, match="COMPLETE.json"):
        check_checkpoint(job, [root])
    with pytest.raises(JobError, match="does not exist"):
        check_checkpoint(job.replace(checkpoint=str(root / "nope")), None)


def test_pin_and_unpin(tmp_path):
    ckpt = publish_random(tmp_path, "run-p", 1)
    from dflash_train.checkpoints.publication import is_pinned, pin_checkpoint, unpin_checkpoint

    assert pin_checkpoint(ckpt, "eval-run-p-1-abc") and is_pinned(ckpt)
    assert unpin_checkpoint(ckpt, "eval-run-p-1-abc") and not is_pinned(ckpt)
    assert unpin_checkpoint(ckpt, "eval-run-p-1-abc") is False  # gone already: not an error
    assert pin_checkpoint(tmp_path / "missing", "x") is False  # never raises for a checkpoint that is gone


def test_the_validated_job_is_frozen_and_its_json_is_the_payload_given(published):
    """Read by attribute, never edited in place; `to_json()` is the payload as given, defaults filled in:
    an int metric stays an int, a nested object keeps only its own keys."""
    payload = {**_job(published[1]).to_json(), "train_metrics": {"loss": 2, "lr": 0.5},
               "wandb": {"project": "p"}}
    for key in ("target", "baseline", "mlflow", "sinks", "options"):
        payload.pop(key)
    job = validate_job(payload)
    with pytest.raises(ValueError, match="frozen"):
        job.step = 5  # type: ignore[misc]
    assert json.dumps(job.to_json(), sort_keys=True) == json.dumps(
        {**payload, "target": None, "baseline": None, "mlflow": None, "sinks": None, "options": None},
        sort_keys=True)
    assert job.replace(attempt=2).attempt == 2 and job.attempt == 0
    with pytest.raises(JobError, match="attempt must be"):
        job.replace(attempt=-1)  # a changed copy is validated again
