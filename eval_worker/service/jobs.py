"""Eval jobs: the versioned JSON payload, its validation, deterministic ids, path confinement.

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
takes it; :func:`check_checkpoint` then checks the directory itself (inside the
configured roots after resolving symlinks, completion marker present, digest equal).
Every failure raises :class:`JobError` whose message is the reason.

`checkpoint` and `baseline` may be URLs of an object store (`s3://bucket/runs/<run>/step-…`,
dflash_train/checkpoints/storage.py): confined to the store prefixes among the worker's checkpoint
roots, their marker read from the store, and the worker evaluates a local copy pulled into
its cache and verified file by file (:func:`materialize`).
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from dflash_train.checkpoints import storage
from dflash_train.checkpoints.publication import (
    MARKER_NAME,
    RUN_ID_PATTERN,
    RUN_ID_RULE,
    CheckpointError,
    files_dir,
    parse_manifest,
    read_manifest,
    read_marker,
    valid_run_id,
    verify_checkpoint,
    within,
)
from dflash_train.common.errors import DFlashError
from dflash_train.common.settings import KNOWN_SINKS as SINK_NAMES
from eval_worker.engine.options import (
    MAX_NAME,
    MAX_SHOWN,
    EvalOptions,
    OptionsError,
    describe_one,
    options_identity,
    shorten,
)
from eval_worker.engine.suite import HF_PREFIX, SuiteError, parse_hf_spec, request_fingerprint

SCHEMA = "dflash-eval-job/1"

PRIORITIES = ("high", "default", "low")
REQUESTERS = ("hook", "user", "requeue")

_JOB_ID_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")


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
_FiniteNumber = Annotated[float, Field(allow_inf_nan=False)]


def _abs_path(value: str) -> str:
    if "\x00" in value:
        raise ValueError("contains a NUL byte")
    if not os.path.isabs(value):
        raise ValueError("must be an absolute path")
    return value


_AbsPath = Annotated[str, StringConstraints(min_length=1, max_length=MAX_PATH), AfterValidator(_abs_path)]


def _location(value: str) -> str:
    if storage.is_url(value):
        try:
            if storage.check_url(value) != value:
                raise ValueError("must be in canonical form (no trailing '/')")
        except storage.StoreError as e:
            raise ValueError(str(e)) from None
        if value.startswith("hf://") and not re.fullmatch(r"hf://[^/@]+/[^/@]+@[0-9a-f]{40}", value):
            raise ValueError("a Hub checkpoint must name a commit: hf://ORG/REPO@<40-hex sha>")
        return value
    return _abs_path(value)


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
    """The job schema (`dflash-eval-job/1`): types, ranges and sizes of every field, `options` included."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

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


def validate_job(payload: Any) -> dict[str, Any]:
    """Check a job payload against the schema; return a normalised copy (defaults filled).

    One schema, run by `enqueue` and again by the worker: the types, ranges and sizes of
    every field (:class:`JobPayload`) and of every option (eval_worker.engine.options.EvalOptions,
    the engine's own). No filesystem access: see :func:`check_checkpoint` for that.
    """
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
    job = {**DEFAULTS, **payload}
    problems: list[str] = []
    try:
        JobPayload.model_validate(job)
    except ValidationError as e:
        problems += _problems(e, job)
    if isinstance(job["options"], dict):
        try:
            EvalOptions.from_dict(job["options"])
        except OptionsError as e:
            problems.append(str(e))
    if problems:
        raise JobError("invalid job: " + "; ".join(problems))
    try:  # JSON data only: a payload that does not round-trip is refused here, not in RQ
        size = len(json.dumps(job, allow_nan=False))
    except (TypeError, ValueError) as e:
        raise JobError(f"job payload is not plain JSON data: {shorten(str(e))}") from None
    if size > MAX_PAYLOAD_BYTES:
        raise JobError(f"job payload is {size} bytes; the limit is {MAX_PAYLOAD_BYTES}")
    return job


# --------------------------------------------------------------------------- ids

def _safe_part(text: str) -> str:
    """`text` with characters RQ refuses in job ids replaced; a short hash keeps it unique."""
    safe = _JOB_ID_UNSAFE.sub("_", text)
    if safe != text:
        safe += "_" + hashlib.sha256(text.encode()).hexdigest()[:6]
    return safe


def base_job_id(run_id: str, step: int, digest: str, suite_fp: str) -> str:
    """`eval-<run>-<step>-<digest[:12]>-<suitefp[:8]>`: one id per distinct evaluation."""
    return f"eval-{_safe_part(run_id)}-{int(step)}-{digest[:12]}-{_safe_part(suite_fp[:8])}"


