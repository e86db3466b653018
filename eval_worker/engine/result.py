"""The eval result: typed, versioned, JSON in and out (docs/design.md "Eval result").

`EvalResult.to_dict()` is the `dflash-eval-result/1` layout the ledger, the W&B sink and
the report read. Keys beyond the design's list (`stride`, `validation`, extra per-prompt
fields) are additive: readers of version 1 ignore them.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from dflash_train.common.errors import DFlashError

SCHEMA = "dflash-eval-result/1"
SEVERITIES = ("info", "warning", "error")


class ResultSchemaError(DFlashError, ValueError):
    """A dict that is not a readable dflash-eval-result/1."""


@dataclass
class Diagnostic:
    code: str
    severity: str
    message: str

    def __post_init__(self) -> None:
        if self.severity not in SEVERITIES:
            raise ValueError(f"severity must be one of {SEVERITIES}, got {self.severity!r}")


@dataclass
class PromptResult:
    name: str
    tau: float | None
    accept_lengths: list[int]
    baseline_tau: float | None = None
    reference_text: str = ""
    accepted_spans: list[list[int]] = field(default_factory=list)  # [char start, char end) per verify step
    num_tokens: int = 0
    finish: str = ""
    tree_tau: float | None = None
    mean_streak: float | None = None
    reference_agrees_with_target: bool | None = None
    degenerate: str | None = None  # why the reference collapsed (diagnostics.reference_collapse), else None


@dataclass
class EvalResult:
    checkpoint: dict[str, Any]
    target: dict[str, Any]
    suite: dict[str, Any]
    settings: dict[str, Any]
    tau: dict[str, Any]
    acceptance_histogram: list[int]
    per_position: dict[str, Any]
    mean_streak_all_anchors: float | None
    tree: dict[str, Any]
    speedup: dict[str, Any]
    baseline: dict[str, Any] | None
    prompts: list[PromptResult]
    diagnostics: list[Diagnostic]
    cache: dict[str, Any]
    provenance: dict[str, Any]
    stride: dict[str, Any] = field(default_factory=dict)
    validation: dict[str, Any] | None = None
    leak_probe: dict[str, Any] | None = None  # eval_worker.engine.leak_probe: per-slot top-1 of the three views
    sampling: dict[str, Any] | None = None  # τ at options.temperatures (docs/design.md, "Sampling")
    schema: str = SCHEMA

    # --- views ----------------------------------------------------------------
    def errors(self) -> list[Diagnostic]:
        return [d for d in self.diagnostics if d.severity == "error"]

    def diagnostic_codes(self) -> list[str]:
        return [d.code for d in self.diagnostics]

    # --- JSON -------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        order = ["schema"] + [f.name for f in dataclasses.fields(self) if f.name != "schema"]
        return {k: d[k] for k in order}

    def to_json(self, **kw) -> str:
        return json.dumps(self.to_dict(), allow_nan=False, **kw)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EvalResult:
        if not isinstance(d, dict):
            raise ResultSchemaError("an eval result must be a JSON object")
        if d.get("schema") != SCHEMA:
            raise ResultSchemaError(f"schema is {d.get('schema')!r}, this reader understands {SCHEMA!r}")
        names = {f.name for f in dataclasses.fields(cls)}
        required = {f.name for f in dataclasses.fields(cls)
                    if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING}
        missing = sorted(required - set(d))
        if missing:
            raise ResultSchemaError(f"eval result is missing {missing}")
        kw = {k: v for k, v in d.items() if k in names}
        pnames = {f.name for f in dataclasses.fields(PromptResult)}
        try:
            kw["prompts"] = [PromptResult(**{k: v for k, v in p.items() if k in pnames}) for p in d["prompts"]]
            kw["diagnostics"] = [Diagnostic(**x) for x in d["diagnostics"]]
        except (TypeError, ValueError) as e:
            raise ResultSchemaError(f"malformed prompts/diagnostics: {e}") from None
        return cls(**kw)

    @classmethod
    def from_json(cls, text: str) -> EvalResult:
        return cls.from_dict(json.loads(text))
