"""Drafter directories: `config.json` + `model.safetensors`, the published DFlash layout.

Loading never unpickles (safetensors only) and checks every tensor's name, shape and
dtype against the config before building anything, so a truncated or mismatched file
gives one clear error instead of a half-loaded model.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .config import ConfigError, DrafterConfig
from .model import DFlashDrafter

WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A drafter directory that cannot be loaded; the message says why."""


def drafter_state_dict(drafter: DFlashDrafter) -> dict[str, torch.Tensor]:
    """Unprefixed checkpoint tensors (buffers such as rotary tables are not saved)."""
    return {k: v.detach().contiguous() for k, v in drafter.state_dict().items() if "rotary_emb" not in k}


def save_drafter(drafter: DFlashDrafter, directory: str | Path, *, dtype: torch.dtype | None = None,
                 state: dict[str, torch.Tensor] | None = None) -> Path:
    """Write config.json and model.safetensors into `directory` (created if needed).

    `state` lets a caller save a CPU snapshot taken earlier (the async hook does).
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = state if state is not None else drafter_state_dict(drafter)
    if dtype is not None:
        tensors = {k: v.to(dtype) for k, v in tensors.items()}
    tensors = {k: v.cpu().contiguous() for k, v in tensors.items()}
    cfg = drafter.config
    cfg.torch_dtype = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
    save_file(tensors, str(directory / WEIGHTS_NAME), metadata={"format": "pt"})
    cfg.save(directory)
    return directory


def read_drafter_tensors(directory: str | Path) -> dict[str, torch.Tensor]:
    directory = Path(directory)
    single, index = directory / WEIGHTS_NAME, directory / INDEX_NAME
    try:
        if single.is_file():
            return load_file(str(single))
        if index.is_file():
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            tensors: dict[str, torch.Tensor] = {}
            for shard in shards:
                if os.sep in shard or shard.startswith(".."):
                    raise CheckpointError(f"{index}: shard name {shard!r} escapes the directory")
                tensors.update(load_file(str(directory / shard)))
            return tensors
    except SafetensorError as e:
        raise CheckpointError(f"{directory}: weights file is corrupt or truncated ({e})") from None
    except (OSError, KeyError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{directory}: cannot read weights ({e})") from None
    raise CheckpointError(f"{directory}: no {WEIGHTS_NAME} (or {INDEX_NAME}) found")


def load_drafter(directory: str | Path, *, device: str | torch.device = "cpu",
                 dtype: torch.dtype | None = None) -> DFlashDrafter:
    """Build a drafter from a directory, checking names, shapes and dtypes first."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{directory} is not a directory")
    try:
        cfg = DrafterConfig.load(directory)
    except ConfigError as e:
        raise CheckpointError(str(e)) from None
    tensors = read_drafter_tensors(directory)
    with torch.device("meta"):
        expected = {k: v for k, v in DFlashDrafter(cfg).state_dict().items() if "rotary_emb" not in k}
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    wrong = [f"{k}: file {tuple(tensors[k].shape)} vs config {tuple(v.shape)}"
             for k, v in expected.items() if k in tensors and tensors[k].shape != v.shape]
    not_float = [k for k, t in tensors.items() if not t.is_floating_point()]
    problems = []
    if missing:
        problems.append(f"missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    if unexpected:
        problems.append(f"unexpected tensors {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}")
    if wrong:
        problems.append("wrong shapes: " + "; ".join(wrong[:5]))
    if not_float:
        problems.append(f"non-float tensors {not_float[:5]}")
    if problems:
        raise CheckpointError(f"{directory}: weights do not match config.json: " + "; ".join(problems))
    drafter = DFlashDrafter(cfg)
    drafter.load_state_dict(tensors, strict=True)
    target_dtype = dtype or next(iter(tensors.values())).dtype
    return drafter.to(device=device, dtype=target_dtype)
