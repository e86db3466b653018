"""Checkpoint publication: atomic, marked, verified, pinned, retained, cleaned up."""
import json
import os
import threading
import time

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from dflash_train.checkpoints.checkpoint import AsyncPublisher, drafter_state_dict, load_drafter, publish_checkpoint
from dflash_train.checkpoints.publication import (
    MARKER_NAME,
    CheckpointError,
    apply_retention,
    cleanup_incomplete,
    is_pinned,
    list_checkpoints,
    pin_checkpoint,
    read_manifest,
    run_id_from,
    unpin_checkpoint,
    valid_run_id,
    verify_checkpoint,
)
from dflash_train.core.config import DrafterConfig
from dflash_train.core.model import DFlashDrafter
from tests.support.factories import drafter_for, qwen3_target


def _drafter(hidden=32, layers=1, seed=0):
    torch.manual_seed(seed)
    cfg = DrafterConfig(hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                        num_attention_heads=4,
                        num_key_value_heads=2, head_dim=hidden // 4, vocab_size=96, num_target_layers=6,
                        target_layer_ids=[1, 3], mask_token_id=95, block_size=8)
    return DFlashDrafter(cfg)


def test_publish_read_verify(tmp_path):
    d = _drafter()
    path = publish_checkpoint(d, tmp_path, "run1", 100, train_metrics={"loss": 1.5, "accuracy": 0.25})
    assert path == tmp_path / "run1" / "step-00000100"
    m = read_manifest(path)
    assert m["format"] == "dflash-checkpoint/1" and m["run_id"] == "run1" and m["step"] == 100
    assert m["train_metrics"] == {"loss": 1.5, "accuracy": 0.25}
    assert m["config"]["dflash_config"]["target_layer_ids"] == [1, 3]
    assert set(m["files"]) == {"model.safetensors", "config.json"} and m["digest"] == m["files"]["model.safetensors"]
    assert verify_checkpoint(path) == m
    loaded = load_drafter(path)
    for k, v in drafter_state_dict(d).items():
        assert torch.equal(loaded.state_dict()[k], v)
    assert sorted(p.name for p in (tmp_path / "run1").iterdir()) == ["step-00000100"]  # no temp left behind
    with pytest.raises(CheckpointError, match="already published"):
        publish_checkpoint(d, tmp_path, "run1", 100)


def test_verify_catches_corruption_and_bad_markers(tmp_path):
    path = publish_checkpoint(_drafter(), tmp_path, "r", 1)
    w = path / "model.safetensors"
    data = bytearray(w.read_bytes())
    data[-5] ^= 0xFF
    w.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="digest"):
        verify_checkpoint(path)
    m = json.loads((path / MARKER_NAME).read_text())
    m["digest"] = "0" * 64
    (path / MARKER_NAME).write_text(json.dumps(m))
    with pytest.raises(CheckpointError, match="digest differs"):
        read_manifest(path)
    (path / MARKER_NAME).write_text("{trunc")
    with pytest.raises(CheckpointError, match="unreadable"):
        read_manifest(path)
    (path / MARKER_NAME).unlink()
    with pytest.raises(CheckpointError, match="not a published checkpoint"):
        read_manifest(path)
    assert list_checkpoints(tmp_path / "r") == []


def test_a_reader_polling_during_saves_never_loads_a_partial_checkpoint(tmp_path):
    """Writers publish while a reader polls; whatever has a marker must verify and load fully."""
    d = _drafter(hidden=128, layers=2)
    run = tmp_path / "r"
    stop = threading.Event()
    seen = {"loaded": set(), "refused": 0, "polls": 0}
    failures = []

    def reader():
        while not stop.is_set():
            seen["polls"] += 1
            if not run.is_dir():
                continue
            for p in list(run.iterdir()):
                try:
                    read_manifest(p)
                except CheckpointError:
                    seen["refused"] += 1  # a temp dir or not yet marked: correctly not a checkpoint
                    continue
                try:
                    verify_checkpoint(p)
                    load_drafter(p)
                    seen["loaded"].add(p.name)
                except Exception as e:  # noqa: BLE001 - a marked checkpoint that does not load = a torn publication
                    failures.append(f"{p.name}: {e!r}")

    t = threading.Thread(target=reader)
    t.start()
    try:
        pub = AsyncPublisher(tmp_path, "r", max_pending=2)
        for step in range(1, 9):
            with torch.no_grad():
                for prm in d.parameters():
                    prm.add_(0.01)
            pub.submit(d, step)
        pub.close()
        deadline = time.time() + 60
        while len(seen["loaded"]) < 8 and time.time() < deadline and not failures:
            time.sleep(0.05)  # let the reader finish a full pass over the final state
    finally:
        stop.set()
        t.join()
    assert failures == []
    assert len(list_checkpoints(run)) == 8
    assert seen["loaded"] == {f"step-{s:08d}" for s in range(1, 9)}
    assert seen["polls"] > 8
    assert seen["refused"] > 0  # it did look while publications were in flight