def job_id_for(job: dict[str, Any], suite_fp: str) -> str:
    """The RQ job id of `job`: the base id, plus `-r<attempt>` for forced re-evaluations."""
    base = base_job_id(job["run_id"], job["step"], job["checkpoint_digest"], suite_fp)
    return base if not job.get("attempt") else f"{base}-r{int(job['attempt'])}"


def canonical_target(target: str | os.PathLike) -> str:
    """One spelling per target directory (symlinks, `..` and trailing slashes resolved), so that
    `--target ./t/`, `--target /abs/t` and a worker's own `--target t` name the same job."""
    return os.path.realpath(os.fspath(target))


def suite_fingerprint(suite: str, options: dict[str, Any] | None = None, target: str | None = None,
                      baseline: str | None = None) -> str:
    """Identity of what a job evaluates (its job id's last part): the suite's fingerprint
    (eval_worker.engine.suite), folded with the options that change a result (EvalOptions.identity:
    non-default, not performance-only), the job's `target` and its `baseline` (Δτ is part of the
    result) when it has any."""
    try:
        fp = request_fingerprint(suite)  # an hf: suite: its request, so no dataset is read here
    except (OSError, ValueError, KeyError) as e:
        raise JobError(f"unknown or unreadable suite {shorten(suite)}: {shorten(str(e), 300)}") from None
    try:
        options = options_identity(options)
    except OptionsError as e:
        raise JobError(str(e)) from None
    if options or target or baseline:
        spec = {"suite": fp, "options": options, **({"target": target} if target else {}),
                **({"baseline": baseline} if baseline else {})}
        fp = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]
    return fp


def job_fingerprint(job: dict[str, Any]) -> str:
    """`suite_fingerprint` of a job's suite, options, target and baseline."""
    return suite_fingerprint(job["suite"], job.get("options"), job.get("target"), job.get("baseline"))


def strip_attempt(job_id: str) -> str:
    """The base id of a job id (`...-r3` -> `...`)."""
    return re.sub(r"-r\d+$", "", job_id)


# --------------------------------------------------------------------------- roots

def confine(path: str | os.PathLike, roots: Sequence[Path | str], what: str = "checkpoint",
            how: str = "--checkpoint-root or $DFLASH_CHECKPOINT_ROOTS") -> Path:
    """The real path of `path` if it lies inside one of `roots` (symlinks resolved), else JobError.
    A store URL must lie under one of the URL prefixes among `roots`."""
    if storage.is_url(path):
        url = storage.within_prefixes(str(path), roots)
        if url is None:
            prefixes = [str(r) for r in roots if storage.is_url(r)]
            raise JobError(f"{storage.redact(str(path))} is outside the {what} prefixes this worker serves "
                           f"({', '.join(prefixes) or 'none: only local roots are configured'}); add its prefix with "
                           f"{how} (e.g. s3://bucket/runs)")
        return url  # type: ignore[return-value]
    real = within(path, [r for r in roots if isinstance(r, Path)])
    if real is not None:
        return real
    real = Path(os.path.realpath(path))
    shown = os.pathsep.join(str(r) for r in roots if isinstance(r, Path))
    if str(real) != os.path.abspath(path):
        raise JobError(f"{path} resolves to {real}, outside the {what} roots ({shown}); "
                       "a symlink may not lead out of the roots")
    raise JobError(f"{path} is outside the {what} roots ({shown}); add its root with {how}")


def check_target(target: str, default_target: str | None, target_roots: Sequence[Path | str] | None,
                 checkpoint_roots: Sequence[Path | str]) -> None:
    """A job may name the worker's own target, or one inside the target roots.

    Loading a target reads gigabytes and runs its tokenizer/config code paths, so a job may
    not point the worker at any directory it likes. Without target roots configured, the
    checkpoint roots stand in for them.
    """
    if default_target and os.path.realpath(target) == os.path.realpath(default_target):
        return
    if target_roots is not None:
        confine(target, target_roots, "target", "--target-root or $DFLASH_TARGET_ROOTS")
    else:
        confine(target, checkpoint_roots, "checkpoint",
                "--target-root or $DFLASH_TARGET_ROOTS (targets other than the worker's own --target must lie "
                "in a target root, or in a checkpoint root when no target root is set)")


