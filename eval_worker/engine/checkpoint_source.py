"""Open the drafter to evaluate: a published checkpoint (with COMPLETE.json) or a plain drafter directory.

Published checkpoints are digest-verified against their manifest (unless the caller has
just verified them: the worker hashes a job's files once); a plain directory (config.json +
model.safetensors, e.g. a z-lab release) gets the sha256 of its weights. A half-written
publication is refused, never evaluated.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dflash_train.checkpoint import load_drafter
from dflash_train.publication import (INDEX_NAME, MARKER_NAME, WEIGHTS_NAME, CheckpointError, checkpoint_step,
                                      sha256_file, verify_checkpoint)
from dflash_train.config import ConfigError, DrafterConfig
from dflash_train.model import DFlashDrafter
from dflash_train.target import Target


@dataclass
class CheckpointInfo:
    path: str
    digest: str
    run_id: str | None = None
    step: int | None = None
    published: bool = False
    train_metrics: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"path": self.path, "digest": self.digest, "run_id": self.run_id, "step": self.step}


def identify(path: str | Path, verified: dict | None = None) -> CheckpointInfo:
    """Digest and provenance of a drafter directory, refusing partial publications.

    `verified`: manifests the caller has just verified (`publication.verify_checkpoint`),
    keyed by real path; such a checkpoint is not hashed again.
    """
    p = Path(path).expanduser()
    if not p.exists():
        raise CheckpointError(f"checkpoint {p} does not exist")
    if not p.is_dir():
        raise CheckpointError(f"checkpoint {p} is not a directory")
    if p.name.startswith(".") and ".tmp-" in p.name:
        raise CheckpointError(f"{p} is a temporary publish directory (still being written or abandoned)")
    p = p.resolve()
    if (p / MARKER_NAME).exists():
        m = (verified or {}).get(str(p)) or verify_checkpoint(p)
        return CheckpointInfo(str(p), m["digest"], m.get("run_id"), m.get("step"), True, dict(m.get("train_metrics") or {}))
    if checkpoint_step(p) is not None:
        raise CheckpointError(f"{p} is a step directory without {MARKER_NAME}: a partial or abandoned publication")
    if (p / WEIGHTS_NAME).is_file():
        return CheckpointInfo(str(p), sha256_file(p / WEIGHTS_NAME))
    if (p / INDEX_NAME).is_file():  # sharded release: digest over the shard digests, in order
        try:
            shards = sorted(set(json.loads((p / INDEX_NAME).read_text())["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{p / INDEX_NAME}: unreadable ({e})") from None
        missing = [s for s in shards if not (p / s).is_file()]
        if missing:
            raise CheckpointError(f"{p}: shards {missing[:3]} listed in {INDEX_NAME} are missing")
        h = hashlib.sha256()
        for s in shards:
            h.update(f"{s}:{sha256_file(p / s)}\n".encode())
        return CheckpointInfo(str(p), h.hexdigest())
    missing = [n for n in ("config.json", WEIGHTS_NAME) if not (p / n).exists()]
    raise CheckpointError(f"{p} is not a drafter directory: missing {', '.join(missing) or WEIGHTS_NAME}")


def open_drafter(path: str | Path, target: Target, dtype: torch.dtype | None = None,
                 verified: dict | None = None) -> tuple[DFlashDrafter, CheckpointInfo]:
    """Identify, load (names/shapes checked) and fit-check a drafter against the target."""
    info = identify(path, verified)
    drafter = load_drafter(info.path, device=target.device, dtype=dtype).eval()
    drafter.config.bind_target(target.num_layers)  # a published config may leave depth and layer ids to the target
    target.check_drafter(drafter.config)
    return drafter, info


def check_drafter_config(path: str | Path) -> DrafterConfig:
    """Identify a drafter directory and validate its config.json completely, before any
    target is loaded (a target load takes minutes; a bad drafter should not wait for it)."""
    info = identify(path)
    try:
        return DrafterConfig.load(info.path)
    except ConfigError as e:
        raise CheckpointError(f"{info.path}: {e}") from None
