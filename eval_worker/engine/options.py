"""Eval options: the one schema of a job's `options`, checked at enqueue, at the worker and in the engine.

A job's `options` (docs/design.md) are plain JSON. :class:`EvalOptions` (pydantic, strict:
a number is never a string, a flag is never a number) gives every option its type and
range, and refuses unknown keys, so a typo or a 10 MB string is refused by `enqueue`
before anything is pinned or hashed, and again by the worker before anything is loaded.

:meth:`EvalOptions.identity` is the part of the options that changes a recorded number
(the ledger record's identity and the job id fold it in); options that only change how
the work is done (`anchors_per_chunk`, `head_rows`, `backend`) are left out, and so are
options equal to their default, so `{}` and `{"tree_budget": 8}` name the same evaluation.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from dflash_train.common.errors import DFlashError
from dflash_train.core.tau import COUNTING_RULES

# How the work is done, not what is measured: not part of an evaluation's identity.
PERFORMANCE_ONLY = frozenset({"anchors_per_chunk", "head_rows", "backend", "drafting", "reference_drafter"})
MAX_SHOWN = 80  # characters of an offending value quoted in an error
DEFAULT_LEAK_PROBE_ANCHORS = 256  # anchors over the whole suite the leak probe drafts again
DEFAULT_ANCHOR_SAMPLE = 512  # anchors over the whole suite behind the statistics over every anchor
MAX_TEMPERATURES = 16
# Size limits shared by job options and suite files (eval_worker.engine.suite), so a suite
# cannot ask for what an option may not
MAX_NEW_TOKENS = 1 << 16
MAX_PROMPTS = 1 << 20
MAX_NAME = 256  # a job's W&B names, tags and metric names; a suite's name, version and prompt names
SAMPLING_ONLY = ("top_p", "top_k", "num_samples")  # meaningless without temperatures


def temperature_key(temperature: float) -> str:
    """How a temperature names its block of the result, its W&B keys and report series: `0.7`, `1`."""
    return f"{temperature:g}"


class OptionsError(DFlashError, ValueError):
    """Options that cannot be used; the message lists every problem (values shortened)."""


def shorten(value: Any, limit: int = MAX_SHOWN) -> str:
    """`repr(value)` cut to `limit` characters (an error never echoes a huge input)."""
    text = repr(value) if not isinstance(value, str) or len(value) <= limit else repr(value[:limit])
    if len(text) > limit + 2:
        text = text[:limit] + "..."
    if isinstance(value, (str, bytes, list, dict)) and len(value) > limit:
        text += f" ({len(value)} {'characters' if isinstance(value, str) else 'items'})"
    return text


def describe_one(e: Mapping[str, Any], prefix: str = "") -> str:
    """One pydantic error (from `.errors()`) as `<where> must be ...`; the input is not echoed."""
    where = prefix + ".".join(str(x) for x in e["loc"]) if e["loc"] else prefix.rstrip(".") or "value"
    msg = e["msg"].removeprefix("Value error, ")
    if e["type"] == "extra_forbidden":
        return f"{where} is an unknown field"
    if msg.startswith("Input should be "):
        return f"{where} must be " + msg.removeprefix("Input should be ")
    if msg.startswith(("String should", "List should", "Dictionary should")):
        return f"{where} must" + msg.split(" should", 1)[1]
    return f"{where}: {msg}"


def describe(error: ValidationError, prefix: str = "") -> list[str]:
    """One short line per problem of a pydantic error (see `describe_one`)."""
    return [describe_one(e, prefix) for e in error.errors(include_url=False, include_input=False)]


def _int(lo: int, hi: int, default=None):
    return Field(default, ge=lo, le=hi)


class EvalOptions(BaseModel):
    """Job options (`options` of the eval job); unknown keys are an error, not ignored."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)

    max_new_tokens: int | None = _int(1, MAX_NEW_TOKENS)   # default: the suite's
    tree_budget: int = _int(0, 4096, 8)
    tree_spine: bool = False
    mode: Literal["online", "stride"] = "online"
    counting: str = Field("response", max_length=32)       # dflash_train.core.tau.COUNTING_RULES
    num_prompts: int | None = _int(1, MAX_PROMPTS)
    max_blocks: int | None = _int(1, 1 << 24)
    validate_loop: bool = Field(False, alias="validate")  # `validate` is a BaseModel method name
    bootstrap: int = _int(1, 1 << 20, 2000)
    seed: int = _int(0, (1 << 32) - 1, 0)
    chat_template: bool | None = None                     # default: the suite's
    eos_token_id: int | None = _int(0, (1 << 31) - 1)     # default: the tokenizer's / generation config's
    draft_verify_cost_ratio: float | None = Field(None, gt=0, le=1000)  # from the serving hardware
    measure_speed: bool = True
    anchors_per_chunk: int | None = _int(1, 1 << 24)
    head_rows: int | None = _int(1, 1 << 24)               # default: eval_worker.engine.drafting's
    backend: Literal["auto", "flex", "sdpa"] = "auto"
    # sliding layers a drafter config leaves without a causal flag: drafted as the serving engines
    # do (vLLM/SGLang: causal within the block) or as z-lab's reference loop (non-causal, windowed)
    sliding_rule: Literal["serving", "reference"] = "serving"
    # "walk": draft only the blocks the walks visit, each up to its first miss (eval_worker.engine.walk);
    # "all": a block at every anchor (drafting.draft_anchors); "auto": the cheaper by measured cost.
    # The same numbers either way.
    drafting: Literal["auto", "walk", "all"] = "auto"
    # missing greedy references decoded by lossless greedy speculative decoding with this drafter (the
    # evaluated "checkpoint" or the "baseline"), or "none": plainly. The same references either way, each
    # checked against the target's argmax (eval_worker.engine.decoding); local references only
    reference_drafter: Literal["checkpoint", "baseline", "none"] = "checkpoint"
    # mean streak over all anchors and per-slot top-1 accuracy come from this many anchors over the
    # suite, a fixed sample seeded by `seed` (every anchor when the suite has no more)
    anchor_sample: int = _int(1, 1 << 24, DEFAULT_ANCHOR_SAMPLE)
    # a server reference that is not the target's own greedy output: "fail" the job (nothing is
    # cached), or "measure" τ on that text anyway (flagged REFERENCE_NOT_TARGET_GREEDY)
    reference_mismatch: Literal["fail", "measure"] = "fail"
    leak_probe_anchors: int = _int(0, 1 << 20, DEFAULT_LEAK_PROBE_ANCHORS)  # eval_worker.engine.leak_probe; 0: off
    # τ under sampling (docs/design.md "Sampling"): per temperature, `num_samples` keyed samples of the
    # target per prompt (draws keyed by `seed`, prompt, sample, position); greedy τ is always measured
    temperatures: list[Annotated[float, Field(gt=0, le=100)]] = Field(default_factory=list, max_length=MAX_TEMPERATURES)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = _int(0, 1 << 24, 0)                       # 0: off
    num_samples: int = _int(1, 1024, 1)

    @field_validator("counting")
    @classmethod
    def _known_counting(cls, value: str) -> str:
        if value not in COUNTING_RULES:
            raise ValueError(f"must be one of {list(COUNTING_RULES)}")
        return value

    @model_validator(mode="after")
    def _counting_is_for_the_online_walk(self) -> EvalOptions:
        if self.counting != "response" and self.mode == "stride":
            raise ValueError("counting applies to the online walk; stride mode drafts fixed blocks")
        return self

    @model_validator(mode="after")
    def _sampling_needs_temperatures(self) -> EvalOptions:
        if len(set(self.temperatures)) != len(self.temperatures):
            raise ValueError("temperatures must not repeat")
        if not self.temperatures:
            given = [k for k in SAMPLING_ONLY if getattr(self, k) != type(self).model_fields[k].default]
            if given:
                raise ValueError(f"{', '.join(given)} {'applies' if len(given) == 1 else 'apply'} to sampled "
                                 "evaluation: give temperatures too (greedy τ is always measured)")
        return self

    @property
    def validate(self) -> bool:  # type: ignore[override]  # the option's name, as jobs spell it
        return self.validate_loop

    @classmethod
    def from_dict(cls, d: dict[str, Any] | None) -> EvalOptions:
        """Check `d` (a job's `options`, or None); raise OptionsError naming every problem."""
        if d is not None and not isinstance(d, dict):
            raise OptionsError(f"options must be an object or null, got {type(d).__name__}")
        d = dict(d or {})
        unknown = sorted(k for k in d if k not in cls.known())
        if unknown:
            raise OptionsError(f"unknown eval options {[k[:MAX_SHOWN] for k in unknown][:10]} "
                               f"(known: {sorted(cls.known())})")
        try:
            return cls.model_validate(d)
        except ValidationError as e:
            raise OptionsError("invalid eval options: " + "; ".join(describe(e, "options."))) from None

    @classmethod
    def known(cls) -> set[str]:
        return {f.alias or name for name, f in cls.model_fields.items()}

    def to_dict(self) -> dict[str, Any]:
        """Every option with its value, as a job spells it."""
        return self.model_dump(by_alias=True)

    def identity(self) -> dict[str, Any]:
        """The options that change a recorded number and differ from their default."""
        return {k: v for k, v in self.model_dump(by_alias=True, exclude_defaults=True).items()
                if k not in PERFORMANCE_ONLY}


def options_identity(options: dict[str, Any] | None) -> dict[str, Any]:
    """`EvalOptions.from_dict(options).identity()` (raises OptionsError for bad options)."""
    return EvalOptions.from_dict(options).identity()
