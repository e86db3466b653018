"""Drafters from elsewhere: other trainers' key layouts, import records of read-only directories,
and their evaluation through the real queue (redis-server + `dflash-eval worker`) into the ledger."""
from __future__ import annotations

import hashlib
import json
import os
import stat
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from dflash_train.checkpoints.checkpoint import KNOWN_PREFIXES, load_drafter, save_drafter
from dflash_train.checkpoints.publication import (
    MARKER_NAME,
    CheckpointError,
    import_directory,
    import_name,
    read_manifest,
    verify_checkpoint,
)
from eval_worker.cli import main as cli
from eval_worker.redis_client import connect
from eval_worker.results.ledger import Ledger
from eval_worker.service.jobs.builder import make_job
from eval_worker.service.jobs.schema import JobError
from eval_worker.service.queueing.queue import fetch_job
from tests.integration.test_sidecar_worker import _target
from tests.support.factories import drafter_for, qwen3_target
from tests.support.sidecar_support import (
    WorkerProcess,
    enqueue_args,
    publish_random,
    tiny_target_drafter_config,
    wait_for,
    write_suite,
)

_DRAFTER = drafter_for(qwen3_target(layers=6, hidden=32), layers=2, features=2)


def _relayout(tensors: dict, prefix: str, fuse_qkv: bool, fuse_gate_up: bool, inv_freq: bool) -> dict:
    """The drafter's tensors as another trainer would save them."""
    out = {}
    for layer in sorted({k.split(".")[1] for k in tensors if k.startswith("layers.")}):
        base = f"layers.{layer}."
        if fuse_qkv:
            out[base + "self_attn.qkv_proj.weight"] = torch.cat(
                [tensors.pop(base + f"self_attn.{p}_proj.weight") for p in "qkv"])
        if fuse_gate_up:
            out[base + "mlp.gate_up_proj.weight"] = torch.cat(
                [tensors.pop(base + f"mlp.{p}_proj.weight") for p in ("gate", "up")])
    out.update(tensors)
    if inv_freq:
        out["rotary_emb.inv_freq"] = torch.ones(4)
    return {prefix + k: v.contiguous() for k, v in out.items()}


def _tree(path: Path) -> dict:
    """Everything observable about a directory tree: names, modes, sizes, mtimes, contents."""
    out = {}
    for p in sorted(path.rglob("*")):
        st_ = p.lstat()
        out[str(p.relative_to(path))] = (st_.st_mode, st_.st_size, st_.st_mtime_ns,
                                         hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else None)
    return out


def _read_only(path: Path) -> None:
    for p in [path, *path.rglob("*")]:
        p.chmod(p.stat().st_mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH))


@settings(max_examples=12, deadline=None)
@given(prefix=st.lists(st.sampled_from(KNOWN_PREFIXES), max_size=3).map("".join),
       fuse_qkv=st.booleans(), fuse_gate_up=st.booleans(), inv_freq=st.booleans())
def test_other_trainers_layouts_load_equal_to_ours(tmp_path_factory, prefix, fuse_qkv, fuse_gate_up, inv_freq):
    d = tmp_path_factory.mktemp("layout")
    save_drafter(_DRAFTER, d)
    theirs = _relayout(load_file(str(d / "model.safetensors")), prefix, fuse_qkv, fuse_gate_up, inv_freq)
    save_file(theirs, str(d / "model.safetensors"))
    loaded = load_drafter(d)
    ours = _DRAFTER.state_dict()
    assert loaded.state_dict().keys() == ours.keys()
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in ours.items())


def test_unknown_keys_are_named_every_one(tmp_path):
    save_drafter(_DRAFTER, tmp_path)
    tensors = _relayout(load_file(str(tmp_path / "model.safetensors")), "draft_model.", True, False, False)
    extra = {"lm_head.weight": torch.ones(3, 3), "draft_model.markov_head.weight": torch.ones(2),
             **{f"draft_model.aux.{i}.weight": torch.ones(1) for i in range(7)}}
    save_file({**tensors, **extra}, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match="9 unknown tensor") as e:
        load_drafter(tmp_path)
    for name in extra:  # every one by its name in the file, not just the first few
        assert repr(name) in str(e.value)
    # a fused weight of the wrong size says what config.json implies
    tensors["draft_model.layers.0.self_attn.qkv_proj.weight"] = torch.ones(5, 32)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(CheckpointError, match=r"qkv_proj.*\(5, 32\).*64 rows"):
        load_drafter(tmp_path)


