"""Drafters inside other trainers' checkpoints, read without running their code.

What trainers write, as they write it (docs/adoption.md):
  - a hand-written loop's `*.pt`: `{"model_state_dict": ..., "optimizer_state_dict": ..., "step": ...}`;
  - SpecForge's `{run}-step{N}/training_state.pt` (the model's tensors beside optimizer state);
  - DeepSpec's `step_N/`: HF `save_pretrained` output (config.json + model.safetensors) plus
    `training_state.rank{r}.pt` (the latter is not needed: the directory is a drafter directory);
  - HF Trainer's `checkpoint-N/`: `model.safetensors` of the wrapper module it trained
    (prefixes stripped on load), `trainer_state.json` (`global_step`), no drafter config.json.

`.pt` files are opened with `torch.load(weights_only=True, mmap=True)` only: tensors and plain
containers, memory-mapped, so optimizer state is never read into memory (only the drafter's
tensors are copied out); a pickle that needs any code is refused with torch's reason. A config
that is not in the checkpoint is given by the caller (any published layout), never guessed.
"""
from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TypeGuard

import torch

from dflash_train.common import jsonutil
from dflash_train.core.config import ConfigError, DrafterConfig

from .publication import (
    BIN_NAME,
    CONFIG_NAME,
    INDEX_NAME,
    MARKER_NAME,
    WEIGHTS_NAME,
    CheckpointError,
    import_directory,
    publish_directory,
    read_manifest,
    step_dir_name,
)

# where trainers keep the model's tensors in a training state (first match wins)
MODEL_KEYS = ("model_state_dict", "model", "state_dict", "draft_model", "drafter", "module", "model_state")
STEP_KEYS = ("global_step", "step", "iteration", "iter", "train_step")
STATE_FILES = ("training_state.pt",)  # SpecForge
TRAINER_STATE = "trainer_state.json"  # HF Trainer
_PT = (".pt", ".pth", ".bin", ".ckpt")
# what torch.load(weights_only=True) raises for a pickle that needs code: nothing here unpickles itself
_REFUSED = torch.serialization.pickle.UnpicklingError
_STEP_K = re.compile(r"(?:step|checkpoint|ckpt|iter)[_-]?(\d+)(k?)$", re.IGNORECASE)


class StepUnknown(CheckpointError):
    """A checkpoint that records no step, in its contents or its name: the caller says how to give one."""


def load_pt(path: str | Path) -> object:
    """A `.pt` file's contents: tensors (memory-mapped) in plain containers, or CheckpointError."""
    path = Path(path)
    try:
        return torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
    except _REFUSED as e:
        reason = str(e).strip().splitlines()
        why = next((line for line in reason if "Unsupported" in line or "GLOBAL" in line), reason[0] if reason else "")
        raise CheckpointError(f"{path}: refused: reading it would run code beyond tensors and plain containers "
                              f"(torch.load weights_only=True: {why.strip()[:300]}); save the model's state_dict "
                              "alone, or convert it where the pickle is trusted") from None
    except (RuntimeError, OSError, EOFError, ValueError) as e:
        raise CheckpointError(f"{path}: not a readable torch zip checkpoint: {_unreadable(path)} ({type(e).__name__}: "
                              f"{str(e).splitlines()[0][:200] if str(e) else ''})") from None


def _unreadable(path: Path) -> str:
    """Why torch could not read `path`, from its first bytes: a half-written zip is not a legacy file."""
    try:
        with open(path, "rb") as f:
            head = f.read(4)
    except OSError:
        head = b""
    if not head:
        return "an empty file (still being written, or its write failed)"
    if head == b"PK\x03\x04":  # torch >= 1.6 writes a zip: its central directory comes last
        return "incomplete or damaged (truncated, or still being written when it was read)"
    if head[:1] == b"\x80":  # a bare pickle: torch's legacy (pre-1.6) serialization
        return "a legacy (pre-1.6) torch file, which cannot be memory-mapped: re-save it with torch.save"
    return "neither a torch zip nor a legacy torch file"


def _tensors_only(obj: object) -> TypeGuard[dict[str, torch.Tensor]]:
    return isinstance(obj, dict) and bool(obj) and all(isinstance(k, str) and isinstance(v, torch.Tensor)
                                                       for k, v in obj.items())


