"""The eval job's schema: the versioned JSON payload, validated into a frozen model.

A job is plain JSON data (it travels through RQ's ``JSONSerializer``; nothing is ever
pickled). Layout, per docs/design.md::

    {"schema": "dflash-eval-job/1", "run_id": "...", "step": 100,
     "checkpoint": "/abs/path/step-00000100", "checkpoint_digest": "<sha256>",
     "target": "/abs/path/target", "suite": "builtin:coding-v1", "baseline": null,
     "wandb": {"project": ..., "group": ..., "entity": null, "mode": "offline"},
     "requested_by": "hook", "priority": "default", "attempt": 0,
     "train_metrics": {...}, "options": {...}}

The same :func:`validate_job` (one pydantic schema, :class:`JobPayload`, with the options'
:class:`~eval_worker.engine.options.EvalOptions`) runs before a job is enqueued and again when a worker
takes it, and returns the frozen :class:`JobPayload` the service passes around; `to_json()` gives the
JSON data back where the job leaves the process. Every failure raises :class:`JobError` whose
message is the reason.

`checkpoint` and `baseline` may be URLs of an object store (`s3://bucket/runs/<run>/step-…`,
dflash_train/checkpoints/storage.py; rules in eval_worker/service/jobs/checkpoints.py).
"""
from __future__ import annotations

import json
import os
import re
from functools import cached_property
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from dflash_train.checkpoints.location import CheckpointRef
from dflash_train.checkpoints.publication import RUN_ID_PATTERN, RUN_ID_RULE, valid_run_id
from dflash_train.common.errors import DFlashError, StoreError
from dflash_train.common.settings import KNOWN_SINKS as SINK_NAMES
from eval_worker.engine.options import MAX_NAME, MAX_SHOWN, EvalOptions, OptionsError, describe_one, shorten

SCHEMA = "dflash-eval-job/1"

PRIORITIES = ("high", "default", "low")
REQUESTERS = ("hook", "user", "requeue")


class JobError(DFlashError, ValueError):
    """A job that cannot be enqueued or run; the message is the reason."""


# --------------------------------------------------------------------------- schema

# Size limits: a job is a few hundred bytes; anything near these is a mistake or an attack,
# refused before it is pinned, hashed, stored in Redis or shown by `status`.
MAX_PATH = 4096            # checkpoint, target, baseline, suite (PATH_MAX)
# MAX_NAME (eval_worker.engine.options): W&B project/group/entity/name, each tag, each metric name
MAX_TAGS = 64
MAX_METRICS = 256
MAX_PAYLOAD_BYTES = 256 * 1024

_Name = Annotated[str, StringConstraints(max_length=MAX_NAME)]
# an int stays an int (`1`, not `1.0`, in the job's JSON)
_FiniteNumber = int | Annotated[float, Field(allow_inf_nan=False)]


def _abs_path(value: str) -> str:
    if "\x00" in value:
        raise ValueError("contains a NUL byte")
    if not os.path.isabs(value):
        raise ValueError("must be an absolute path")
    return value


_AbsPath = Annotated[str, StringConstraints(min_length=1, max_length=MAX_PATH), AfterValidator(_abs_path)]


def _location(value: str) -> str:
    if "\x00" in value:
        raise ValueError("contains a NUL byte")
    try:
        ref = CheckpointRef.parse(value)
    except StoreError as e:
        raise ValueError(str(e)) from None
    if ref.on_this_machine:
        return _abs_path(value)
    if ref.text != value:
        raise ValueError("must be in canonical form (no trailing '/')")
    if ref.kind == "hub" and not re.fullmatch(r"hf://[^/@]+/[^/@]+@[0-9a-f]{40}", value):
        raise ValueError("a Hub checkpoint must name a commit: hf://ORG/REPO@<40-hex sha>")
    return value


# a checkpoint: an absolute path, or an object-store URL (never one with credentials in it)
_Location = Annotated[str, StringConstraints(min_length=1, max_length=MAX_PATH), AfterValidator(_location)]


def _run_id(value: str) -> str:
    if not valid_run_id(value):
        raise ValueError(RUN_ID_RULE)
    return value


