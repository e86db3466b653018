"""`hf://ORG/REPO[@REVISION]`: drafters on the Hugging Face Hub as read-only checkpoints.

No network here: huggingface_hub runs in offline mode over a Hugging Face cache laid out by
the test (models--ORG--REPO/refs, snapshots/<commit>/...), exactly what a past download leaves.
This covers the URL rules, revision -> commit resolution, the derived manifest, confinement to
Hub orgs, the worker's cache and an evaluation with a Hub drafter as baseline; the HTTP side is
huggingface_hub's own (tested by it). Select with `pytest -k object_store`.
"""
from __future__ import annotations

import json
import shutil

import pytest

from dflash_train.checkpoints import hub, storage
from dflash_train.checkpoints.publication import (
    CheckpointError,
    pin_checkpoint,
    read_manifest,
    read_marker,
    sha256_file,
    upload_checkpoint,
)
from eval_worker.service.jobs.builder import make_job
from eval_worker.service.jobs.checkpoints import check_checkpoint
from eval_worker.service.jobs.schema import JobError, validate_job
from eval_worker.service.worker.checkpoint_cache import CheckpointCache
from tests.integration.test_sidecar_worker import _target
from tests.support.sidecar_support import publish_random, tiny_target_drafter_config, write_suite

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An offline Hugging Face cache holding `org/drafter` at COMMIT (branch main) with a drafter that
    fits the bundled tiny target; returns the snapshot directory."""
    from huggingface_hub import constants

    cache = tmp_path / "hf-cache"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    cfg, mask = tiny_target_drafter_config(_target())
    src = publish_random(tmp_path / "published-elsewhere", "x", 1, target_config=cfg, mask_token_id=mask, seed=5)
    repo = cache / "models--org--drafter"
    snap = repo / "snapshots" / COMMIT
    snap.mkdir(parents=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copyfile(src / name, snap / name)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return snap


def test_object_store_hub_urls_resolve_to_a_commit(hub_cache):
    url = f"hf://org/drafter@{COMMIT}"
    assert hub.resolve("hf://org/drafter") == url and hub.resolve("hf://org/drafter@main") == url
    assert hub.parse(f"{url}/config.json") == ("org/drafter", COMMIT, "config.json")
    for bad in ("hf://org", "hf://org/drafter/x/y@main", "hf://org/../x"):
        with pytest.raises(storage.StoreError):
            hub.resolve(bad)
    with pytest.raises(storage.StoreUnavailable, match="not in the Hugging Face cache"):
        hub.resolve("hf://org/other-drafter")
    with pytest.raises(CheckpointError, match="must name a commit"):
        read_marker("hf://org/drafter@main")


def test_object_store_hub_manifest_is_derived_and_deterministic(hub_cache):
    url = f"hf://org/drafter@{COMMIT}"
    raw = read_marker(url)
    assert read_marker(url) == raw  # the cache key of the worker's copy
    m = read_manifest(url)
    assert m["digest"] == sha256_file(hub_cache / "model.safetensors")
    assert m["files"] == {n: sha256_file(hub_cache / n) for n in ("config.json", "model.safetensors")}
    assert (m["run_id"], m["step"], m["hub"]) == ("org--drafter-01234567", 0,
                                                  {"repo": "org/drafter", "revision": COMMIT})


def test_object_store_hub_is_read_only(hub_cache, tmp_path):
    url = f"hf://org/drafter@{COMMIT}"
    assert pin_checkpoint(url, "job-1") is False
    local = publish_random(tmp_path / "ck", "run1", 1)
    with pytest.raises(storage.StoreError, match="read-only"):
        upload_checkpoint(local, "hf://org/drafter")


def test_object_store_hub_jobs_confined_to_orgs_and_pulled_once(hub_cache, tmp_path):
    suite = write_suite(tmp_path / "suite.jsonl")
    job = make_job("hf://org/drafter@main", suite=str(suite), roots=["hf://org"])
    assert job.checkpoint == f"hf://org/drafter@{COMMIT}"  # the branch is pinned to its commit
    assert job.checkpoint_digest == sha256_file(hub_cache / "model.safetensors")
    with pytest.raises(JobError, match="outside the checkpoint prefixes"):
        check_checkpoint(job, ["hf://other-org", "s3://bucket/runs"])
    with pytest.raises(JobError, match="hf://ORG/REPO@<commit>"):  # a job made elsewhere, with a moving branch
        validate_job({**job.to_json(), "checkpoint": "hf://org/drafter@main"})
    cache = CheckpointCache(tmp_path / "cache")
    for _ in range(2):
        with cache.checkout(job.checkpoint) as (entry, manifest):
            assert all(sha256_file(entry / n) == d for n, d in manifest["files"].items())
    assert (cache.downloads, cache.hits) == (1, 1)
    # the cached Hub file changes under us (a bad disk, a tampered cache): caught by digest
    data = bytearray((hub_cache / "model.safetensors").read_bytes())
    data[-1] ^= 1
    raw = read_marker(job.checkpoint)
    (hub_cache / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="digest mismatch after download"):
        with CheckpointCache(tmp_path / "cache2", attempts=1).checkout(job.checkpoint, raw):
            pass


def test_object_store_hub_drafter_as_baseline_is_evaluated(hub_cache, tmp_path, worker_evaluators):
    """A published checkpoint compared with a Hub drafter, on the real engine: the baseline is
    pulled (read-only), evaluated, and recorded by its URL and digest."""
    from eval_worker.results.ledger import Ledger
    from eval_worker.service.worker.eval_job import run_eval_job
    from eval_worker.service.worker.evaluators import WorkerSettings

    target = _target()
    cfg, mask = tiny_target_drafter_config(target)
    root = tmp_path / "ckpts"
    ckpt = publish_random(root, "run-h", 10, target_config=cfg, mask_token_id=mask)
    suite = write_suite(root / "suite.jsonl", n_prompts=1, max_new_tokens=8)
    worker_evaluators(WorkerSettings(results_dir=tmp_path / "results", roots=[root, "hf://org"],
                                     cache_dir=tmp_path / "cache", default_target=str(target),
                                     checkpoint_cache_dir=tmp_path / "ckcache"))
    job = make_job(ckpt, suite=str(suite), baseline="hf://org/drafter", roots=[root, "hf://org"])
    r = run_eval_job(job.to_json())
    assert r["recorded_now"]
    record = Ledger(tmp_path / "results").entries("run-h")[0].read()
    base = record["result"]["baseline"]
    assert base["checkpoint"] == f"hf://org/drafter@{COMMIT}"
    assert base["digest"] == sha256_file(hub_cache / "model.safetensors")
    assert isinstance(base["tau"], float)
    assert json.dumps(record).count(str(hub_cache)) == 0  # the worker's paths are not what is recorded


def test_object_store_hub_drafter_evaluated_by_run(hub_cache, tmp_path, capsys):
    """`dflash-eval run --checkpoint hf://ORG/REPO`: pulled into the checkpoint cache, verified,
    evaluated; the result names the URL at its commit and the weights' digest."""
    from dflash_train.common.settings import Settings
    from eval_worker.cli import main as cli

    settings = Settings.from_env({"DFLASH_HOME": str(tmp_path / "home")})
    suite = write_suite(tmp_path / "suite.jsonl", n_prompts=1, max_new_tokens=8)
    out = tmp_path / "r.json"
    assert cli(["run", "--checkpoint", "hf://org/drafter", "--target", str(_target()), "--suite", str(suite),
                "--json", str(out), "--no-progress", "--tree-budget", "0"], settings=settings) in (0, 1)
    r = json.loads(out.read_text())
    assert r["checkpoint"]["path"] == f"hf://org/drafter@{COMMIT}"
    assert r["checkpoint"]["digest"] == sha256_file(hub_cache / "model.safetensors")
    assert len(list((tmp_path / "home" / "checkpoint-cache").glob("[0-9a-f]*"))) == 1
    assert f"hf://org/drafter@{COMMIT}" in capsys.readouterr().out