def model_tensors(obj: object, where: str | Path) -> tuple[dict[str, torch.Tensor], int | None, list[str]]:
    """(the model's tensors, the step it records, the top-level entries left aside) of a training state."""
    if _tensors_only(obj):
        return dict(obj), None, []
    if not isinstance(obj, dict):
        raise CheckpointError(f"{where}: holds a {type(obj).__name__}, not a state dict or a training state")
    step = next((int(obj[k]) for k in STEP_KEYS if isinstance(obj.get(k), int) and not isinstance(obj.get(k), bool)),
                None)
    for key in MODEL_KEYS:
        inner = obj.get(key)
        while isinstance(inner, dict) and not _tensors_only(inner) and len(inner) == 1:
            inner = next(iter(inner.values()))  # {"model": {"module": {...}}}
        if _tensors_only(inner):
            return dict(inner), step, sorted(str(k) for k in obj if k != key)
    raise CheckpointError(f"{where}: no model state among its entries {sorted(map(str, obj))[:20]} "
                          f"(looked for {', '.join(MODEL_KEYS)})")


def step_from_name(name: str) -> int | None:
    """`checkpoint_step20k.pt` -> 20000, `step_300` -> 300, `run-step12` -> 12, `checkpoint-10` -> 10."""
    if name.isdigit():  # speculators: a directory per step number
        return int(name)
    m = _STEP_K.search(Path(name).stem if Path(name).suffix in _PT else name)
    if not m:
        return None
    return int(m.group(1)) * (1000 if m.group(2) else 1)


def describe(source: str | Path) -> dict:
    """What a trainer's checkpoint is: {kind, weights (file), step, config (path or None)}.

    kind: "pt" (a training-state file), "hf_trainer" (checkpoint-N/), "training_state" (a
    directory holding SpecForge's training_state.pt), "drafter_dir" (config.json + weights:
    z-lab, DeepSpec step_N/, SpecForge export), "pytorch_model_bin" (a directory holding only
    `pytorch_model.bin`: older save_pretrained, HF Trainer with save_safetensors=False)."""
    p = Path(source)
    if p.is_file():
        if p.suffix not in _PT:
            raise CheckpointError(f"{p}: not a training state ({', '.join(_PT)}) nor a directory")
        return {"kind": "pt", "weights": p, "step": step_from_name(p.name), "config": None}
    if not p.is_dir():
        raise CheckpointError(f"{p} does not exist")
    config = p / CONFIG_NAME if (p / CONFIG_NAME).is_file() else None
    step = step_from_name(p.name)
    if (p / TRAINER_STATE).is_file():
        try:
            state = jsonutil.loads((p / TRAINER_STATE).read_text())
            step = int(state["global_step"])
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CheckpointError(f"{p / TRAINER_STATE}: no global_step ({e})") from None
        if (p / WEIGHTS_NAME).is_file() or (p / INDEX_NAME).is_file():
            return {"kind": "hf_trainer", "weights": p, "step": step, "config": config}
    for name in STATE_FILES:
        if (p / name).is_file():
            return {"kind": "training_state", "weights": p / name, "step": step, "config": config}
    if config is not None and ((p / WEIGHTS_NAME).is_file() or (p / INDEX_NAME).is_file()):
        # safetensors first, as transformers' from_pretrained: a pytorch_model.bin beside it is never read
        return {"kind": "drafter_dir", "weights": p, "step": step, "config": config}
    if (p / BIN_NAME).is_file():  # older save_pretrained / HF Trainer with save_safetensors=False
        return {"kind": "pytorch_model_bin", "weights": p / BIN_NAME, "step": step, "config": config}
    if (p / f"{BIN_NAME}.index.json").is_file():
        raise CheckpointError(f"{p}: sharded {BIN_NAME} weights ({BIN_NAME}.index.json) are not read; re-save them "
                              "with save_pretrained(safe_serialization=True), or import each shard's state by hand")
    raise CheckpointError(f"{p}: no drafter weights found (model.safetensors, training_state.pt, or a *.pt file)")


def read_config(path: str | Path) -> DrafterConfig:
    try:
        return DrafterConfig.load(path) if Path(path).is_dir() else DrafterConfig.from_dict(
            jsonutil.loads(Path(path).read_text()))
    except (OSError, ValueError) as e:
        if isinstance(e, ConfigError):
            raise CheckpointError(f"{path}: {e}") from None
        raise CheckpointError(f"{path}: unreadable config ({e})") from None


