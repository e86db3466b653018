"""Trainer configuration: one flat dataclass, loaded from YAML/JSON, every field a CLI flag."""
from __future__ import annotations

import dataclasses
import json
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_train.checkpoints.publication import RUN_ID_RULE, valid_run_id
from dflash_train.common.errors import DFlashError

BUNDLED_TARGET = "builtin:tiny-target"
CONFIG_DIR = Path(__file__).resolve().parent / "configs"


class TrainConfigError(DFlashError, ValueError):
    pass


def opt(default: Any = dataclasses.MISSING, help: str = "", *, factory=None) -> Any:
    """A TrainConfig field with its help text (the `dflash-train --help` line of its flag)."""
    if factory is not None:
        return field(default_factory=factory, metadata={"help": help})
    return field(default=default, metadata={"help": help})


def help_of(f: dataclasses.Field) -> str:
    return f.metadata.get("help", "")


@dataclass
class TrainConfig:
    # --- target and drafter -----------------------------------------------------------
    target: str = opt(BUNDLED_TARGET, "target model: a local Hugging Face model directory, or builtin:tiny-target "
                                      "(the bundled tiny Qwen3)")
    target_dtype: str = opt("auto", "dtype the frozen target runs in (auto: float32 on CPU, bfloat16 on CUDA)")
    drafter_layers: int = opt(1, "decoder layers of the drafter")
    num_features: int | None = opt(None, "target layers whose hidden states feed the drafter, spread by the "
                                         "published formula (default: drafter_layers)")
    target_layer_ids: list[int] | None = opt(None, "explicit target layer ids fed to the drafter, e.g. 1,9,17 "
                                                   "(overrides num_features)")
    block_size: int = opt(16, "draft block size B: tokens drafted per verify step, anchor included")
    drafter_intermediate_size: int | None = opt(None, "drafter MLP width (default: the target's)")
    mask_token_id: int | None = opt(None, "mask token id of the draft blocks (default: the tokenizer's <|MASK|>)")
    init_from: str | None = opt(None, "start from the weights of this drafter directory")

    # --- data ---------------------------------------------------------------------------
    data: str = opt("builtin:stdlib-code", "training prompts: a JSONL file (prompt/messages/text per line), or "
                                           "builtin:stdlib-code | builtin:stdlib-instruct | builtin:stdlib-mix")
    num_prompts: int = opt(512, "prompts drawn from a builtin source")
    prompt_tokens: int = opt(64, "prompt length in tokens for builtin code prefixes")
    chat_template: str = opt("auto", "wrap prompts in the target's chat template: auto | always | never")
    regenerate: bool = opt(True, "train on the target's own greedy responses (regenerated once, cached)")
    max_new_tokens: int = opt(128, "response length when regenerating")
    regen_batch_size: int = opt(32, "prompts per generate() call when regenerating")
    max_seq_len: int = opt(512, "longest training sequence (prompt + response) in tokens")
    seq_multiple: int = opt(64, "pad batch length to a multiple of this (few shapes); 0 = exact length")
    data_cache_dir: str | None = opt(None, "where regenerated responses are cached (default <run dir>/cache)")

    # --- optimisation ---------------------------------------------------------------------
    max_steps: int = opt(1000, "optimizer steps to train for")
    batch_size: int = opt(8, "global batch size in sequences (all ranks together)")
    num_anchors: int = opt(32, "draft blocks (anchors) sampled per sequence")
    lr: float = opt(6e-4, "peak learning rate (AdamW)")
    weight_decay: float = opt(0.0, "AdamW weight decay")
    adam_betas: list[float] = opt(help="AdamW betas, e.g. 0.9,0.95", factory=lambda: [0.9, 0.95])
    warmup_ratio: float = opt(0.04, "share of max_steps spent warming the learning rate up linearly")
    min_lr_ratio: float = opt(0.1, "final learning rate as a share of lr (cosine decay)")
    grad_clip: float = opt(1.0, "gradient norm clip (0: off)")
    loss_type: str = opt("dflash", "block loss: dflash (decay-weighted CE) | dpace (acceptance-weighted)")
    gamma: float | None = opt(None, "decay of the dflash loss weights (default 7/5/4 for B = 16/10/8)")
    dpace_alpha: float = opt(0.5, "smoothing of the dpace weights")
    noise_std: float = opt(0.0, "std of Gaussian noise added to the context features (0: off)")
    ce_chunk: int | None = opt(8192, "LM-head rows per chunk of the loss (None: all at once)")
    seed: int = opt(0, "seed of the initial weights, data order and anchors")

    # --- runtime --------------------------------------------------------------------------
    device: str = opt("auto", "auto | cpu | cuda (each torchrun rank takes cuda:LOCAL_RANK)")
    backend: str = opt("auto", "attention kernel: auto (flex on CUDA where it can run the drafter, "
                                  "else sdpa) | flex | sdpa")
    autocast: str = opt("auto", "mixed precision: auto (bf16 on CUDA) | bf16 | off")
    queue_depth: int = opt(2, "target hidden-state batches prepared ahead of the drafter; 0 = synchronous")
    num_threads: int | None = opt(None, "torch intra-op threads on CPU (default: torch's)")

    # --- checkpoints --------------------------------------------------------------------------
    checkpoint_root: str = opt("runs", "directory the run's checkpoints are published under (<root>/<run_id>/)")
    run_id: str | None = opt(None, "name of the run (default train-<UTC time>)")
    publish_to: str | None = opt(None, "object-store prefix (s3://bucket/runs) each published checkpoint is also "
                                       "uploaded to, as <prefix>/<run_id>/step-N/ (files, then COMPLETE.json); eval "
                                       "jobs then name the store URL, for workers that share no filesystem")
    publish_every: int = opt(100, "publish a checkpoint for evaluation every N steps (and at the last one)")
    keep_last: int = opt(3, "published checkpoints kept (plus pinned/queued ones); 0 keeps all")
    checkpoint_dtype: str | None = opt(None, "dtype of published weights, e.g. bfloat16 (default: the drafter's)")
    state_dir: str | None = opt(None, "where resumable training states go (default <run dir>/train_state)")
    state_every: int | None = opt(None, "save a training state every N steps (default: publish_every)")
    keep_states: int = opt(2, "training states kept")
    resume: str = opt("auto", "auto (latest state of the run) | never | a state file or directory")

    # --- logging ----------------------------------------------------------------------------
    log_every: int = opt(10, "log train metrics every N steps")
    progress: bool = opt(True, "show progress (a bar on a terminal, lines with ETA elsewhere; rank 0 only)")
    progress_every_s: float = opt(15.0, "seconds between progress lines when stderr is not a terminal")
    wandb: bool = opt(False, "log train metrics to W&B (train/* against train/step)")
    wandb_project: str = opt("dflash-train", "W&B project of the training run")
    wandb_entity: str | None = opt(None, "W&B entity (team or user)")
    wandb_mode: str = opt("offline",
                          "W&B mode: offline | online | disabled (the --wandb-mode flag wins over $WANDB_MODE, which "
                          "wins over the config file)")

    # --- evaluation (the eval sidecar; docs/sidecar.md) ------------------------------------
    eval_every: int | None = opt(None, "queue an acceptance eval of the published checkpoint every N steps "
                                       "(and the last one) for the eval worker; needs Redis (--redis-url, "
                                       "$REDIS_URL, else a local redis-server)")
    eval_suite: list[str] = opt(help="suite(s) each eval runs, comma-separated: builtin:NAME, a standard benchmark "
                                     "hf:NAME[:n=N][:seed=S] (gsm8k, math500, humaneval, mbpp, mt-bench, alpaca), "
                                     "or a .jsonl file the worker can read",
                                factory=lambda: ["builtin:coding-v1"])
    eval_baseline: str | None = opt(None, "drafter every eval is compared with (Δτ): a published checkpoint or a "
                                          "drafter directory without COMPLETE.json (imported, nothing written to it)")
    eval_target: str | None = opt(None, "target path as the eval worker sees it (default: the worker's own --target)")
    # quick in-training evals (the eval options num_prompts / max_new_tokens of every queued job)
    eval_num_prompts: int | None = opt(None, "each eval reads only the first N prompts of its suite(s) (quick "
                                             "in-training evals; default: all)")
    eval_max_new_tokens: int | None = opt(None, "each eval generates at most N new tokens per prompt (default: "
                                                "the suite's)")

    def __post_init__(self) -> None:  # noqa: C901 - independent field checks, one per branch, all reported
        problems = []
        if self.block_size < 2:
            problems.append("block_size must be >= 2")
        for name in ("max_steps", "batch_size", "num_anchors", "publish_every", "drafter_layers", "max_seq_len"):
            if getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1")
        if self.queue_depth < 0:
            problems.append("queue_depth must be >= 0")
        if self.eval_every is not None and self.eval_every < 1:
            problems.append("eval_every must be >= 1")
        for name in ("eval_num_prompts", "eval_max_new_tokens"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                problems.append(f"{name} must be >= 1")
        if not self.eval_suite or not all(isinstance(x, str) and x.strip() for x in self.eval_suite):
            problems.append("eval_suite must name at least one suite")
        if self.loss_type not in ("dflash", "dpace"):
            problems.append(f"loss_type must be dflash or dpace (got {self.loss_type!r})")
        if self.chat_template not in ("auto", "always", "never"):
            problems.append("chat_template must be auto, always or never")
        if self.backend not in ("auto", "flex", "sdpa"):
            problems.append(f"backend must be auto, flex or sdpa (got {self.backend!r})")
        if self.autocast not in ("auto", "bf16", "off"):
            problems.append("autocast must be auto, bf16 or off")
        if not 0 <= self.warmup_ratio < 1 or not 0 <= self.min_lr_ratio <= 1:
            problems.append("warmup_ratio must be in [0, 1) and min_lr_ratio in [0, 1]")
        if self.run_id is not None and not valid_run_id(self.run_id):
            # checked here, not at the first publication: every eval job of the run would be refused
            problems.append(f"run_id {self.run_id!r} must be {RUN_ID_RULE}")
        if self.publish_to is not None:
            from dflash_train.checkpoints.location import CheckpointRef
            from dflash_train.common.errors import StoreError

            try:
                if CheckpointRef.parse(self.publish_to).on_this_machine:
                    raise StoreError("must be an object-store URL such as s3://bucket/runs")
            except StoreError as e:
                problems.append(f"publish_to {self.publish_to!r}: {e}")
        if problems:
            raise TrainConfigError("invalid train config: " + "; ".join(problems))

    # --- files ------------------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            raise TrainConfigError(f"unknown train config keys: {', '.join(unknown)}")
        return cls(**{k: _coerce(cls, k, v) for k, v in data.items()})

    @classmethod
    def from_file(cls, path: str | Path, overrides: dict[str, Any] | None = None) -> TrainConfig:
        return load_config(path, overrides)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes) -> TrainConfig:
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
        except Exception as e:  # noqa: BLE001 - json and yaml raise many types; all are one refusal
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
        raise TrainConfigError(f"option {name}: cannot use {value!r} as "
                               f"{base.__name__ if hasattr(base, '__name__') else base}") from None
    return value
