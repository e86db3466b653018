"""Faults an outside user runs into, probed with real parts (docs/reliability.md, third round): a target
updated in place under a running worker, a Redis that loses its data (restart without persistence,
eviction on a shared server), a read-only DFLASH_HOME.

Real parts: the bundled tiny target and the real Evaluator, a real redis-server (tests/conftest.py or
a private one configured as the fault needs), real RQ workers, the real hook and ledger.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from eval_worker.service.eval_job import run_eval_job
from eval_worker.service.evaluators import WorkerSettings
from eval_worker.service.job_builder import make_job
from tests.support.sidecar_support import REPO_ROOT, publish_random, tiny_target_drafter_config

TINY_TARGET = REPO_ROOT / "dflash_train" / "assets" / "tiny_target"
OPTS = {"max_new_tokens": 8, "num_prompts": 1, "measure_speed": False}


def _record_target(out: dict) -> dict:
    record = json.loads(Path(out["ledger_path"]).read_text())
    return (record.get("result") or record)["target"]


# --------------------------------------------------------------------------- target replaced in place

def test_target_replaced_in_place_is_loaded_again(tmp_path, worker_evaluators, caplog):
    """A user updates the target's weights in place (same path) between two jobs of one worker. The
    second job must measure the new weights, not the copy the worker loaded before (on main: the
    stale copy, recorded under the same path as if it were the update)."""
    import logging

    import torch
    from safetensors.torch import load_file, save_file

    from dflash_train.core.target import Target

    target = tmp_path / "target"
    shutil.copytree(TINY_TARGET, target)
    cfg, mask = tiny_target_drafter_config(target)
    root = tmp_path / "ck"
    ckpt = publish_random(root, "run-tgt", 1, target_config=cfg, mask_token_id=mask, seed=1)
    evs = worker_evaluators(WorkerSettings(results_dir=tmp_path / "results", roots=[root],
                                           cache_dir=tmp_path / "cache", default_target=str(target)))
    job = make_job(ckpt, suite="builtin:coding-v1", target=str(target), options=OPTS).to_json()
    first = _record_target(run_eval_job(job))
    assert first["fingerprint"] == Target.load(target).fingerprint()

    # the update: other weights written beside, renamed over the old file (how a copy tool replaces it)
    weights = load_file(str(target / "model.safetensors"))
    gen = torch.Generator().manual_seed(0)
    weights = {k: v + 0.05 * torch.randn(v.shape, generator=gen, dtype=v.dtype) if v.is_floating_point() else v
               for k, v in weights.items()}
    save_file(weights, str(target / "model.new"))
    os.replace(target / "model.new", target / "model.safetensors")
    updated = Target.load(target).fingerprint()
    assert updated != first["fingerprint"]

    caplog.set_level(logging.WARNING, logger="eval_worker.service.evaluators")
    second = _record_target(run_eval_job({**job, "attempt": 1}))  # `enqueue --force`: a new attempt
    assert second["fingerprint"] == updated  # main: the first fingerprint (the stale copy's)
    assert evs.target_loads(str(target)) == 2
    assert any("changed on disk since it was loaded" in r.getMessage() for r in caplog.records)

    third = run_eval_job({**job, "attempt": 2})  # unchanged since: the loaded copy is kept
    assert _record_target(third)["fingerprint"] == updated and evs.target_loads(str(target)) == 2