def check_suite(suite: str, suite_roots: Sequence[Path | str] | None,
                checkpoint_roots: Sequence[Path | str] | None) -> str:
    """The suite a worker may load for a job: `builtin:NAME` (or a bare built-in name), a
    standard benchmark `hf:NAME[:...]` (read from the worker's dataset copies or the datasets
    cache, never from a path the job names), or a file whose real path lies in the suite roots
    (default: the checkpoint roots). Returns the spec to load (a bare name gets its `builtin:`
    prefix; a file its real path).

    A job comes from whoever can reach the queue, and a suite is read and parsed on the
    worker, so its path is confined like checkpoints and targets. Anything else fails with
    one message, whatever the path is (missing, unreadable, a directory, outside the roots,
    a symlink out): the reply tells nothing about the worker's files.
    """
    if isinstance(suite, str) and suite.startswith("builtin:"):
        return suite
    if isinstance(suite, str) and suite.startswith(HF_PREFIX):  # a standard benchmark: no path of the worker's
        try:
            return parse_hf_spec(suite).canonical
        except SuiteError as e:
            raise JobError(str(e)) from None
    if isinstance(suite, str) and suite and "/" not in suite and "\x00" not in suite and not suite.endswith(".jsonl"):
        return "builtin:" + suite  # a bare name: never looked up relative to the worker's working directory
    roots = suite_roots if suite_roots is not None else checkpoint_roots
    refused = JobError(f"suite {shorten(suite)} is not available on this worker: name a built-in suite "
                       "(builtin:NAME) or a suite file under the worker's suite roots "
                       "(--suite-root / $DFLASH_SUITE_ROOTS; default: the checkpoint roots)")
    if (not roots or not isinstance(suite, str) or len(suite) > MAX_PATH or "\x00" in suite
            or not os.path.isabs(suite)):
        raise refused
    real = within(suite, roots)
    if real is None or not real.is_file():
        raise refused
    return str(real)


# --------------------------------------------------------------------------- checkpoints

def check_checkpoint(job: dict[str, Any], roots: Sequence[Path | str] | None, *,
                     verify_digest: bool = False) -> dict[str, dict[str, Any]]:
    """Check the job's checkpoint on disk; return the manifests read, keyed by real path.

    - inside `roots` after resolving symlinks (skipped when `roots` is None);
    - a directory with a valid COMPLETE.json whose digest, run and step match the job;
    - with `verify_digest`, every listed file hashed again, each inside the roots (the
      worker does this, once per job: the engine is handed the verified manifests).
    The same is done for `baseline` when the job names one. A store URL is checked by its
    marker only (confined to the store prefixes); `materialize` pulls and verifies its files.
    """
    path, manifest = _check_one(job["checkpoint"], roots, verify_digest, "checkpoint")
    _match_job(job, manifest)
    manifests = {path: manifest}
    if job.get("baseline"):
        base_path, base = _check_one(job["baseline"], roots, verify_digest, "baseline")
        manifests[base_path] = base
    return manifests


def _check_one(path: str, roots: Sequence[Path | str] | None, verify_digest: bool, what: str) -> tuple[str,
                                                                                                       dict[str, Any]]:
    if storage.is_url(path):
        url, _, manifest = _check_remote(path, roots, what)
        return url, manifest
    if roots is not None:
        confine(path, roots)
    real = os.path.realpath(path)
    if not os.path.isdir(real):
        raise JobError(f"{what}: checkpoint {path} does not exist or is not a directory")
    try:
        manifest = read_manifest(real)
    except CheckpointError as e:
        hint = ""
        if not os.path.exists(os.path.join(real, MARKER_NAME)) and os.path.isfile(os.path.join(real, "config.json")):
            hint = ("; a drafter trained elsewhere (a z-lab release, a SpecForge output, a Hugging Face snapshot) "
                    f"is evaluated through an import record: `dflash-eval import {path}` (or `enqueue --external`)")
        raise JobError(f"{what}: checkpoint {path} is not published: {e}{hint}") from None
    if roots is not None and manifest.get("source"):  # an import record: its drafter is confined alike
        try:
            confine(files_dir(real, manifest), roots)
        except JobError as e:
            raise JobError(f"{what}: {path} records the drafter at {manifest['source']}: {e}") from None
    if verify_digest:
        try:
            verify_checkpoint(real, roots)
        except CheckpointError as e:
            raise JobError(f"{what}: {e}") from None
    return real, manifest


def _check_remote(url: str, roots: Sequence[Path | str] | None, what: str) -> tuple[str, bytes, dict[str, Any]]:
    """(canonical url, marker bytes, manifest) of a checkpoint in a store, confined to the store
    prefixes among `roots`. A store that cannot be reached raises StoreUnavailable (retryable)."""
    url = str(confine(url, roots)) if roots is not None else storage.check_url(url)
    try:
        raw = read_marker(url)
        return str(url), raw, parse_manifest(raw, url)
    except CheckpointError as e:
        raise JobError(f"{what}: checkpoint {url} is not published: {e}") from None