def test_import_records_a_read_only_directory_without_touching_it(tmp_path):
    src = tmp_path / "hub" / "zlab-drafter"
    save_drafter(_DRAFTER, src)
    (src / "README.md").write_text("a release\n")
    _read_only(src)
    before = _tree(src)
    record, created = import_directory(tmp_path / "ckpts", "zlab", 0, src)
    assert created and sorted(os.listdir(record)) == [MARKER_NAME]  # the record alone, in our area
    m = verify_checkpoint(record, [tmp_path])  # hashes the source's files, confined to the roots
    assert m["source"] == str(src) and set(m["files"]) == {"config.json", "model.safetensors"}
    assert m["digest"] == hashlib.sha256((src / "model.safetensors").read_bytes()).hexdigest()
    assert import_directory(tmp_path / "ckpts", "zlab", 0, src) == (record, False)  # again: the same record
    assert _tree(src) == before  # not a byte, mode or mtime changed in the source
    other = tmp_path / "hub" / "other"
    save_drafter(drafter_for(qwen3_target(layers=6, hidden=32), layers=1, features=2, seed=5), other)
    with pytest.raises(CheckpointError, match="already records"):
        import_directory(tmp_path / "ckpts", "zlab", 0, other)
    # the source's files confine like a checkpoint's: a worker whose roots lack them refuses the record
    with pytest.raises(CheckpointError, match="outside the checkpoint roots"):
        verify_checkpoint(record, [tmp_path / "ckpts"])
    with pytest.raises(JobError, match="records the drafter at"):
        make_job(record, suite="builtin:coding-v1", roots=[tmp_path / "ckpts"])
    # a marker-less directory is refused by enqueue with the way out named
    with pytest.raises(JobError, match="dflash-eval import"):
        make_job(src, suite="builtin:coding-v1", roots=[tmp_path])
    with pytest.raises(JobError, match="baseline.*dflash-eval import"):
        make_job(record, suite="builtin:coding-v1", roots=[tmp_path], baseline=src)
    # the source changed after the import: the digest check says so
    for p in [src, *src.iterdir()]:
        p.chmod(0o755 if p.is_dir() else 0o644)
    save_drafter(drafter_for(qwen3_target(layers=6, hidden=32), layers=2, features=2, seed=9), src)
    with pytest.raises(CheckpointError, match="digest mismatch"):
        verify_checkpoint(record)


def test_import_names_from_the_usual_layouts(tmp_path):
    assert import_name("/c/hub/models--z-lab--Qwen3-8B-DFlash-b16/snapshots/0123456789abcdef") == (
        "z-lab--Qwen3-8B-DFlash-b16-01234567", 0)
    assert import_name("/out/qwen3-8b-dflash/epoch_0_step_1000") == ("qwen3-8b-dflash", 1000)
    assert import_name("/out/hf-run/checkpoint-500") == ("hf-run", 500)
    assert import_name("/models/Qwen3-4B-DFlash-b16") == ("Qwen3-4B-DFlash-b16", 0)
    # a Hugging Face cache snapshot: files are symlinks into ../../blobs, which lie in the same root
    repo = tmp_path / "hub" / "models--z-lab--tiny"
    snap = repo / "snapshots" / "abcdef0123"
    save_drafter(_DRAFTER, repo / "blobs-src")
    (repo / "blobs").mkdir()
    snap.mkdir(parents=True)
    for name in ("config.json", "model.safetensors"):
        blob = repo / "blobs" / hashlib.sha256(name.encode()).hexdigest()
        os.rename(repo / "blobs-src" / name, blob)
        (snap / name).symlink_to(os.path.relpath(blob, snap))
    record, _ = import_directory(tmp_path / "ckpts", *import_name(snap), snap)
    assert record.parent.name == "z-lab--tiny-abcdef01"
    verify_checkpoint(record, [tmp_path / "ckpts", tmp_path / "hub"])
    with pytest.raises(CheckpointError, match="outside the checkpoint roots"):
        verify_checkpoint(record, [tmp_path / "ckpts", snap])  # the blobs lie outside the snapshot


