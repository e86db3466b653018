"""Building a job: a published checkpoint (run, step, digest read from its marker) and what to
evaluate it on, spelled canonically (one spelling, one job id), validated."""
from __future__ import annotations

import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dflash_train.checkpoints import storage
from dflash_train.checkpoints.location import CheckpointRef
from dflash_train.checkpoints.publication import CheckpointError
from eval_worker.engine.suite import HF_PREFIX, SuiteError, parse_hf_spec
from eval_worker.service.jobs.checkpoints import check_location
from eval_worker.service.jobs.ids import canonical_target
from eval_worker.service.jobs.schema import SCHEMA, JobError, JobPayload, validate_job


def _canonical(location: str | os.PathLike | CheckpointRef) -> CheckpointRef:
    """The ref a job names: a store URL in canonical form, or an absolute local path (CheckpointRef.canonical);
    a Hub branch or tag becomes its commit: the job means fixed bytes."""
    try:
        ref = CheckpointRef.parse(location)
        if ref.kind == "hub":
            from dflash_train.checkpoints import hub

            return CheckpointRef.parse(hub.resolve(ref.text))
        return ref.as_canonical()
    except (storage.StoreError, CheckpointError) as e:
        raise JobError(str(e)) from None


def make_job(checkpoint: str | os.PathLike | CheckpointRef, *, suite: str, target: str | os.PathLike | None = None,
             baseline: str | os.PathLike | None = None, wandb: dict[str, Any] | None = None,
             sinks: Sequence[str] | None = None, mlflow: dict[str, Any] | None = None,
             requested_by: str = "user", priority: str = "default", options: dict[str, Any] | None = None,
             manifest: dict[str, Any] | None = None, roots: Sequence[Path | str] | None = None) -> JobPayload:
    """A validated job for a published checkpoint directory (run, step, digest from its marker)."""
    ref = _canonical(checkpoint)
    parsed_roots = CheckpointRef.parse_all(roots) if roots is not None else None  # once for both checkpoints
    if manifest is None:
        _, manifest = check_location(ref, parsed_roots, False, "checkpoint")
    base_ref = _canonical(baseline) if baseline else None  # once: a Hub ref is resolved by a Hub call
    if base_ref is not None:  # refused here, not an hour later on the worker
        check_location(base_ref, parsed_roots, False, "baseline")
    checkpoint, baseline = ref.text, (base_ref.text if base_ref is not None else None)
    run_id, step, digest = manifest["run_id"], manifest["step"], manifest["digest"]
    metrics = manifest.get("train_metrics") or None
    if not isinstance(metrics, dict):
        metrics = None
    if metrics:
        metrics = {k: v for k, v in metrics.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
    if suite.startswith(HF_PREFIX):  # one spelling per request: one job id
        try:
            suite = parse_hf_spec(suite).canonical
        except SuiteError as e:
            raise JobError(str(e)) from None
    elif not suite.startswith("builtin:") and (suite.endswith(".jsonl") or "/" in suite or os.path.exists(suite)):
        suite = os.path.abspath(suite)  # a suite file: the worker runs elsewhere (another cwd, another box)
    payload = {
        "schema": SCHEMA, "run_id": run_id, "step": int(step), "checkpoint": checkpoint,
        "checkpoint_digest": digest, "target": canonical_target(target) if target else None,
        "suite": suite, "baseline": baseline,
        "wandb": wandb, "requested_by": requested_by,
        **({"sinks": list(sinks)} if sinks is not None else {}), **({"mlflow": mlflow} if mlflow else {}),
        "priority": priority, "attempt": 0,
        "train_metrics": metrics or None, "options": options or None,
    }
    return validate_job(payload)
