"""Trainer configuration: one flat dataclass, loaded from YAML/JSON, every field a CLI flag."""
from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import DFlashError
from .publication import RUN_ID_RULE, valid_run_id

BUNDLED_TARGET = "builtin:tiny-target"
CONFIG_DIR = Path(__file__).resolve().parent / "configs"


class TrainConfigError(DFlashError, ValueError):
    pass


@dataclass
class TrainConfig:
    # --- target and drafter -----------------------------------------------------------
    target: str = BUNDLED_TARGET  # local HF model directory, or builtin:tiny-target
    target_dtype: str = "auto"  # auto: float32 on CPU, bfloat16 on CUDA
    drafter_layers: int = 1
    num_features: int | None = None  # target layers fed to the drafter (default: drafter_layers)
    target_layer_ids: list[int] | None = None  # explicit layers (overrides num_features)
    block_size: int = 16
    drafter_intermediate_size: int | None = None  # default: the target's
    mask_token_id: int | None = None  # default: the tokenizer's <|MASK|>
    init_from: str | None = None  # start from a drafter directory

    # --- data ---------------------------------------------------------------------------
    data: str = "builtin:stdlib-code"  # JSONL path or builtin:stdlib-code
    num_prompts: int = 512  # builtin source only
    prompt_tokens: int = 64  # builtin source only
    chat_template: str = "auto"  # auto | always | never
    regenerate: bool = True  # responses = the target's greedy output
    max_new_tokens: int = 128
    regen_batch_size: int = 32
    max_seq_len: int = 512
    seq_multiple: int = 64  # pad batch length to a multiple (few shapes); 0 = exact
    data_cache_dir: str | None = None  # default <run dir>/cache

    # --- optimisation ---------------------------------------------------------------------
    max_steps: int = 1000
    batch_size: int = 8  # global (all ranks together)
    num_anchors: int = 32  # blocks per sequence
    lr: float = 6e-4
    weight_decay: float = 0.0
    adam_betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    warmup_ratio: float = 0.04
    min_lr_ratio: float = 0.1
    grad_clip: float = 1.0
    loss_type: str = "dflash"  # dflash | dpace
    gamma: float | None = None  # decay; default 7/5/4 for B = 16/10/8
    dpace_alpha: float = 0.5
    noise_std: float = 0.0  # Gaussian noise on the context features only
    ce_chunk: int | None = 8192  # LM-head rows per chunk (None: all at once)
    seed: int = 0

    # --- runtime --------------------------------------------------------------------------
    device: str = "auto"  # auto | cpu | cuda
    backend: str = "auto"  # attention: auto (flex on CUDA, sdpa elsewhere) | flex | sdpa
    autocast: str = "auto"  # auto (bf16 on CUDA) | bf16 | off
    queue_depth: int = 2  # hidden-state batches prepared ahead; 0 = synchronous
    num_threads: int | None = None  # torch intra-op threads (CPU)

    # --- checkpoints --------------------------------------------------------------------------
    checkpoint_root: str = "runs"
    run_id: str | None = None  # default: train-<UTC time>
    publish_every: int = 100
    keep_last: int = 3  # published checkpoints kept (plus pinned/protected); 0 keeps all
    checkpoint_dtype: str | None = None  # e.g. bfloat16; default: the drafter's
    state_dir: str | None = None  # default <run dir>/train_state
    state_every: int | None = None  # default: publish_every
    keep_states: int = 2
    resume: str = "auto"  # auto | never | <state file or dir>

    # --- logging ----------------------------------------------------------------------------
    log_every: int = 10
    progress: bool = True
    wandb: bool = False
    wandb_project: str = "dflash-train"
    wandb_entity: str | None = None
    wandb_mode: str = "offline"

    def __post_init__(self) -> None:
        problems = []
        if self.block_size < 2:
            problems.append("block_size must be >= 2")
        for name in ("max_steps", "batch_size", "num_anchors", "publish_every", "drafter_layers", "max_seq_len"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1")
        if self.queue_depth < 0:
            problems.append("queue_depth must be >= 0")
        if self.loss_type not in ("dflash", "dpace"):
            problems.append(f"loss_type must be dflash or dpace (got {self.loss_type!r})")
        if self.chat_template not in ("auto", "always", "never"):
            problems.append("chat_template must be auto, always or never")
        if self.autocast not in ("auto", "bf16", "off"):
            problems.append("autocast must be auto, bf16 or off")
        if not 0 <= self.warmup_ratio < 1 or not 0 <= self.min_lr_ratio <= 1:
            problems.append("warmup_ratio must be in [0, 1) and min_lr_ratio in [0, 1]")
        if self.run_id is not None and not valid_run_id(self.run_id):
            # checked here, not at the first publication: every eval job of the run would be refused
            problems.append(f"run_id {self.run_id!r} must be {RUN_ID_RULE}")
        if problems:
            raise TrainConfigError("invalid train config: " + "; ".join(problems))

    # --- files ------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "TrainConfig":
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise TrainConfigError(f"unknown train config keys: {', '.join(unknown)}")
        return cls(**{k: _coerce(cls, k, v) for k, v in data.items()})

    @classmethod
    def from_file(cls, path: str | Path, overrides: dict[str, Any] | None = None) -> "TrainConfig":
        return load_config(path, overrides)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes) -> "TrainConfig":
        return dataclasses.replace(self, **{k: _coerce(type(self), k, v) for k, v in changes.items()})


