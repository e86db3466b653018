"""Resumable training state, kept apart from the published eval checkpoints.

One file per save, `<state_dir>/state-<step:08d>.pt`: drafter weights, optimizer,
scheduler, step, data position and RNG states. Written with `torch.save` to a temporary
file, fsynced and renamed; read with `torch.load(weights_only=True)` (no unpickling of
arbitrary objects), so everything stored is tensors, numbers, strings, lists and dicts.
"""
from __future__ import annotations

import random
import re
from pathlib import Path

import numpy as np
import torch

from dflash_train.common.errors import DFlashError
from dflash_train.common.fsutil import atomic_writer

STATE_FORMAT = "dflash-train-state/1"
_STATE_FILE = re.compile(r"^state-(\d{8,})\.pt$")


class TrainStateError(DFlashError, ValueError):
    pass


def rng_state() -> dict:
    np_state = np.random.get_state()
    assert isinstance(np_state, tuple)  # the global RandomState's legacy (MT19937) form
    state = {"torch": torch.get_rng_state(), "python": _to_lists(random.getstate()),
             "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]]}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(_to_tuples(state["python"]))
    n = state["numpy"]
    np.random.set_state((n[0], np.array(n[1], dtype=np.uint32), *n[2:]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def _to_lists(x):
    return [_to_lists(v) for v in x] if isinstance(x, (tuple, list)) else x


def _to_tuples(x):
    return tuple(_to_tuples(v) for v in x) if isinstance(x, list) else x


def state_path(state_dir: str | Path, step: int) -> Path:
    return Path(state_dir) / f"state-{int(step):08d}.pt"


def save_training_state(state_dir: str | Path, step: int, *, model_state: dict, optimizer_state: dict,
                        scheduler_state: dict, data_position: int, config: dict, extra: dict | None = None,
                        keep: int = 2) -> Path:
    state_dir = Path(state_dir)
    state_dir.mkdir(parents=True, exist_ok=True)
    path = state_path(state_dir, step)
    payload = {"format": STATE_FORMAT, "step": int(step), "data_position": int(data_position),
               "model": {k: v.detach().cpu() for k, v in model_state.items()}, "optimizer": optimizer_state,
               "scheduler": scheduler_state, "rng": rng_state(), "config": config, "extra": extra or {}}
    with atomic_writer(path) as f:  # streamed: a whole serialized state is never held in memory
        torch.save(payload, f)
    if keep > 0:
        for old in list_training_states(state_dir)[:-keep]:
            old.unlink(missing_ok=True)
    return path


def list_training_states(state_dir: str | Path) -> list[Path]:
    d = Path(state_dir)
    if not d.is_dir():
        return []
    return sorted((p for p in d.iterdir() if _STATE_FILE.match(p.name)), key=lambda p: p.name)


def latest_training_state(state_dir: str | Path) -> Path | None:
    states = list_training_states(state_dir)
    return states[-1] if states else None


def load_training_state(path: str | Path, map_location="cpu") -> dict:
    path = Path(path)
    if path.is_dir():
        found = latest_training_state(path)
        if found is None:
            raise TrainStateError(f"{path}: no state-*.pt training state to resume from")
        path = found
    try:
        payload = torch.load(path, map_location=map_location, weights_only=True)
    except FileNotFoundError:
        raise TrainStateError(f"training state {path} not found") from None
    except Exception as e:  # noqa: BLE001 - truncated/corrupt file, or a non-weights-only pickle
        raise TrainStateError(f"{path}: cannot read training state ({e})") from None
    if not isinstance(payload, dict) or payload.get("format") != STATE_FORMAT:
        raise TrainStateError(f"{path}: not a {STATE_FORMAT} file")
    payload["path"] = str(path)
    return payload