@pytest.mark.slow  # ~10-25 s: CI's slow pass (the default suite stays under 10 min on 2 cores)
def test_external_drafter_queued_evaluated_and_used_as_baseline(tmp_path, redis_url, capsys):
    """A marker-less, read-only drafter directory with SpecForge-style keys, queued with
    `enqueue --external` (alone, and as the baseline of a published checkpoint), evaluated by
    a real worker, lands in the ledger; its directory is never written."""
    target = _target()
    cfg, mask = tiny_target_drafter_config(target)
    root, hub = tmp_path / "ckpts", tmp_path / "hub"
    mine = publish_random(root, "mine", 20, target_config=cfg, mask_token_id=mask, seed=2)
    src = hub / "specforge-out" / "epoch_0_step_300"
    src.mkdir(parents=True)
    ours = load_file(str(mine / "model.safetensors"))
    save_file({"draft_model." + k: v for k, v in ours.items()}, str(src / "model.safetensors"))
    (src / "config.json").write_bytes((mine / "config.json").read_bytes())
    _read_only(hub)
    before = _tree(hub)
    suite = write_suite(root / "suite.jsonl", n_prompts=2, max_new_tokens=12)
    conn = connect(redis_url)
    worker = WorkerProcess(tmp_path, redis_url, [root, hub], name="w-ext", target=target)
    try:
        common = enqueue_args(suite, target, redis_url, [root, hub])
        assert cli(["enqueue", "--external", str(src), *common]) == 0
        alone = json.loads(capsys.readouterr().out)
        assert cli(["enqueue", "--external", str(mine), "--baseline", str(src), *common]) == 0
        compared = json.loads(capsys.readouterr().out)
        record = Path(alone["imports"][0]["record"])
        assert record == root / "specforge-out" / "step-00000300"  # named after SpecForge's directory
        assert compared["imports"][0]["record"] == str(record) and not compared["imports"][0]["created"]
        for o in alone["outcomes"] + compared["outcomes"]:
            j = fetch_job(conn, o["job_id"])
            wait_for(lambda j=j: j.get_status(refresh=True).value in ("finished", "failed"), 240, o["job_id"])
            assert j.get_status().value == "finished", j.latest_result().exc_string
        ledger = Ledger(tmp_path / "results")
        [ext] = [e.read() for e in ledger.entries("specforge-out")]
        assert ext["step"] == 300 and ext["result"]["checkpoint"]["source"] == str(src)
        assert ext["checkpoint_digest"] == read_manifest(record)["digest"]
        [rec] = [e.read() for e in ledger.entries("mine")]
        base = rec["result"]["baseline"]
        assert base["digest"] == ext["checkpoint_digest"]
        # the same weights under another layout: the same drafter, so the same τ
        assert base["tau"] == pytest.approx(ext["result"]["tau"]["macro"])
        assert rec["result"]["tau"]["macro"] == pytest.approx(base["tau"])
        assert _tree(hub) == before
        capsys.readouterr()
        assert cli(["results", "--run", "specforge-out", "--run", "mine", "--results", str(tmp_path / "results")]) == 0
        table = capsys.readouterr().out.splitlines()
        [row] = [line for line in table if line.startswith("mine ")]
        assert f"{ext['result']['tau']['macro']:10.3f}" in row and " 0.000 " in row  # Δτ against itself
        assert f"baseline: {record}" in table
    finally:
        worker.stop()
        conn.close()


def _shard(directory: Path) -> None:
    """Rewrite a drafter directory as a sharded release: two shards and an index."""
    tensors = load_file(str(directory / "model.safetensors"))
    names = sorted(tensors)
    halves = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for shard, keys in halves.items():
        save_file({k: tensors[k] for k in keys}, str(directory / shard))
    (directory / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {}, "weight_map": {k: shard for shard, keys in halves.items() for k in keys}}))
    (directory / "model.safetensors").unlink()


