"""Checkpoints as outside users have them (sharded safetensors, half precision, wrapper prefixes,
`pytorch_model.bin`, Hugging Face cache symlinks): each is read to the same drafter as the plain
z-lab directory of the same weights, or refused with one sentence naming what is wrong."""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from dflash_train.checkpoints.checkpoint import load_drafter, save_drafter
from dflash_train.checkpoints.publication import CheckpointError
from tests.support.factories import drafter_for, qwen3_target

_TARGET = qwen3_target(layers=6, hidden=32)
_DRAFTER = drafter_for(_TARGET, layers=2, features=2)
_S1, _S2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"


def _release(tmp_path: Path, name: str = "release") -> Path:
    save_drafter(_DRAFTER, tmp_path / name)
    return tmp_path / name


def _shard(directory: Path, shards: dict[str, dict[str, torch.Tensor]], weight_map: dict[str, str]) -> None:
    """`save_pretrained(max_shard_size=...)`'s layout: shards and the index naming each tensor's shard."""
    for shard, tensors in shards.items():
        save_file(tensors, str(directory / shard), metadata={"format": "pt"})
    (directory / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (directory / "model.safetensors").unlink()


def _halves(tensors: dict[str, torch.Tensor]) -> tuple[dict, dict, dict[str, str]]:
    names = sorted(tensors)
    a, b = {k: tensors[k] for k in names[::2]}, {k: tensors[k] for k in names[1::2]}
    return a, b, {**{k: _S1 for k in a}, **{k: _S2 for k in b}}


def test_sharded_tensor_saved_in_two_shards_is_refused_not_taken_from_the_last_read(tmp_path):
    """A tensor present in two shards (the index placing it in the first) loaded the second's copy
    silently: a plausible wrong τ (1.15 instead of 3.27 in the probe). Now refused, naming it."""
    d = _release(tmp_path)
    tensors = load_file(str(d / "model.safetensors"))
    a, b, wm = _halves(tensors)
    dup = sorted(a)[0]
    _shard(d, {_S1: a, _S2: {**b, dup: torch.zeros_like(a[dup])}}, wm)
    with pytest.raises(CheckpointError, match=rf"{_S2} holds 1 tensor\(s\) that .* does not place in it: \['{dup}'\]"):
        load_drafter(d)


def test_sharded_index_names_a_tensor_its_shard_lacks(tmp_path):
    d = _release(tmp_path)
    a, b, wm = _halves(load_file(str(d / "model.safetensors")))
    gone = sorted(b)[0]
    _shard(d, {_S1: a, _S2: {k: v for k, v in b.items() if k != gone}}, wm)
    with pytest.raises(CheckpointError, match=rf"places 1 tensor\(s\) in {_S2} that it does not hold: \['{gone}'\]"):
        load_drafter(d)


def test_sharded_index_naming_a_missing_shard(tmp_path):
    """The queue's check (`identify`) and the loader each name the shard the index lists and the directory lacks."""
    from eval_worker.engine.checkpoint_source import identify

    d = _release(tmp_path)
    a, b, wm = _halves(load_file(str(d / "model.safetensors")))
    _shard(d, {_S1: a, _S2: b}, wm)
    loaded = load_drafter(d)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in _DRAFTER.state_dict().items())
    os.unlink(d / _S2)
    with pytest.raises(CheckpointError, match=rf"shards \[.{_S2}.\] listed in model.safetensors.index.json"):
        identify(d)
    with pytest.raises(CheckpointError, match=f"cannot read weights .*{_S2}"):
        load_drafter(d)


def _with_weights(tmp_path: Path, name: str, tensors: dict[str, torch.Tensor]) -> Path:
    d = _release(tmp_path, name)
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    return d


