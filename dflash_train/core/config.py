"""Drafter configuration, in the published DFlash `config.json` layout.

A drafter directory written here can be served by SGLang/vLLM DFlash support, and a
published z-lab/SpecForge drafter directory loads here: the fields below are the ones
those loaders read (`block_size`, `num_target_layers`, `dflash_config.{mask_token_id,
target_layer_ids}`, plus the Qwen3 decoder fields).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_train.common import jsonutil
from dflash_train.common.errors import DFlashError


class ConfigError(DFlashError, ValueError):
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


# --- fields of a published config.json ------------------------------------------------------
# Everything a config may say is either implemented here, metadata that cannot change a
# draft (kept on round trip), or refused by name: a field we would ignore could make our
# drafts differ from the serving engine's, silently.
_IMPLEMENTED = {
    "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
    "head_dim", "vocab_size", "num_target_layers", "target_layer_ids", "mask_token_id", "block_size",
    "rms_norm_eps", "rope_theta", "rope_scaling", "rope_parameters", "max_position_embeddings",
    "target_hidden_size", "torch_dtype", "dtype", "layer_types", "sliding_window", "use_sliding_window",
    "max_window_layers", "is_causal", "dflash_config", "architectures", "model_type"}
_METADATA = {
    "auto_map", "transformers_version", "_name_or_path", "bos_token_id", "eos_token_id", "pad_token_id",
    "initializer_range", "use_cache", "attention_dropout", "tie_word_embeddings", "return_dict",
    "output_hidden_states", "output_attentions", "id2label", "label2id", "problem_type", "tokenizer_class",
    "chunk_size_feed_forward", "is_encoder_decoder", "task_specific_params", "prefix", "finetuning_task"}
# metadata whose value matters: any other value is a different network
_FIXED = {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False, "is_neox_style": True,
          "use_qk_norm": True}  # use_qk_norm: speculators' decoder config spells out Qwen3's q/k norms
_DFLASH_IMPLEMENTED = {"mask_token_id", "target_layer_ids", "block_size", "num_target_layers", "causal",
                       "use_swa", "swa_window_size", "mask_token"}
_DFLASH_FIXED = {"attention_sink_bias": False, "output_multiplier": 1.0, "final_logit_softcapping": None,
                 "use_aux_hidden_state": True}
LAYER_TYPES = ("full_attention", "sliding_attention")
ROPE_TYPES = ("default", "linear", "yarn", "llama3")  # position-only rotations (no length-dependent state)
ARCHITECTURE = "DFlashDraftModel"
# How sliding layers are drafted when the config states no causality (the ecosystem disagrees):
# "serving": vLLM's `_resolve_layer_attention` (and SGLang): causal within the block in sliding layers;
# "reference": z-lab's transformers loop with flash-attention semantics: non-causal, windowed.
SLIDING_RULES = ("serving", "reference")
LAYOUTS = ("z-lab", "deepspec", "speculators", "vllm", "automodel")


@dataclass
class DrafterConfig:
    """Shape of a DFlash drafter and of the target it is tied to.

    `num_target_layers` and `target_layer_ids` may be None in a published config: they
    then come from the target (`bind_target`), the ids by the published formula with one
    feature per drafter layer. `layer_types` (None: all full attention) with
    `sliding_window` gives windowed layers; `causal` (None: the engines' default, causal
    exactly in sliding layers) overrides the block's causality in every layer.
    """

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    num_target_layers: int | None
    target_layer_ids: list[int] | None
    mask_token_id: int | None  # None only with `mask_token`: resolved by the target's tokenizer
    block_size: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 40960
    target_hidden_size: int | None = None  # defaults to hidden_size (embeddings are shared)
    torch_dtype: str = "float32"
    layer_types: list[str] | None = None  # per layer; None: all "full_attention"
    sliding_window: int | None = None
    causal: bool | None = None
    # causality of sliding layers as the config states it (speculators' sliding_window_non_causal);
    # None with `causal` None: implicit, drafted by `sliding_rule`
    sliding_causal: bool | None = None
    sliding_rule: str = field(default="serving", compare=False)  # SLIDING_RULES; a job option chooses it
    layout: str = field(default="z-lab", compare=False)  # the published layout read (LAYOUTS)
    mask_token: str | None = None  # SGLang's dflash_config.mask_token (e.g. "<|MASK|>")
    extra: dict[str, Any] = field(default_factory=dict, compare=False)  # published metadata, kept on round trip
    # where target_layer_ids came from: "config", or LAYER_IDS_FALLBACK (not written: to_dict makes them explicit)
    layer_ids_origin: str = field(default="config", compare=False)

    def __post_init__(self) -> None:
        if self.target_hidden_size is None:
            self.target_hidden_size = self.hidden_size
        if self.target_layer_ids is not None:
            self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        if self.target_layer_ids is None and self.num_target_layers is not None:
            # older z-lab configs tie the feature count to the draft depth
            self.target_layer_ids = default_target_layer_ids(self.num_target_layers, self.num_hidden_layers)
            self.layer_ids_origin = LAYER_IDS_FALLBACK
        # None means all full attention; stored explicitly so equal drafters compare equal
        self.layer_types = list(self.layer_types or ["full_attention"] * self.num_hidden_layers)
        self.validate()

    @property
    def _types(self) -> list[str]:
        """`layer_types`, never None once constructed (`__post_init__` fills the default)."""
        assert self.layer_types is not None
        return self.layer_types

    @property
    def layer_ids(self) -> list[int]:
        """The target layers the drafter reads; a config not yet bound to its target (`bind_target`) has none."""
        if self.target_layer_ids is None:
            raise ConfigError("the drafter config names no target_layer_ids and is not bound to a target "
                              "(DrafterConfig.bind_target)")
        return self.target_layer_ids

    @property
    def num_features(self) -> int:
        return len(self.target_layer_ids) if self.target_layer_ids is not None else self.num_hidden_layers

    def attention(self) -> list[tuple[int | None, bool]]:
        """Per drafter layer: (sliding window or None, causal within the block)."""
        if self.sliding_rule not in SLIDING_RULES:
            raise ConfigError(f"unknown sliding rule {self.sliding_rule!r} (known: {', '.join(SLIDING_RULES)})")
        sliding = self.sliding_causal if self.sliding_causal is not None else self.sliding_rule == "serving"
        return [(self.sliding_window if t == "sliding_attention" else None,
                 (t == "sliding_attention" and sliding) if self.causal is None else self.causal)
                for t in self._types]

    @property
    def sliding_implicit(self) -> bool:
        """Sliding layers whose causality the config leaves to the engine (engines disagree)."""
        return "sliding_attention" in self._types and self.causal is None and self.sliding_causal is None

    def attention_rule(self) -> str:
        """The causality rule applied, in words (named in every result)."""
        if "sliding_attention" not in self._types:
            return "no sliding layers" + ("" if self.causal is None else f"; causal={str(self.causal).lower()} "
                                          "in every layer (config)")
        if self.causal is not None:
            return f"config: causal={str(self.causal).lower()} in every layer, window {self.sliding_window}"
        if self.sliding_causal is not None:
            return (f"config: sliding layers {'causal' if self.sliding_causal else 'non-causal'} within the block, "
                    f"window {self.sliding_window}")
        how = ("causal within the block in sliding layers (vLLM/SGLang)" if self.sliding_rule == "serving" else
               "non-causal with the window applied (z-lab loop, flash-attention semantics)")
        return f"{self.sliding_rule} (implicit: the config names no causal flag): {how}, window {self.sliding_window}"

    def resolve_mask_token(self, tokenizer) -> None:
        """SGLang's `mask_token` string: its id in the target's tokenizer (must agree with an id given too)."""
        if self.mask_token is None:
            return
        tid = None
        if tokenizer is not None:
            tid = tokenizer.convert_tokens_to_ids(self.mask_token)
            tid = None if tid is None or tid == getattr(tokenizer, "unk_token_id", None) else int(tid)
        if self.mask_token_id is None:
            if tid is None:
                raise ConfigError(f"dflash_config.mask_token {self.mask_token!r} is not a token of the target's "
                                  "tokenizer" if tokenizer is not None else
                                  f"dflash_config.mask_token {self.mask_token!r} needs the target's tokenizer "
                                  "(this target has none): give dflash_config.mask_token_id")
            self.mask_token_id = tid
        elif tid is not None and tid != self.mask_token_id:
            raise ConfigError(f"dflash_config.mask_token {self.mask_token!r} is id {tid} in the target's tokenizer "
                              f"but mask_token_id says {self.mask_token_id}")
        self.validate()

    def bind_target(self, num_target_layers: int) -> None:
        """Fill what a published config may leave to the target: its depth and the layer ids."""
        if self.num_target_layers is None:
            self.num_target_layers = int(num_target_layers)
        if self.target_layer_ids is None:
            self.target_layer_ids = default_target_layer_ids(self.num_target_layers, self.num_hidden_layers)
            self.layer_ids_origin = LAYER_IDS_FALLBACK
        self.validate()

    def validate(self) -> None:
        problems = self._shape_problems() + self._rope_problems() + self._layer_problems()
        if not problems:
            try:  # rope parameters the rotary embedding cannot build are refused now, not mid-evaluation
                from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

                Qwen3RotaryEmbedding(self.qwen3_config())
            except Exception as e:  # noqa: BLE001 - transformers raises several types here
                problems.append(f"rope parameters {self.rope_scaling} are not usable ({type(e).__name__}: {e})")
        if problems:
            raise ConfigError("invalid drafter config: " + "; ".join(problems))

    def _shape_problems(self) -> list[str]:
        problems = []
        for name in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                     "num_key_value_heads", "head_dim", "vocab_size"):
            if int(getattr(self, name)) < 1:
                problems.append(f"{name} must be >= 1 (got {getattr(self, name)})")
        if self.num_target_layers is not None and self.num_target_layers < 1:
            problems.append(f"num_target_layers must be >= 1 (got {self.num_target_layers})")
        if self.block_size < 2:
            problems.append(f"block_size must be >= 2 (got {self.block_size})")
        if self.num_attention_heads % max(self.num_key_value_heads, 1):
            problems.append("num_attention_heads must be a multiple of num_key_value_heads")
        if self.mask_token_id is None:
            if not isinstance(self.mask_token, str) or not self.mask_token:
                problems.append("mask_token_id is missing (or dflash_config.mask_token, a token string)")
        elif not 0 <= self.mask_token_id < self.vocab_size:
            problems.append(f"mask_token_id {self.mask_token_id} outside the vocabulary (size {self.vocab_size})")
        return problems

    def _rope_problems(self) -> list[str]:
        problems = []
        if not (math.isfinite(self.rms_norm_eps) and self.rms_norm_eps > 0):
            problems.append(f"rms_norm_eps must be a positive number (got {self.rms_norm_eps})")
        if not (math.isfinite(self.rope_theta) and self.rope_theta > 0):
            problems.append(f"rope_theta must be a positive number (got {self.rope_theta})")
        if self.rope_scaling is not None and not isinstance(self.rope_scaling, dict):
            problems.append(f"rope_scaling must be an object or null (got {self.rope_scaling!r})")
        elif self.rope_scaling:
            kind = self.rope_scaling.get("rope_type", self.rope_scaling.get("type", "default"))
            if kind not in ROPE_TYPES:
                problems.append(f"rope type {kind!r} is not supported (supported: {', '.join(ROPE_TYPES)})")
        return problems

    def _layer_problems(self) -> list[str]:
        """The target layers read, and the drafter's own layer types and window."""
        problems = []
        ids = self.target_layer_ids
        if ids is not None:
            if not ids:
                problems.append("dflash_config.target_layer_ids is empty")
            # -1: the embedding output (HF hidden_states[0]), as DeepSpec allows
            bad = [i for i in ids if i < -1 or (self.num_target_layers is not None and i >= self.num_target_layers)]
            if bad:
                problems.append(f"target_layer_ids {bad} outside the target's {self.num_target_layers} layers")
            if len(set(ids)) != len(ids):
                problems.append(f"target_layer_ids has duplicates: {ids}")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_hidden_layers:
                problems.append(f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
            odd = sorted({t for t in self.layer_types if t not in LAYER_TYPES})
            if odd:
                problems.append(f"layer_types {odd} are not supported (supported: {', '.join(LAYER_TYPES)})")
            if "sliding_attention" in self.layer_types and self.sliding_window is None:
                problems.append("sliding_attention layers need sliding_window (or dflash_config.swa_window_size)")
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int) or self.sliding_window < 1):
            problems.append(f"sliding_window must be a positive integer (got {self.sliding_window!r})")
        return problems

    # --- published layout ---------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The layout current engines read: z-lab's (`block_size`, `num_target_layers` at the
        top) and SGLang/vLLM's (`dflash_config.block_size`), plus explicit `layer_types`."""
        d: dict[str, Any] = dict(self.extra)
        types = list(self._types)
        d.update({
            "architectures": [ARCHITECTURE],
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
            "layer_types": types,
            "use_sliding_window": "sliding_attention" in types,
            "sliding_window": self.sliding_window,
            "dflash_config": {
                **({"mask_token_id": self.mask_token_id} if self.mask_token_id is not None else {}),
                **({"mask_token": self.mask_token} if self.mask_token is not None else {}),
                "block_size": self.block_size,
            },
        })
        if self.num_target_layers is not None:
            d["num_target_layers"] = self.num_target_layers
        if self.target_layer_ids is not None:
            d["dflash_config"]["target_layer_ids"] = list(self.target_layer_ids)
        if self.causal is not None:
            d["dflash_config"]["causal"] = self.causal
        elif self.sliding_causal is False and "sliding_attention" in types:
            d["dflash_config"]["causal"] = False  # full layers are non-causal in every engine: the same network
        elif self.sliding_causal and "sliding_attention" in types:
            d["sliding_window_non_causal"] = False  # stated, and what vLLM/SGLang do when nothing is said
        if self.target_hidden_size != self.hidden_size:
            d["target_hidden_size"] = self.target_hidden_size
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DrafterConfig:
        """Parse a published config (z-lab, SpecForge, SGLang/vLLM layouts), refusing by name
        every field that would make the network differ from what is built here."""
        if not isinstance(d, dict):
            raise ConfigError("config.json must hold a JSON object")
        d, layout, sliding_causal = normalize_layout(d)
        dcfg = d.get("dflash_config") or {}
        if not isinstance(dcfg, dict):
            raise ConfigError("config.json: dflash_config must be an object")
        unsupported = sorted(set(d) - _IMPLEMENTED - _METADATA - set(_FIXED))
        unsupported += [f"{k}={json.dumps(d[k])}" for k, v in _FIXED.items() if k in d and d[k] != v]
        unsupported += [f"dflash_config.{k}" for k in sorted(set(dcfg) - _DFLASH_IMPLEMENTED - set(_DFLASH_FIXED))]
        unsupported += [f"dflash_config.{k}={json.dumps(dcfg[k])}" for k, v in _DFLASH_FIXED.items()
                        if k in dcfg and dcfg[k] != v and not (v is None and not dcfg[k])]
        if d.get("model_type", "qwen3") != "qwen3":
            unsupported.append(f"model_type={json.dumps(d['model_type'])}")
        archs = d.get("architectures")
        if archs is not None and ARCHITECTURE not in (archs if isinstance(archs, list) else [archs]):
            unsupported.append(f"architectures={json.dumps(archs)}")
        if unsupported:
            raise ConfigError("config.json has fields this drafter does not implement (refused rather than drafting "
                              f"differently from the published model): {', '.join(unsupported)}")
        required = ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"]
        missing = [k for k in required if k not in d]
        if "mask_token_id" not in dcfg and "mask_token_id" not in d and not isinstance(dcfg.get("mask_token"), str):
            missing.append("dflash_config.mask_token_id (or dflash_config.mask_token)")
        if "block_size" not in d and "block_size" not in dcfg:
            missing.append("block_size (top level or dflash_config.block_size)")
        if missing:
            raise ConfigError(f"config.json is missing {', '.join(missing)}")
        try:
            fields = _parse_fields(d, dcfg)
            if sliding_causal is not None and fields["causal"] is None:
                fields["sliding_causal"] = sliding_causal
            return cls(**fields, layout=layout, extra={k: v for k, v in d.items() if k in _METADATA})
        except ConfigError:
            raise
        except (TypeError, ValueError, OverflowError, AttributeError) as e:
            raise ConfigError(f"config.json has a field of the wrong type: {e}") from e

    def save(self, directory: str | Path) -> Path:
        path = Path(directory) / "config.json"
        path.write_text(json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n")
        return path

    @classmethod
    def load(cls, directory: str | Path) -> DrafterConfig:
        path = Path(directory) / "config.json"
        try:
            data = jsonutil.loads(path.read_text())
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
                   block_size: int = 16, intermediate_size: int | None = None, **fields) -> DrafterConfig:
        """A drafter shaped for a target's (text) config: same width, heads, vocab, rope.
        `fields`: any other DrafterConfig field (layer_types, sliding_window, ...)."""
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
            **fields,
        )


