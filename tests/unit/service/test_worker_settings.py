"""WorkerSettings is read off Settings field by field (no hand-kept copy list to drift)."""
from __future__ import annotations

import dataclasses
from pathlib import Path

from dflash_train.common.settings import Settings
from eval_worker.service.worker.evaluators import WorkerSettings


def test_worker_settings_reads_every_field_from_settings(tmp_path):
    base = Settings.from_env({"DFLASH_HOME": str(tmp_path)})
    names = {f.name for f in dataclasses.fields(Settings)}
    distinct = {"results_dir": tmp_path / "r", "checkpoint_roots": (tmp_path / "c",), "cache_dir": tmp_path / "k",
                "target_roots": (tmp_path / "t",), "suite_roots": (tmp_path / "s",), "target": "/models/t",
                "device": "cpu:3", "evaluator_factory": "m:f", "spool_dir": tmp_path / "sp",
                "checkpoint_cache_dir": tmp_path / "cc", "checkpoint_cache_gb": 7.5}
    settings = dataclasses.replace(base, **distinct)
    ws = WorkerSettings.from_settings(settings)
    for f in dataclasses.fields(WorkerSettings):
        if f.name in WorkerSettings.WORKER_ONLY:
            continue
        source = WorkerSettings.SETTINGS_NAME.get(f.name, f.name)
        assert source in names, f"WorkerSettings.{f.name} has no Settings field {source!r}: name it WORKER_ONLY"
        assert getattr(ws, f.name) == distinct[source], f.name
    assert ws.env is settings and ws.max_targets == 1


def test_worker_settings_flags_override_and_none_keeps_the_environment(tmp_path):
    settings = Settings.from_env({"DFLASH_HOME": str(tmp_path), "DFLASH_CHECKPOINT_ROOTS": str(tmp_path / "c")})
    ws = WorkerSettings.from_settings(settings, device="cuda:1", roots=None, max_targets=3)
    assert ws.device == "cuda:1" and ws.max_targets == 3
    assert [Path(r) for r in ws.roots or ()] == [tmp_path / "c"]
