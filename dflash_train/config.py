"""Drafter configuration, in the published DFlash `config.json` layout.

A drafter directory written here can be served by SGLang/vLLM DFlash support, and a
published z-lab/SpecForge drafter directory loads here: the fields below are the ones
those loaders read (`block_size`, `num_target_layers`, `dflash_config.{mask_token_id,
target_layer_ids}`, plus the Qwen3 decoder fields).
"""
from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


class ConfigError(ValueError):
    """A drafter config that cannot describe a usable drafter."""


# What `from_dict` reports when a config names no target_layer_ids (the result shows it).
LAYER_IDS_FALLBACK = ("fallback: z-lab dflash build_target_layer_ids(num_target_layers, num_hidden_layers), "
                      "round(1 + i*(L-4)/(n-1)) with Python's round (half to even); one feature: L//2")


def default_target_layer_ids(num_target_layers: int, num_features: int) -> list[int]:
    """Target layers whose outputs feed the drafter, by the published DFlash formula.

    One feature takes the middle layer; otherwise features are spread evenly from
    layer 1 to layer L-3 (the last layers are left to the target's own head).
    36 layers, 5 features -> [1, 9, 17, 25, 33]; 64 layers -> [1, 16, 31, 46, 61].
    The expression is z-lab's `build_target_layer_ids` as written there (float division,
    Python's `round`, which rounds halves to even: 94 layers x 5 -> [1, 24, 46, 68, 91]),
    so a published drafter without explicit ids reads the layers it was trained on.
    """
    if num_target_layers < 1 or num_features < 1:
        raise ConfigError("num_target_layers and num_features must be >= 1")
    if num_features == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    ids = [int(round(start + (i * (end - start)) / (num_features - 1))) for i in range(num_features)]
    if len(set(ids)) != len(ids) or not all(0 <= i < num_target_layers for i in ids):
        raise ConfigError(f"a {num_target_layers}-layer target is too shallow for {num_features} distinct features "
                          f"(the published formula gives {ids}); give target_layer_ids explicitly")
    return ids