def test_async_publisher_snapshots_on_submit_and_calls_back_after_the_marker(tmp_path):
    d = _drafter()
    before = {k: v.clone() for k, v in drafter_state_dict(d).items()}
    calls = []
    gate = threading.Event()

    def on_published(step, path, manifest):
        calls.append((step, (path / MARKER_NAME).is_file(), manifest["digest"], threading.current_thread().name))
        gate.set()

    pub = AsyncPublisher(tmp_path, "r", on_published=on_published)
    pub.submit(d, 5, train_metrics={"loss": 2.0})
    with torch.no_grad():  # training continues immediately and changes the weights
        for p in d.parameters():
            p.mul_(-3.0)
    pub.wait()
    assert gate.is_set()
    loaded = load_drafter(tmp_path / "r" / "step-00000005")
    for k, v in before.items():
        assert torch.equal(loaded.state_dict()[k], v), k
    assert calls[0][:2] == (5, True) and calls[0][3] == "checkpoint-publisher"
    pub.close()


def test_async_publisher_surfaces_failures(tmp_path):
    (tmp_path / "blocked").write_text("a file where the run directory should be")
    pub = AsyncPublisher(tmp_path / "blocked", "r")
    pub.submit(_drafter(), 1)
    with pytest.raises(CheckpointError, match="publication failed"):
        pub.wait()
    pub.close()


def test_retention_keeps_last_k_pinned_and_protected(tmp_path):
    d = _drafter()
    for s in range(1, 7):
        publish_checkpoint(d, tmp_path, "r", s)
    run = tmp_path / "r"
    pin_checkpoint(run / "step-00000001", "job-a")
    assert is_pinned(run / "step-00000001")
    removed = apply_retention(run, 2, protect=lambda p: p.name == "step-00000003")
    assert sorted(p.name for p in removed) == ["step-00000002", "step-00000004"]
    assert [p.name for p in list_checkpoints(run)] == ["step-00000001", "step-00000003", "step-00000005",
                                                       "step-00000006"]
    assert not (run / "step-00000002").exists()
    unpin_checkpoint(run / "step-00000001", "job-a")
    assert [p.name for p in apply_retention(run, 2)] == ["step-00000001", "step-00000003"]
    assert apply_retention(run, 0) == []
    with pytest.raises(CheckpointError):
        pin_checkpoint(run / "step-00000005", "../escape")


def test_cleanup_removes_half_written_publications_only(tmp_path):
    d = _drafter()
    run = tmp_path / "r"
    good = publish_checkpoint(d, tmp_path, "r", 2)
    dead_tmp = run / ".step-00000004.tmp-999999999"  # a pid that cannot exist
    dead_tmp.mkdir()
    (dead_tmp / "model.safetensors").write_bytes(b"half")
    live_tmp = run / f".step-00000006.tmp-{os.getppid()}"  # another live process may be writing it
    live_tmp.mkdir()
    unmarked = run / "step-00000003"  # renamed, marker never written (crash)
    unmarked.mkdir()
    (unmarked / "config.json").write_text("{}")
    assert list_checkpoints(run) == [good]
    removed = cleanup_incomplete(run)
    assert sorted(p.name for p in removed) == [".step-00000004.tmp-999999999", "step-00000003"]
    assert live_tmp.exists() and good.exists()
    assert publish_checkpoint(d, tmp_path, "r", 3) == unmarked  # the step can be published again


def test_bf16_publication_of_a_target_sized_drafter(tmp_path):
    target = qwen3_target()
    d = drafter_for(target)
    path = publish_checkpoint(d, tmp_path, "r", 7, dtype=torch.bfloat16)
    assert read_manifest(path)["config"]["torch_dtype"] == "bfloat16"
    assert load_drafter(path).fc.weight.dtype == torch.bfloat16
    target.check_drafter(load_drafter(path).config)


@given(st.one_of(st.text(max_size=140), st.from_regex(r"[A-Za-z0-9._ /-]{1,140}", fullmatch=True)))
def test_one_run_id_rule_for_trainer_jobs_and_ledger(text):
    """The trainer's config, the job schema and the ledger accept exactly the same run ids,
    and `run_id_from` turns any text into one of them."""
    from dflash_train.training.train_config import TrainConfig, TrainConfigError
    from eval_worker.results.ledger import Ledger, LedgerError
    from eval_worker.service.jobs.schema import JobError, validate_job

    ok = valid_run_id(text)
    try:
        TrainConfig(run_id=text)
        accepted = [True]
    except TrainConfigError:
        accepted = [False]
    job = {"schema": "dflash-eval-job/1", "run_id": text, "step": 1, "checkpoint": "/c", "checkpoint_digest": "0" * 64,
           "suite": "builtin:coding-v1"}
    try:
        validate_job(job)
        accepted.append(True)
    except JobError:
        accepted.append(False)
    try:
        Ledger("/nonexistent").step_dir(text, 1)
        accepted.append(True)
    except LedgerError:
        accepted.append(False)
    assert accepted == [ok, ok, ok]
    assert valid_run_id(run_id_from(text))


def test_an_invalid_run_id_is_refused_before_training(tmp_path):
    from dflash_train.training.train_config import TrainConfigError, load_config

    with pytest.raises(TrainConfigError, match="run_id 'exp 1' must be"):
        load_config(None, {"run_id": "exp 1", "checkpoint_root": str(tmp_path)})