@pytest.mark.parametrize("half", [torch.bfloat16, torch.float16])
def test_half_precision_drafter_computes_in_the_targets_dtype_like_its_fp32_copy(tmp_path, half):
    """Every real drafter ships bf16. It computed in its file's dtype, its fp32 copy (the same rounded
    weights) in fp32: two τ for one drafter. Both now compute in the target's dtype, as serving engines
    run a drafter, and the result names the stored and the computing dtype."""
    from eval_worker.engine.acceptance import Evaluator
    from eval_worker.engine.checkpoint_source import open_drafter
    from eval_worker.engine.suite import Prompt, Suite

    sd = load_file(str(_release(tmp_path) / "model.safetensors"))
    stored = _with_weights(tmp_path, "half", {k: v.to(half) for k, v in sd.items()})
    copy = _with_weights(tmp_path, "copy", {k: v.to(half).float() for k, v in sd.items()})
    (a, _), (b, _) = open_drafter(stored, _TARGET), open_drafter(copy, _TARGET)
    assert a.fc.weight.dtype == b.fc.weight.dtype == _TARGET.dtype == torch.float32
    assert all(torch.equal(a.state_dict()[k], v) for k, v in b.state_dict().items())
    name = str(half).removeprefix("torch.")
    assert (a.stored_dtype, b.stored_dtype) == (name, "float32")
    suite = Suite("s", "1", [Prompt("p", ids=(5, 17, 33, 2))], chat_template=False, max_new_tokens=8)
    res = Evaluator(_TARGET, tmp_path / "cache").evaluate(
        stored, suite, options={"measure_speed": False, "tree_budget": 0, "leak_probe_anchors": 0, "bootstrap": 10})
    assert res.settings["drafter_dtype"] == {"computed": "float32", "stored": name}
    said = [d for d in res.diagnostics if d.code == "DTYPE_MISMATCH"]
    assert said and f"stored as {name}" in said[0].message and "computed in float32" in said[0].message


class _Payload:
    def __reduce__(self):
        return (os.system, ("touch PWNED",))


def test_pytorch_model_bin_directory_is_converted_read_without_code(tmp_path, monkeypatch):
    """Older save_pretrained (and HF Trainer with save_safetensors=False) write `pytorch_model.bin`.
    It was refused as 'no drafter weights found (model.safetensors, training_state.pt, or a *.pt
    file)' though it holds one; now `import` converts it (torch.load weights_only=True), the queue's
    check names it and the command, and a pickle with code in it is refused with nothing run."""
    from dflash_train.checkpoints.publication import verify_checkpoint
    from dflash_train.checkpoints.training_state import import_checkpoint
    from eval_worker.engine.checkpoint_source import identify

    d = _release(tmp_path, "old-release")
    sd = load_file(str(d / "model.safetensors"))
    (d / "model.safetensors").unlink()
    torch.save({f"model.{k}": v for k, v in sd.items()}, d / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match=r"holds pytorch_model.bin weights, not model.safetensors: .*dflash-eval "
                                              r"import"):
        identify(d)
    record, created, facts = import_checkpoint(tmp_path / "root", "old", None, d)
    assert created and facts["kind"] == "pytorch_model_bin" and facts["step"] == 0
    m = verify_checkpoint(record, [tmp_path / "root"])
    assert m["imported_from"]["path"] == str(d) and m["imported_from"]["kind"] == "pytorch_model_bin"
    loaded = load_drafter(record)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in _DRAFTER.state_dict().items())
    # HF Trainer with save_safetensors=False: checkpoint-N/ holds the wrapper's pytorch_model.bin, no config.json
    ck = tmp_path / "hf-out" / "checkpoint-30"
    ck.mkdir(parents=True)
    torch.save({f"drafter.{k}": v for k, v in sd.items()}, ck / "pytorch_model.bin")
    (ck / "trainer_state.json").write_text(json.dumps({"global_step": 30}))
    with pytest.raises(CheckpointError, match="give it with --config"):
        import_checkpoint(tmp_path / "root", "hf", None, ck)
    record, _, facts = import_checkpoint(tmp_path / "root", "hf", None, ck, config=d / "config.json")
    assert facts["kind"] == "pytorch_model_bin" and facts["step"] == 30
    assert all(torch.equal(load_drafter(record).state_dict()[k], v) for k, v in _DRAFTER.state_dict().items())
    monkeypatch.chdir(tmp_path)
    torch.save({**sd, "config": _Payload()}, d / "pytorch_model.bin")
    with pytest.raises(CheckpointError, match="refused: reading it would run code"):
        import_checkpoint(tmp_path / "root", "evil", None, d)
    assert not (tmp_path / "PWNED").exists()


