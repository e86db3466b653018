"""Open the drafter to evaluate: a published checkpoint (with COMPLETE.json) or a plain drafter directory.

Published checkpoints are digest-verified against their manifest (unless the caller has
just verified them: the worker hashes a job's files once), import records included (their
files are read from the recorded `source`); a plain directory (config.json +
model.safetensors, e.g. a z-lab release) gets the digest of its weights
(`publication.weights_digest`). A half-written publication is refused, never evaluated.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import torch

from dflash_train.checkpoints.checkpoint import check_own_vocab, load_drafter
from dflash_train.checkpoints.publication import (
    MARKER_NAME,
    CheckpointError,
    checkpoint_step,
    drafter_files,
    files_dir,
    sha256_file,
    verify_checkpoint,
    weights_digest,
)
from dflash_train.core.config import ConfigError, DrafterConfig
from dflash_train.core.model import DFlashDrafter
from dflash_train.core.target import Target

log = logging.getLogger(__name__)


@dataclass
class CheckpointInfo:
    path: str
    digest: str
    run_id: str | None = None
    step: int | None = None
    published: bool = False
    train_metrics: dict = field(default_factory=dict)
    source: str | None = None  # an import record's drafter directory (where the files are read)

    @property
    def files_dir(self) -> str:
        return self.source or self.path

    def to_dict(self) -> dict:
        return {"path": self.path, "digest": self.digest, "run_id": self.run_id, "step": self.step,
                **({"source": self.source} if self.source else {})}


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
        source = str(files_dir(p, m)) if m.get("source") else None
        return CheckpointInfo(str(p), m["digest"], m.get("run_id"), m.get("step"), True,
                              dict(m.get("train_metrics") or {}), source)
    if checkpoint_step(p) is not None:
        raise CheckpointError(f"{p} is a step directory without {MARKER_NAME}: a partial or abandoned publication")
    names = drafter_files(p)
    return CheckpointInfo(str(p), weights_digest({n: sha256_file(p / n) for n in names if n.endswith(".safetensors")}))


def open_drafter(path: str | Path, target: Target, dtype: torch.dtype | None = None,
                 verified: dict | None = None, sliding_rule: str = "serving") -> tuple[DFlashDrafter, CheckpointInfo]:
    """Identify, load (names/shapes checked) and fit-check a drafter against the target; it computes
    in `dtype`, by default the target's (`drafter.stored_dtype` names what the file holds).
    `sliding_rule` drafts sliding layers whose causality the config leaves implicit
    (`config.SLIDING_RULES`); a warning names it."""
    info = identify(path, verified)
    # computed in the target's dtype unless told otherwise, as serving engines run a drafter: the same
    # weights stored as bf16 or as their fp32 copy then draft identically (the stored dtype is named)
    drafter = load_drafter(info.files_dir, device=target.device, dtype=dtype or target.dtype).eval()
    drafter.config.bind_target(target.num_layers)  # a published config may leave depth and layer ids to the target
    try:
        drafter.config.resolve_mask_token(target.tokenizer)
    except ConfigError as e:
        raise CheckpointError(f"{info.files_dir}: {e}") from None
    target.check_drafter(drafter.config)
    check_own_vocab(drafter, target, info.files_dir)
    drafter.config.sliding_rule = sliding_rule
    if drafter.config.sliding_implicit:
        log.warning("%s: sliding-window layers with no causal flag in config.json; engines disagree on them, "
                    "drafted by the rule %s", info.files_dir, drafter.config.attention_rule())
    return drafter, info


def check_drafter_config(path: str | Path) -> DrafterConfig:
    """Identify a drafter directory and validate its config.json completely, before any
    target is loaded (a target load takes minutes; a bad drafter should not wait for it)."""
    info = identify(path)
    try:
        return DrafterConfig.load(info.files_dir)
    except ConfigError as e:
        raise CheckpointError(f"{info.files_dir}: {e}") from None