@pytest.mark.parametrize("sharded", [False, True])
def test_one_digest_for_a_drafter_directory_whatever_reads_it(tmp_path, sharded):
    """`run` on the plain directory, its import record and the worker's check agree on the digest."""
    from eval_worker.engine.checkpoint_source import identify

    src = tmp_path / "release"
    save_drafter(_DRAFTER, src)
    if sharded:
        _shard(src)
    record, _ = import_directory(tmp_path / "ckpts", "rel", 0, src)
    m = verify_checkpoint(record, [tmp_path])
    assert identify(src).digest == m["digest"] == identify(record).digest
    assert identify(record).source == str(src)
    assert ("model.safetensors.index.json" in m["files"]) == sharded
    loaded = load_drafter(src)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in _DRAFTER.state_dict().items())
    if sharded:  # a shard changed after the import is caught like any file
        shard = src / "model-00002-of-00002.safetensors"
        save_file({k: v + 1 for k, v in load_file(str(shard)).items()}, str(shard))
        with pytest.raises(CheckpointError, match="model-00002-of-00002.safetensors digest mismatch"):
            verify_checkpoint(record)


def test_an_import_record_uploads_as_a_self_contained_checkpoint(tmp_path, s3_server):
    """In a store the record's files lie beside its marker: uploaded from the source, `source` dropped."""
    import uuid

    from dflash_train.checkpoints.publication import upload_checkpoint
    from eval_worker.service.worker.checkpoint_cache import CheckpointCache

    bucket = f"b-{uuid.uuid4().hex[:12]}"
    s3_server.make_bucket(bucket)
    src = tmp_path / "release"
    save_drafter(_DRAFTER, src)
    _read_only(src)
    record, _ = import_directory(tmp_path / "ckpts", "rel", 0, src)
    url = upload_checkpoint(record, f"s3://{bucket}/runs/rel")
    remote = read_manifest(url)
    assert "source" not in remote and remote["files"] == read_manifest(record)["files"]
    with CheckpointCache(tmp_path / "cache").checkout(url) as (local, manifest):  # verified file by file
        assert manifest["digest"] == read_manifest(record)["digest"]
        assert all(torch.equal(load_drafter(local).state_dict()[k], v) for k, v in _DRAFTER.state_dict().items())


def test_import_command_names_records_and_refuses_what_a_worker_would(tmp_path, capsys):
    from dflash_train.common.settings import Settings

    settings = Settings.from_env().replace(checkpoint_roots=(tmp_path / "ckpts", tmp_path / "hub"))
    src = tmp_path / "hub" / "qwen3-dflash" / "epoch_1_step_700"
    save_drafter(_DRAFTER, src)
    assert cli(["import", str(src)], settings=settings) == 0
    out = capsys.readouterr().out
    assert f"imported {tmp_path / 'ckpts' / 'qwen3-dflash' / 'step-00000700'}  <- {src}" in out
    assert cli(["import", str(src)], settings=settings) == 0
    assert capsys.readouterr().out.startswith("exists")
    elsewhere = tmp_path / "elsewhere"
    save_drafter(_DRAFTER, elsewhere)
    # outside the roots the worker could not read it in place: converted into the record root instead
    assert cli(["import", str(elsewhere), "--run", "x"], settings=settings) == 0
    assert "source" not in read_manifest(tmp_path / "ckpts" / "x" / "step-00000000")
    assert cli(["import", str(elsewhere), "--run", "y", "--into", str(tmp_path / "records")], settings=settings) == 2
    err = capsys.readouterr().err
    assert "record root --into" in err and "outside the checkpoint roots" in err
    assert not (tmp_path / "records").exists()
    no_roots = Settings.from_env().replace(checkpoint_roots=None)
    assert cli(["import", str(src)], settings=no_roots) == 2
    assert "give --into ROOT" in capsys.readouterr().err