def resolve_config_path(path: str | Path) -> Path:
    """A file path, or the name of a bundled config (`demo`, `long`)."""
    p = Path(path)
    if p.is_file():
        return p
    for cand in (CONFIG_DIR / f"{path}.yaml", CONFIG_DIR / str(path)):
        if cand.is_file():
            return cand
    raise TrainConfigError(f"config {path} not found (nor a bundled config: demo, long)")


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> TrainConfig:
    """Read YAML or JSON (or nothing: defaults), then apply `overrides` (None values skipped)."""
    data: dict[str, Any] = {}
    if path is not None:
        p = resolve_config_path(path)
        text = p.read_text()
        try:
            if p.suffix == ".json":
                data = json.loads(text)
            else:
                import yaml
                data = yaml.safe_load(text) or {}
        except Exception as e:
            raise TrainConfigError(f"{p}: cannot parse ({e})") from None
        if not isinstance(data, dict):
            raise TrainConfigError(f"{p}: expected a mapping of options")
    data.update({k: v for k, v in (overrides or {}).items() if v is not None})
    return TrainConfig.from_dict(data)


def field_types(cls=TrainConfig) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def unwrap_optional(hint):
    """`int | None` -> int; other hints unchanged."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        return args[0]
    return hint


def _coerce(cls, name: str, value: Any) -> Any:
    """YAML/flags give strings and ints; turn them into the field's type."""
    base = unwrap_optional(field_types(cls)[name])
    if value is None:
        return None
    origin = typing.get_origin(base)
    try:
        if base is bool:
            if isinstance(value, str):
                if value.lower() not in ("1", "0", "true", "false", "yes", "no", "on", "off"):
                    raise ValueError(value)
                return value.lower() in ("1", "true", "yes", "on")
            return bool(value)
        if origin is list:
            if isinstance(value, str):
                value = json.loads(value) if value.strip().startswith("[") else value.split(",")
            item = typing.get_args(base)[0]
            return [item(v) for v in value]
        if base in (int, float, str):
            if base is int and isinstance(value, float) and not value.is_integer():
                raise ValueError(value)
            return base(value)
    except (TypeError, ValueError):
        raise TrainConfigError(f"option {name}: cannot use {value!r} as {base.__name__ if hasattr(base, '__name__') else base}") from None
    return value