class WandbSettings(BaseModel):
    """The job's `wandb` object (the worker's WANDB_MODE wins over `mode`)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    project: _Name | None = None
    group: _Name | None = None
    entity: _Name | None = None
    mode: Literal["online", "offline", "disabled"] | None = None
    name: _Name | None = None
    tags: list[_Name] | None = Field(None, max_length=MAX_TAGS)


class MlflowSettings(BaseModel):
    """The job's `mlflow` object: the experiment, or the trainer's run to nest the eval run under."""

    model_config = ConfigDict(extra="forbid", strict=True)

    experiment: _Name | None = None
    parent_run_id: Annotated[str, StringConstraints(pattern=r"^[0-9a-zA-Z_-]{1,64}$")] | None = None


class JobPayload(BaseModel):
    """A validated job (`dflash-eval-job/1`): types, ranges and sizes of every field, `options` included.

    Frozen: made by :func:`validate_job` only, read by attribute through the service; turned back
    into JSON data (:meth:`to_json`) only where it leaves the process (the RQ argument, the ledger
    record, the outbox file)."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False, frozen=True)

    schema_: Literal["dflash-eval-job/1"] = Field(alias="schema")
    run_id: Annotated[str, StringConstraints(pattern=rf"^{RUN_ID_PATTERN}$"), AfterValidator(_run_id)]
    step: int = Field(ge=0, le=(1 << 53))
    checkpoint: _Location
    checkpoint_digest: Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{64}$")]
    target: _AbsPath | None = None
    suite: Annotated[str, StringConstraints(min_length=1, max_length=MAX_PATH, pattern=r"\S")]
    baseline: _Location | None = None
    wandb: WandbSettings | None = None
    mlflow: MlflowSettings | None = None
    sinks: list[Literal[SINK_NAMES]] | None = Field(None, max_length=len(SINK_NAMES))  # type: ignore[valid-type]
    requested_by: Literal[REQUESTERS] = "user"  # type: ignore[valid-type]
    priority: Literal[PRIORITIES] = "default"  # type: ignore[valid-type]
    attempt: int = Field(0, ge=0, le=1_000_000)
    train_metrics: dict[_Name, _FiniteNumber] | None = Field(None, max_length=MAX_METRICS)
    options: dict[str, Any] | None = None  # checked by EvalOptions (eval_worker.engine.options), the engine's schema

    @cached_property
    def checkpoint_ref(self) -> CheckpointRef:
        """The checkpoint's location as a value (it parsed when the job was validated; parsed once more here)."""
        return CheckpointRef.parse(self.checkpoint)

    @cached_property
    def baseline_ref(self) -> CheckpointRef | None:
        return CheckpointRef.parse(self.baseline) if self.baseline else None

    def to_json(self) -> dict[str, Any]:
        """The job as JSON data, exactly the fields it was validated with (defaults filled in;
        a nested object keeps only the keys it was given), so wire and disk stay as they were."""
        return self.model_dump(mode="json", by_alias=True, exclude_unset=True)

    def replace(self, **changes: Any) -> JobPayload:
        """A copy with `changes`, validated again (a frozen job is never edited in place)."""
        return validate_job({**self.to_json(), **changes})


# Read off the schema: the fields a job may carry, those it must, the defaults of the others.
FIELDS = {f.alias or name for name, f in JobPayload.model_fields.items()}
REQUIRED = tuple(f.alias or name for name, f in JobPayload.model_fields.items() if f.is_required())
DEFAULTS: dict[str, Any] = {name: f.default for name, f in JobPayload.model_fields.items() if not f.is_required()}
WANDB_FIELDS = set(WandbSettings.model_fields)