@dataclass
class DrafterConfig:
    """Shape of a DFlash drafter and of the target it is tied to."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    num_target_layers: int
    target_layer_ids: list[int]
    mask_token_id: int
    block_size: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 40960
    target_hidden_size: int | None = None  # defaults to hidden_size (embeddings are shared)
    torch_dtype: str = "float32"
    extra: dict[str, Any] = field(default_factory=dict)  # unknown published fields, kept on round trip
    # where target_layer_ids came from: "config", or LAYER_IDS_FALLBACK (not written: to_dict makes them explicit)
    layer_ids_origin: str = field(default="config", compare=False)

    def __post_init__(self) -> None:
        if self.target_hidden_size is None:
            self.target_hidden_size = self.hidden_size
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        self.validate()

    @property
    def num_features(self) -> int:
        return len(self.target_layer_ids)

    def validate(self) -> None:
        problems = []
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "vocab_size", "num_target_layers"):
            if int(getattr(self, name)) < 1:
                problems.append(f"{name} must be >= 1 (got {getattr(self, name)})")
        if self.block_size < 2:
            problems.append(f"block_size must be >= 2 (got {self.block_size})")
        if self.num_attention_heads % max(self.num_key_value_heads, 1):
            problems.append("num_attention_heads must be a multiple of num_key_value_heads")
        if not self.target_layer_ids:
            problems.append("dflash_config.target_layer_ids is empty")
        bad = [i for i in self.target_layer_ids if not 0 <= i < self.num_target_layers]
        if bad:
            problems.append(f"target_layer_ids {bad} outside the target's {self.num_target_layers} layers")
        if len(set(self.target_layer_ids)) != len(self.target_layer_ids):
            problems.append(f"target_layer_ids has duplicates: {self.target_layer_ids}")
        if not (math.isfinite(self.rms_norm_eps) and self.rms_norm_eps > 0):
            problems.append(f"rms_norm_eps must be a positive number (got {self.rms_norm_eps})")
        if not (math.isfinite(self.rope_theta) and self.rope_theta > 0):
            problems.append(f"rope_theta must be a positive number (got {self.rope_theta})")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, dict):
            problems.append(f"rope_scaling must be an object or null (got {self.rope_scaling!r})")
        if not 0 <= self.mask_token_id < self.vocab_size:
            problems.append(f"mask_token_id {self.mask_token_id} outside the vocabulary (size {self.vocab_size})")
        if problems:
            raise ConfigError("invalid drafter config: " + "; ".join(problems))

    # --- published layout ---------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = dict(self.extra)
        d.update({
            "architectures": ["DFlashDraftModel"],
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "vocab_size": self.vocab_size,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "hidden_act": "silu",
            "attention_bias": False,
            "tie_word_embeddings": False,
            "torch_dtype": self.torch_dtype,
            "block_size": self.block_size,
            "num_target_layers": self.num_target_layers,
            "dflash_config": {
                "mask_token_id": self.mask_token_id,
                "target_layer_ids": list(self.target_layer_ids),
            },
        })
        if self.target_hidden_size != self.hidden_size:
            d["target_hidden_size"] = self.target_hidden_size
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "DrafterConfig":
        if not isinstance(d, dict):
            raise ConfigError("config.json must hold a JSON object")
        dcfg = d.get("dflash_config") or {}
        if not isinstance(dcfg, dict):
            raise ConfigError("config.json: dflash_config must be an object")
        required = ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"]
        missing = [k for k in required if k not in d]
        if "num_target_layers" not in d:
            missing.append("num_target_layers")
        if "mask_token_id" not in dcfg and "mask_token_id" not in d:
            missing.append("dflash_config.mask_token_id")
        if missing:
            raise ConfigError(f"config.json is missing {', '.join(missing)}")
        try:
            num_target_layers = int(d["num_target_layers"])
            layer_ids = dcfg.get("target_layer_ids") or d.get("target_layer_ids")
            origin = "config"
            if layer_ids is None:
                # older z-lab configs tie the feature count to the draft depth
                layer_ids = default_target_layer_ids(num_target_layers, int(d["num_hidden_layers"]))
                origin = LAYER_IDS_FALLBACK
            heads = int(d["num_attention_heads"])
            known = {f.name for f in dataclasses.fields(cls)} | {
                "architectures", "model_type", "dflash_config", "hidden_act", "attention_bias", "tie_word_embeddings"}
            rope_theta = d.get("rope_theta")
            if rope_theta is None:
                rope_theta = (d.get("rope_parameters") or {}).get("rope_theta", 1_000_000.0)
            return cls(
                hidden_size=int(d["hidden_size"]),
                intermediate_size=int(d["intermediate_size"]),
                num_hidden_layers=int(d["num_hidden_layers"]),
                num_attention_heads=heads,
                num_key_value_heads=int(d.get("num_key_value_heads", heads)),
                head_dim=int(d.get("head_dim") or int(d["hidden_size"]) // heads),
                vocab_size=int(d["vocab_size"]),
                num_target_layers=num_target_layers,
                target_layer_ids=[int(i) for i in layer_ids],
                mask_token_id=int(dcfg.get("mask_token_id", d.get("mask_token_id"))),
                block_size=int(d.get("block_size", 16)),
                rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
                rope_theta=float(rope_theta),
                rope_scaling=d.get("rope_scaling"),
                max_position_embeddings=int(d.get("max_position_embeddings", 40960)),
                target_hidden_size=d.get("target_hidden_size"),
                torch_dtype=str(d.get("torch_dtype") or d.get("dtype") or "float32"),
                extra={k: v for k, v in d.items() if k not in known},
                layer_ids_origin=origin,
            )
        except (TypeError, ValueError, OverflowError, AttributeError) as e:
            if isinstance(e, ConfigError):
                raise
            raise ConfigError(f"config.json has a field of the wrong type: {e}") from e

    def save(self, directory: str | Path) -> Path:
        path = Path(directory) / "config.json"
        path.write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")
        return path

    @classmethod
    def load(cls, directory: str | Path) -> "DrafterConfig":
        path = Path(directory) / "config.json"
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            raise ConfigError(f"{path} not found: not a drafter directory") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from None
        except OSError as e:
            raise ConfigError(f"{path} cannot be read: {e}") from None
        return cls.from_dict(data)

    def qwen3_config(self):
        """The equivalent transformers Qwen3Config (for rotary embeddings, norms, MLP)."""
        from transformers import Qwen3Config

        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": self.rope_theta}
        if self.rope_scaling:
            rope = {**self.rope_scaling, "rope_theta": self.rope_theta}
            rope.setdefault("rope_type", rope.pop("type", "default"))
        return Qwen3Config(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads,
            head_dim=self.head_dim,
            rms_norm_eps=self.rms_norm_eps,
            max_position_embeddings=self.max_position_embeddings,
            rope_parameters=rope,
        )

    @classmethod
    def for_target(cls, target_config: Any, *, mask_token_id: int, num_hidden_layers: int = 1,
                   num_features: int | None = None, target_layer_ids: list[int] | None = None,
                   block_size: int = 16, intermediate_size: int | None = None) -> "DrafterConfig":
        """A drafter shaped for a target's (text) config: same width, heads, vocab, rope."""
        tc = getattr(target_config, "text_config", None) or target_config
        L = int(tc.num_hidden_layers)
        if target_layer_ids is None:
            target_layer_ids = default_target_layer_ids(L, num_features or max(num_hidden_layers, 1))
        rope = getattr(tc, "rope_parameters", None) or {}
        theta = rope.get("rope_theta", getattr(tc, "rope_theta", 1_000_000.0))
        scaling = None if rope.get("rope_type", "default") == "default" else {
            k: v for k, v in rope.items() if k != "rope_theta"}
        heads = int(tc.num_attention_heads)
        return cls(
            hidden_size=int(tc.hidden_size),
            intermediate_size=int(intermediate_size or tc.intermediate_size),
            num_hidden_layers=num_hidden_layers,
            num_attention_heads=heads,
            num_key_value_heads=int(getattr(tc, "num_key_value_heads", heads)),
            head_dim=int(getattr(tc, "head_dim", None) or tc.hidden_size // heads),
            vocab_size=int(tc.vocab_size),
            num_target_layers=L,
            target_layer_ids=list(target_layer_ids),
            mask_token_id=mask_token_id,
            block_size=block_size,
            rms_norm_eps=float(getattr(tc, "rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=int(getattr(tc, "max_position_embeddings", 40960)),
        )