# --- other trainers' and engines' layouts, read into z-lab's -------------------------------
DEEPSPEC_ARCHITECTURES = ("Qwen3DSparkModel",)
SPECULATORS_ARCHITECTURES = ("DFlashSpeculator",)
# speculators' top level that says nothing about the network (the verifier is named, not read)
_SPECULATORS_META = {"speculators_model_type", "speculators_config", "speculators_version", "verifier"}


def _plus_one_ids(ids: Any, name: str) -> list[int]:
    """Layer ids in the +1 convention (vLLM, speculators: id k is HF hidden_states[k]) as z-lab's."""
    if not isinstance(ids, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise ConfigError(f"config.json: {name} must be a list of integers (got {ids!r})")
    if any(i < 0 for i in ids):
        raise ConfigError(f"config.json: {name} {ids} has negative ids (its convention counts from "
                          "hidden_states[0], the embedding output)")
    return [i - 1 for i in ids]


def normalize_layout(d: dict[str, Any]) -> tuple[dict[str, Any], str, bool | None]:
    """(the config in z-lab's layout, the layout read, causality of sliding layers the config states).

    Each layout's fields are moved to z-lab's names; what has no z-lab meaning and changes the
    network stays under its own name, so `from_dict` refuses it by name.
    - DeepSpec (`architectures: ["Qwen3DSparkModel"]`): DSpark with `markov_rank` 0 and no
      confidence head is DFlash; `target_layer_ids` at the top (-1: the embedding output);
      `num_anchors` is a training setting.
    - speculators (`speculators_model_type: "dflash"`): the decoder in `transformer_layer_config`,
      `aux_hidden_state_layer_ids` = z-lab ids + 1, `draft_vocab_size` (a vocabulary mapping
      unless equal to the vocabulary), `sliding_window_non_causal`.
    - vLLM/SGLang: `eagle_aux_hidden_state_layer_ids` / `dspark_target_layer_ids` (+1 convention).
    - Automodel: `draft_sliding_window` (every layer slides), `projector_type` ("linear" only).
    """
    d = dict(d)
    archs = d.get("architectures")
    archs = archs if isinstance(archs, list) else [archs] if archs is not None else []
    if isinstance(d.get("dflash_config"), dict):
        d["dflash_config"] = dict(d["dflash_config"])
    dcfg: dict[str, Any] = d["dflash_config"] if isinstance(d.get("dflash_config"), dict) else {}
    layout = "z-lab"
    if "speculators_model_type" in d or "transformer_layer_config" in d or any(
            a in SPECULATORS_ARCHITECTURES for a in archs):
        layout = "speculators"
        d = _from_speculators(d)
        dcfg = d.get("dflash_config", {})
    elif any(a in DEEPSPEC_ARCHITECTURES for a in archs) or "markov_rank" in d:
        layout = "deepspec"
        _from_deepspec(d)
    if _move_plus_one_ids(d, dcfg):
        layout = "vllm" if layout == "z-lab" else layout
        dcfg = d["dflash_config"]
    if "draft_sliding_window" in d or "projector_type" in d or "projector_type" in dcfg:
        layout = "automodel" if layout == "z-lab" else layout
        _from_automodel(d, dcfg)
    sliding_causal = None
    if "sliding_window_non_causal" in d:
        flag = d.pop("sliding_window_non_causal")
        if not isinstance(flag, bool):
            raise ConfigError(f"config.json: sliding_window_non_causal must be true or false (got {flag!r})")
        sliding_causal = not flag
    return d, layout, sliding_causal


def _from_speculators(d: dict[str, Any]) -> dict[str, Any]:
    """speculators: the decoder in `transformer_layer_config`, the rest beside it."""
    if d.get("speculators_model_type", "dflash") != "dflash":
        raise ConfigError(f"config.json: speculators_model_type={json.dumps(d['speculators_model_type'])} "
                          "is not a DFlash speculator")
    inner = d.get("transformer_layer_config")
    if not isinstance(inner, dict):
        raise ConfigError("config.json: a speculators config needs transformer_layer_config (an object)")
    out = {k: v for k, v in inner.items() if k != "architectures"}
    for k, v in d.items():
        if k in _SPECULATORS_META or k in ("transformer_layer_config", "architectures"):
            continue
        if k == "aux_hidden_state_layer_ids":
            out["dflash_config"] = {**out.get("dflash_config", {}), "target_layer_ids": _plus_one_ids(v, k)}
        elif k == "draft_vocab_size":
            if v != inner.get("vocab_size"):
                out["draft_vocab_size"] = v  # a draft vocabulary mapped onto the target's: refused by name
        else:
            out[k] = v
    out["architectures"] = [ARCHITECTURE]
    return out


def _from_deepspec(d: dict[str, Any]) -> None:
    """DeepSpec's DSpark at markov_rank 0 without a confidence head is DFlash (in place)."""
    if d.get("markov_rank", 0) == 0:  # any other rank is DSpark proper (a Markov head): refused by name
        d.pop("markov_rank", None)
    for key in ("use_confidence_head", "confidence_head"):
        if key in d and not d[key]:
            d.pop(key)
    d.pop("num_anchors", None)  # anchors per training sequence: no effect on a draft
    d["architectures"] = [ARCHITECTURE]


def _move_plus_one_ids(d: dict[str, Any], dcfg: dict[str, Any]) -> bool:
    """vLLM/SGLang's layer ids (+1 convention) into `dflash_config.target_layer_ids`; whether any were there."""
    moved = False
    for name in ("eagle_aux_hidden_state_layer_ids", "dspark_target_layer_ids"):
        source = d if name in d else dcfg if name in dcfg else None
        if source is None:
            continue
        moved = True
        ids = _plus_one_ids(source.pop(name), name)
        for where, label in ((dcfg, "dflash_config.target_layer_ids"), (d, "target_layer_ids")):
            if where.get("target_layer_ids") is not None and where["target_layer_ids"] != ids:
                raise ConfigError(f"config.json: {name} (+1 convention) gives layers {ids} but {label} says "
                                  f"{where['target_layer_ids']}")
        d["dflash_config"] = dcfg = {**dcfg, "target_layer_ids": ids}
    return moved


def _from_automodel(d: dict[str, Any], dcfg: dict[str, Any]) -> None:
    """Automodel: `draft_sliding_window` (every layer slides), `projector_type` "linear" (in place)."""
    for where in (d, dcfg):
        if where.get("projector_type", "linear") == "linear":
            where.pop("projector_type", None)  # our fc: one bias-free linear map (anything else is refused)
    window = d.pop("draft_sliding_window", None)
    if window:
        if d.get("sliding_window") not in (None, window):
            raise ConfigError(f"config.json: draft_sliding_window {window} but sliding_window "
                              f"{d['sliding_window']}")
        d["sliding_window"] = window
        if d.get("layer_types") is None:
            d["layer_types"] = ["sliding_attention"] * int(d.get("num_hidden_layers", 0))


def _one(d: dict, dcfg: dict, name: str, default: Any = None) -> Any:
    """A field that may sit at the top level or in dflash_config; both must agree."""
    top, nested = d.get(name), dcfg.get(name)
    if top is not None and nested is not None and top != nested:
        raise ConfigError(f"config.json: {name} is {top} at the top level but {nested} in dflash_config")
    return nested if nested is not None else (top if top is not None else default)


def _parse_fields(d: dict, dcfg: dict) -> dict[str, Any]:
    heads = int(d["num_attention_heads"])
    if heads < 1:  # before head_dim's default divides by it
        raise ConfigError(f"config.json: num_attention_heads must be at least 1 (got {heads})")
    layers = int(d["num_hidden_layers"])
    ntl = _one(d, dcfg, "num_target_layers")
    ids = dcfg.get("target_layer_ids", d.get("target_layer_ids"))
    rope_params: object = d.get("rope_parameters") or {}  # a JSON value, checked next
    if not isinstance(rope_params, dict):
        raise ConfigError(f"config.json: rope_parameters must be an object (got {rope_params!r})")
    theta = d["rope_theta"] if "rope_theta" in d else rope_params.get("rope_theta", 1_000_000.0)
    if rope_params.get("rope_theta", theta) != theta:
        raise ConfigError(f"config.json: rope_theta is {theta} but rope_parameters.rope_theta is "
                          f"{rope_params['rope_theta']}")
    scaling = d.get("rope_scaling")
    if scaling is None and rope_params.get("rope_type", "default") != "default":  # transformers v5 layout
        scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
    elif set(rope_params) - {"rope_type", "rope_theta"}:  # e.g. partial_rotary_factor, mrope_section
        raise ConfigError("config.json has fields this drafter does not implement: rope_parameters."
                          + ", rope_parameters.".join(sorted(set(rope_params) - {"rope_type", "rope_theta"})))
    # which layers slide: explicit layer_types; else dflash_config.use_swa (every layer); else
    # transformers' Qwen3 rule (use_sliding_window and index >= max_window_layers)
    window = dcfg.get("swa_window_size", d.get("sliding_window"))
    types = d.get("layer_types")
    if types is None and dcfg.get("use_swa"):
        types = ["sliding_attention"] * layers
    elif types is None and d.get("use_sliding_window") and window is not None:
        types = ["sliding_attention" if i >= int(d.get("max_window_layers", 28)) else "full_attention"
                 for i in range(layers)]
    if types is None or "sliding_attention" not in types:
        window = None  # a window no layer uses
    causal = d.get("is_causal", dcfg.get("causal"))
    mask_id = dcfg.get("mask_token_id", d.get("mask_token_id"))
    return dict(
        hidden_size=int(d["hidden_size"]),
        intermediate_size=int(d["intermediate_size"]),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=int(d.get("num_key_value_heads", heads)),
        head_dim=int(d.get("head_dim") or int(d["hidden_size"]) // heads),
        vocab_size=int(d["vocab_size"]),
        num_target_layers=None if ntl is None else int(ntl),
        target_layer_ids=None if ids is None else [int(i) for i in ids],
        mask_token_id=None if mask_id is None else int(mask_id),
        mask_token=dcfg.get("mask_token"),
        block_size=int(_one(d, dcfg, "block_size")),
        rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)),
        rope_theta=float(theta),
        rope_scaling=scaling,
        max_position_embeddings=int(d.get("max_position_embeddings", 40960)),
        target_hidden_size=d.get("target_hidden_size"),
        torch_dtype=str(d.get("torch_dtype") or d.get("dtype") or "float32"),
        layer_types=None if types is None else [str(t) for t in types],
        sliding_window=None if window is None else int(window),
        causal=None if causal is None else bool(causal),
    )