def test_safetensors_and_pytorch_model_bin_both_present_safetensors_wins(tmp_path):
    """As transformers' from_pretrained: model.safetensors is read (and digested); a different
    pytorch_model.bin beside it is never read, by the loader, the queue's check or import."""
    from dflash_train.checkpoints.publication import sha256_file
    from dflash_train.checkpoints.training_state import import_checkpoint
    from eval_worker.engine.checkpoint_source import identify

    d = _release(tmp_path)
    torch.save({k: torch.zeros_like(v) for k, v in _DRAFTER.state_dict().items()}, d / "pytorch_model.bin")
    loaded = load_drafter(d)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in _DRAFTER.state_dict().items())
    assert identify(d).digest == sha256_file(d / "model.safetensors")
    record, _, facts = import_checkpoint(tmp_path / "root", "both", None, d)
    assert facts["kind"] == "drafter_dir" and identify(record).digest == sha256_file(d / "model.safetensors")


def test_hub_cache_snapshot_of_symlinks_loads_and_digests_the_blob_bytes(tmp_path):
    """A Hugging Face cache snapshot: config.json and the weights are relative symlinks into
    ../../blobs. It loads, and its digest is the sha256 of the blob's bytes (not of the link)."""
    from eval_worker.engine.checkpoint_source import identify

    repo = tmp_path / "hub" / "models--org--drafter"
    src = _release(tmp_path, "src")
    snap, blobs = repo / "snapshots" / "0123abcd", repo / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    for name in ("config.json", "model.safetensors"):
        blob = blobs / f"{name}-blob"
        os.rename(src / name, blob)
        (snap / name).symlink_to(os.path.relpath(blob, snap))
    loaded = load_drafter(snap)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in _DRAFTER.state_dict().items())
    blob_bytes = (blobs / "model.safetensors-blob").read_bytes()
    assert identify(snap).digest == hashlib.sha256(blob_bytes).hexdigest()


def test_hand_written_loop_prefixes_load_and_missing_or_extra_tensors_are_named(tmp_path):
    """What hand-written loops save: DDP's `module.` around torch.compile's `_orig_mod.` around a
    `model.` wrapper loads as the plain drafter; a missing tensor is refused by name and count (never
    initialised at random), optimizer moments saved beside the weights are named as unknown."""
    d = _release(tmp_path)
    sd = load_file(str(d / "model.safetensors"))
    save_file({f"module._orig_mod.model.{k}": v for k, v in sd.items()}, str(d / "model.safetensors"))
    loaded = load_drafter(d)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in _DRAFTER.state_dict().items())
    gone = sorted(k for k in sd if k.startswith("layers."))[:2]
    save_file({f"module.{k}": v for k, v in sd.items() if k not in gone}, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match=rf"2 missing tensor\(s\) \['{gone[0]}', '{gone[1]}'\] \(never init"):
        load_drafter(d)
    moments = {f"optimizer.state.{k}.exp_avg": torch.zeros_like(v) for k, v in list(sd.items())[:2]}
    save_file({**sd, **moments}, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError, match="2 unknown tensor") as e:
        load_drafter(d)
    assert all(repr(k) in str(e.value) for k in moments)