# How each top-level field is described when it is wrong (the offending value is shortened).
_FIELD_RULES = {
    "run_id": f"run_id must be {RUN_ID_RULE}",
    "step": "step must be a non-negative integer",
    "checkpoint": (f"checkpoint must be an absolute path or a store URL (s3://bucket/prefix/..., no credentials, "
                   f"no '..'; hf://ORG/REPO@<commit>) of at most {MAX_PATH} characters without NUL bytes"),
    "target": f"target must be null or an absolute path of at most {MAX_PATH} characters without NUL bytes",
    "baseline": f"baseline must be null, an absolute path or a store URL of at most {MAX_PATH} characters",
    "checkpoint_digest": "checkpoint_digest must be 64 lowercase hex characters (sha256)",
    "suite": f"suite must be a non-empty string of at most {MAX_PATH} characters",
    "requested_by": f"requested_by must be one of {list(REQUESTERS)}",
    "priority": f"priority must be one of {list(PRIORITIES)}",
    "attempt": "attempt must be a non-negative integer",
    "train_metrics": (f"train_metrics must be null or an object of at most {MAX_METRICS} finite numbers "
                      f"named by at most {MAX_NAME} characters"),
    "options": "options must be an object or null",
}


def _problems(error: ValidationError, payload: dict[str, Any]) -> list[str]:
    out, seen = [], set()
    for e in error.errors(include_url=False, include_input=False):
        field = str(e["loc"][0]) if e["loc"] else ""
        if field in _FIELD_RULES:
            if field not in seen:
                seen.add(field)
                out.append(f"{_FIELD_RULES[field]}, got {shorten(payload.get(field))}")
            continue
        line = describe_one(e)
        if e["type"] == "extra_forbidden" and field == "wandb":
            line += f" (known: {sorted(WANDB_FIELDS)})"
        out.append(line)
    return out


def validate_job(payload: Any) -> JobPayload:  # noqa: C901 - one refusal per way a payload can be wrong
    """Check a job payload (JSON text or data) against the schema; return the validated job (defaults filled).

    One schema, run by `enqueue` and again by the worker: the types, ranges and sizes of
    every field (:class:`JobPayload`) and of every option (eval_worker.engine.options.EvalOptions,
    the engine's own). No filesystem access: see `jobs.checkpoints.check_checkpoint` for that.
    """
    if isinstance(payload, JobPayload):
        return payload  # made here: frozen, valid
    if isinstance(payload, (str, bytes)):
        if len(payload) > MAX_PAYLOAD_BYTES:
            raise JobError(f"job payload is {len(payload)} bytes; the limit is {MAX_PAYLOAD_BYTES}")
        try:
            payload = json.loads(payload)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise JobError(f"job payload is not valid JSON: {e}") from None
    if not isinstance(payload, dict):
        raise JobError(f"job payload must be a JSON object, got {type(payload).__name__}")
    schema = payload.get("schema")
    if schema != SCHEMA:
        if schema is None:
            raise JobError(f"job payload has no 'schema' field (expected {SCHEMA!r})")
        raise JobError(f"unknown job schema version {shorten(schema)}; this worker understands {SCHEMA!r}")
    missing = [k for k in REQUIRED if payload.get(k) in (None, "")]
    if missing:
        raise JobError(f"job payload is missing required field(s): {', '.join(missing)}")
    unknown = sorted(k[:MAX_SHOWN] if isinstance(k, str) else repr(k) for k in set(payload) - FIELDS)
    if unknown:
        raise JobError(f"job payload has unknown field(s) {unknown[:10]} for schema {SCHEMA!r}")
    data = {**DEFAULTS, **payload}
    problems: list[str] = []
    validated = None
    try:
        validated = JobPayload.model_validate(data)
    except ValidationError as e:
        problems += _problems(e, data)
    if isinstance(data["options"], dict):
        try:
            EvalOptions.from_dict(data["options"])
        except OptionsError as e:
            problems.append(str(e))
    if problems:
        raise JobError("invalid job: " + "; ".join(problems))
    try:  # JSON data only: a payload that does not round-trip is refused here, not in RQ
        size = len(json.dumps(data, allow_nan=False))
    except (TypeError, ValueError) as e:
        raise JobError(f"job payload is not plain JSON data: {shorten(str(e))}") from None
    if size > MAX_PAYLOAD_BYTES:
        raise JobError(f"job payload is {size} bytes; the limit is {MAX_PAYLOAD_BYTES}")
    assert validated is not None  # no problems: the model validated
    return validated