def only_prefix(tensors: dict[str, torch.Tensor], prefix: str, where: str | Path) -> dict[str, torch.Tensor]:
    """The tensors under `prefix` (stripped): the drafter inside a wrapper that also holds other modules
    (a frozen target, a loss head), which would otherwise be named as unknown tensors."""
    kept = {k[len(prefix):]: v for k, v in tensors.items() if k.startswith(prefix)}
    if not kept:
        heads = sorted({k.split(".", 1)[0] + "." for k in tensors})[:20]
        raise CheckpointError(f"{where}: no tensor under prefix {prefix!r} (top-level names: {heads})")
    return kept


def recorded_in_place(facts: dict, config: str | Path | None, prefix: str | None) -> bool:
    """Whether `import_checkpoint` records this checkpoint (`describe`'s facts) in place, its files read where
    they are (a drafter directory, no config or prefix given), rather than converting it."""
    return facts["kind"] == "drafter_dir" and config is None and prefix is None


def import_checkpoint(checkpoint_root: str | Path, run_id: str, step: int | None, source: str | Path, *,
                      config: str | Path | None = None, prefix: str | None = None) -> tuple[Path, bool, dict]:
    """Make a trainer's checkpoint evaluable: (the record's path, written now, `describe`'s facts).

    A drafter directory whose config.json reads (and no `config` given) becomes an import record
    (nothing copied). Anything else is converted: the drafter's tensors taken out (wrapper
    prefixes stripped, optimizer state never read), checked against `config` (a config.json of any
    published layout; the checkpoint's own when it has one) by building the drafter, and published
    under `<root>/<run_id>/step-<step>/` with its provenance (`imported_from`); `prefix` keeps only the
    tensors under it (the drafter inside a wrapper that also holds the target). Importing the same
    unchanged source again returns the existing record."""

    from .checkpoint import checked_tensors, read_drafter_tensors, write_drafter

    src = Path(os.path.realpath(os.path.expanduser(str(source))))
    facts = describe(src)
    at = facts["step"] if step is None else step
    if at is None and facts["kind"] in ("pt", "training_state"):  # the step the file records, if any
        _, at, _ = model_tensors(load_pt(facts["weights"]), facts["weights"])
        if at is None:
            raise StepUnknown(f"{src}: no step in the checkpoint or its name")
    at = 0 if at is None else at  # a release directory: step 0, as `dflash-eval import` has it
    facts["step"] = at
    if recorded_in_place(facts, config, prefix):
        path, created = import_directory(checkpoint_root, run_id, at, src)
        return path, created, facts
    cfg_path = config or facts["config"]
    if cfg_path is None:
        raise CheckpointError(f"{src}: the drafter's config is not in this checkpoint ({facts['kind']}); give it "
                              "with --config CONFIG_JSON (any published layout: z-lab, DeepSpec, speculators, ...)")
    st = facts["weights"].stat()
    provenance = {"path": str(src), "kind": facts["kind"], "size": st.st_size, "mtime_ns": st.st_mtime_ns,
                  "config": str(Path(cfg_path).resolve()), **({"prefix": prefix} if prefix else {})}
    final = Path(checkpoint_root) / run_id / step_dir_name(at)
    if (final / MARKER_NAME).exists():
        old = read_manifest(final).get("imported_from")
        if old == provenance:
            return final, False, facts
        raise CheckpointError(f"{final} already holds {old['path'] if old else 'a published checkpoint'}; "
                              "import this one under another run or step")
    cfg = read_config(cfg_path)
    if facts["kind"] in ("pt", "training_state", "pytorch_model_bin"):
        tensors, _, _ = model_tensors(load_pt(facts["weights"]), facts["weights"])
    else:
        tensors = read_drafter_tensors(facts["weights"])
    if prefix:
        tensors = only_prefix(tensors, prefix, src)
    # names, shapes, finiteness checked; written straight from the mapped file (the drafter's pages only)
    drafter_tensors, own_vocab = checked_tensors(tensors, cfg, src)
    del tensors
    # own embedding / LM head copies (DeepSpec) travel along: checked against the target at eval time
    state = {**drafter_tensors, **own_vocab}
    path = publish_directory(checkpoint_root, run_id, at,
                             lambda tmp: write_drafter(cfg, state, tmp),
                             extra={"imported_from": provenance},
                             accept=lambda m: m.get("imported_from") == provenance)  # a twin importer won the race
    return path, True, facts