@pytest.mark.slow  # ~15-30 s: a real redis-server and `dflash-eval worker` on the bundled tiny target
def test_sharded_bf16_hub_snapshot_and_its_fp32_copy_same_tau_through_a_real_worker(tmp_path, redis_url, capsys):
    """What a drafter on the Hub is: bf16, sharded by save_pretrained(max_shard_size=...), read from
    the cache as symlinks into blobs/. Queued with `enqueue --external` beside the fp32 single-file
    copy of the same rounded weights, a real worker gives both the same τ, prompt by prompt; the
    record's digest is of the shards' bytes."""
    from dflash_train.checkpoints.publication import read_manifest, weights_digest
    from eval_worker.cli import main as cli
    from eval_worker.redis_client import connect
    from eval_worker.results.ledger import Ledger
    from eval_worker.service.queueing.queue import fetch_job
    from tests.integration.test_sidecar_worker import _target
    from tests.support.sidecar_support import (
        WorkerProcess,
        enqueue_args,
        publish_random,
        tiny_target_drafter_config,
        wait_for,
        write_suite,
    )

    target = _target()
    cfg, mask = tiny_target_drafter_config(target)
    root, hub = tmp_path / "ckpts", tmp_path / "hub"
    mine = publish_random(root, "mine", 1, target_config=cfg, mask_token_id=mask, seed=3)
    half = {k: v.bfloat16() for k, v in load_file(str(mine / "model.safetensors")).items()}
    repo = hub / "models--org--tiny-dflash"
    snap, blobs = repo / "snapshots" / "feedbeef00", repo / "blobs"
    snap.mkdir(parents=True)
    blobs.mkdir()
    a, b, wm = _halves(half)
    files = {_S1: a, _S2: b}
    for name in (_S1, _S2, "config.json", "model.safetensors.index.json"):
        blob = blobs / f"blob-{name}"
        if name in files:
            save_file(files[name], str(blob), metadata={"format": "pt"})
        elif name == "config.json":
            blob.write_bytes((mine / "config.json").read_bytes())
        else:
            blob.write_text(json.dumps({"metadata": {}, "weight_map": wm}))
        (snap / name).symlink_to(os.path.relpath(blob, snap))
    full = hub / "fp32-copy"
    full.mkdir()
    save_file({k: v.float() for k, v in half.items()}, str(full / "model.safetensors"), metadata={"format": "pt"})
    (full / "config.json").write_bytes((mine / "config.json").read_bytes())
    suite = write_suite(root / "suite.jsonl", n_prompts=2, max_new_tokens=12)
    conn = connect(redis_url)
    worker = WorkerProcess(tmp_path, redis_url, [root, hub], name="w-outside", target=target)
    try:
        common = enqueue_args(suite, target, redis_url, [root, hub])
        outcomes = {}
        for src in (snap, full):
            assert cli(["enqueue", "--external", str(src), *common]) == 0
            out = json.loads(capsys.readouterr().out)
            outcomes[src] = (out["imports"][0]["record"], out["outcomes"][0]["job_id"])
        for _record, job_id in outcomes.values():
            j = fetch_job(conn, job_id)
            wait_for(lambda j=j: j.get_status(refresh=True).value in ("finished", "failed"), 240, job_id)
            assert j.get_status().value == "finished", j.latest_result().exc_string
        record = outcomes[snap][0]
        assert read_manifest(record)["digest"] == weights_digest(
            {n: hashlib.sha256((blobs / f"blob-{n}").read_bytes()).hexdigest() for n in (_S1, _S2)})
        ledger = Ledger(tmp_path / "results")
        got = {e["result"]["checkpoint"]["source"]: e["result"] for run in ("org--tiny-dflash-feedbeef", "fp32-copy")
               for e in (x.read() for x in ledger.entries(run))}
        sharded, copy = got[str(snap)], got[str(full)]
        assert sharded["settings"]["drafter_dtype"] == {"computed": "float32", "stored": "bfloat16"}
        assert copy["settings"]["drafter_dtype"] == {"computed": "float32", "stored": "float32"}
        assert sharded["tau"] == copy["tau"]
        assert [p["accept_lengths"] for p in sharded["prompts"]] == [p["accept_lengths"] for p in copy["prompts"]]
    finally:
        worker.stop()
        conn.close()