@contextlib.contextmanager
def materialize(job: dict[str, Any], roots: Sequence[Path | str] | None, cache=None):
    """What the worker evaluates: `(checkpoint dir, baseline dir or None, verified manifests)`.

    Local checkpoints: `check_checkpoint(..., verify_digest=True)` (the job's one hashing
    pass). Store URLs: confined, the marker read and compared with the job, then a local copy
    from `cache` (a eval_worker.service.checkpoint_cache.CheckpointCache; downloaded once per
    publication, every file's digest verified), held for the block so it is not evicted.
    """
    if not any(storage.is_url(job.get(k)) for k in ("checkpoint", "baseline")):
        manifests = check_checkpoint(job, roots, verify_digest=True)
        yield job["checkpoint"], job.get("baseline"), manifests
        return
    if cache is None:
        raise JobError("this worker has no checkpoint cache to pull store checkpoints into")
    with contextlib.ExitStack() as stack:
        local: dict[str, str | None] = {"checkpoint": None, "baseline": None}
        verified: dict[str, dict[str, Any]] = {}
        for key in ("checkpoint", "baseline"):
            where = job.get(key)
            if not where:
                continue
            if not storage.is_url(where):
                real, manifest = _check_one(where, roots, True, key)
            else:
                url, raw, manifest = _check_remote(where, roots, key)
                if key == "checkpoint":
                    _match_job(job, manifest)
                try:
                    entry, manifest = stack.enter_context(cache.checkout(url, raw))
                except CheckpointError as e:
                    raise JobError(f"{key}: {e}") from None
                real = os.path.realpath(entry)
            if key == "checkpoint" and not storage.is_url(where):
                _match_job(job, manifest)
            local[key], verified[real] = real, manifest
        yield local["checkpoint"], local["baseline"], verified


def _match_job(job: dict[str, Any], manifest: dict[str, Any]) -> None:
    digest = manifest.get("digest")
    if digest != job["checkpoint_digest"]:
        raise JobError(f"checkpoint {job['checkpoint']}: digest in {MARKER_NAME} ({str(digest)[:12]}...) "
                       f"differs from the job's ({job['checkpoint_digest'][:12]}...): "
                       "the checkpoint was replaced after the job was made")
    if int(manifest["step"]) != int(job["step"]):
        raise JobError(f"checkpoint {job['checkpoint']} is step {manifest['step']}, the job says step {job['step']}")
    if manifest["run_id"] != job["run_id"]:
        raise JobError(f"checkpoint {job['checkpoint']} belongs to run {manifest['run_id']!r}, "
                       f"the job says {job['run_id']!r}")


# --------------------------------------------------------------------------- building jobs

def _canonical(location: str | os.PathLike) -> str:
    """A store URL in canonical form, or an absolute local path."""
    if storage.is_url(location):
        try:
            url = storage.check_url(str(location))
            if url.startswith("hf://"):  # a branch or tag becomes its commit: the job means fixed bytes
                from dflash_train.checkpoints import hub

                url = hub.resolve(url)
            return url
        except (storage.StoreError, CheckpointError) as e:
            raise JobError(str(e)) from None
    return os.path.abspath(os.fspath(location))


def make_job(checkpoint: str | os.PathLike, *, suite: str, target: str | os.PathLike | None = None,
             baseline: str | os.PathLike | None = None, wandb: dict[str, Any] | None = None,
             sinks: Sequence[str] | None = None, mlflow: dict[str, Any] | None = None,
             requested_by: str = "user", priority: str = "default", options: dict[str, Any] | None = None,
             manifest: dict[str, Any] | None = None, roots: Sequence[Path | str] | None = None) -> dict[str, Any]:
    """A validated job for a published checkpoint directory (run, step, digest from its marker)."""
    checkpoint = _canonical(checkpoint)
    if manifest is None:
        _, manifest = _check_one(checkpoint, roots, False, "checkpoint")
    if baseline:  # refused here, not an hour later on the worker
        _check_one(_canonical(baseline), roots, False, "baseline")
    run_id, step, digest = manifest["run_id"], manifest["step"], manifest["digest"]
    metrics = manifest.get("train_metrics") or None
    if not isinstance(metrics, dict):
        metrics = None
    if metrics:
        metrics = {k: v for k, v in metrics.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
    if suite.startswith(HF_PREFIX):  # one spelling per request: one job id
        try:
            suite = parse_hf_spec(suite).canonical
        except SuiteError as e:
            raise JobError(str(e)) from None
    elif not suite.startswith("builtin:") and (suite.endswith(".jsonl") or "/" in suite or os.path.exists(suite)):
        suite = os.path.abspath(suite)  # a suite file: the worker runs elsewhere (another cwd, another box)
    payload = {
        "schema": SCHEMA, "run_id": run_id, "step": int(step), "checkpoint": checkpoint,
        "checkpoint_digest": digest, "target": canonical_target(target) if target else None,
        "suite": suite, "baseline": _canonical(baseline) if baseline else None,
        "wandb": wandb, "requested_by": requested_by,
        **({"sinks": list(sinks)} if sinks is not None else {}), **({"mlflow": mlflow} if mlflow else {}),
        "priority": priority, "attempt": 0,
        "train_metrics": metrics or None, "options": options or None,
    }
    return validate_job(payload)
