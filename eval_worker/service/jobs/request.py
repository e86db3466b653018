"""`EvalRequest`: what a producer asks of every evaluation it queues, validated once, where it is asked.

A request is everything a job holds except the checkpoint: the suites, the target and baseline, the eval
options, the sinks and the tracker blocks, the priority and who asks. It is built once at each edge (the
`enqueue` flags, the hook's arguments, a training config's `--eval-*` flags) and checked there with the
job's own rules (`schema.py`: the same types, `EvalOptions` for the options), so a typo in an option fails
when the trainer starts, not at its first checkpoint hours later. `jobs(checkpoint)` then makes one job per
suite (`builder.make_job`: the marker read, the digest, the run and step).
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from dflash_train.checkpoints.location import CheckpointRef
from dflash_train.common.settings import KNOWN_SINKS
from eval_worker.engine.options import EvalOptions, OptionsError
from eval_worker.engine.suite import DEFAULT_SUITE
from eval_worker.service.jobs.builder import make_job
from eval_worker.service.jobs.schema import PRIORITIES, REQUESTERS, JobError, JobPayload, MlflowSettings, WandbSettings


class EvalRequest(BaseModel):
    """One evaluation request, checked once (JobError naming every problem); frozen."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    suites: tuple[str, ...] = Field((DEFAULT_SUITE,), min_length=1)
    target: str | None = None
    baseline: str | None = None
    options: dict[str, Any] | None = None
    wandb: dict[str, Any] | None = None
    mlflow: dict[str, Any] | None = None
    sinks: tuple[Literal[KNOWN_SINKS], ...] | None = None  # type: ignore[valid-type]
    priority: Literal[PRIORITIES] = "default"  # type: ignore[valid-type]
    requested_by: Literal[REQUESTERS] = "user"  # type: ignore[valid-type]

    @field_validator("suites", mode="before")
    @classmethod
    def _one_or_many(cls, v: Any) -> Any:
        if isinstance(v, str):
            return (v,)
        return tuple(dict.fromkeys(v)) if isinstance(v, (list, tuple)) else v  # each suite once, in order

    @field_validator("target", "baseline", mode="before")
    @classmethod
    def _path_text(cls, v: Any) -> Any:
        return os.fspath(v) if isinstance(v, os.PathLike) else v

    @field_validator("options")
    @classmethod
    def _options(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        EvalOptions.from_dict(v)  # OptionsError (a ValueError): reported with the other problems
        return v or None

    @field_validator("wandb")
    @classmethod
    def _wandb(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        return None if v is None else WandbSettings.model_validate(v).model_dump(exclude_unset=True)

    @field_validator("mlflow")
    @classmethod
    def _mlflow(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        return None if v is None else MlflowSettings.model_validate(v).model_dump(exclude_unset=True) or None

    @classmethod
    def of(cls, **fields: Any) -> EvalRequest:
        """The request, or JobError with one line per problem (what an edge prints)."""
        try:
            return cls(**{k: v for k, v in fields.items() if v is not None})
        except ValidationError as e:
            problems = []
            for err in e.errors():
                where = ".".join(str(p) for p in err["loc"]) or "request"
                cause = err.get("ctx", {}).get("error")
                problems.append(f"{where}: {cause if isinstance(cause, OptionsError) else err['msg']}")
            raise JobError("invalid eval request: " + "; ".join(problems)) from None

    @classmethod
    def from_train_config(cls, config: Any, **overrides: Any) -> EvalRequest:
        """The request a training config's `--eval-*` flags describe (the eval run lands beside the
        training run's W&B project and entity); `overrides` win, options merged key by key."""
        options = {k: v for k, v in (("num_prompts", config.eval_num_prompts),
                                     ("max_new_tokens", config.eval_max_new_tokens)) if v is not None}
        options.update(overrides.pop("options", None) or {})
        wandb = None
        if config.wandb:
            wandb = {"project": config.wandb_project, "entity": config.wandb_entity, "mode": config.wandb_mode}
        fields = dict(suites=tuple(config.eval_suite), target=config.eval_target, baseline=config.eval_baseline,
                      options=options or None, wandb=wandb, requested_by="hook")
        return cls.of(**{**fields, **overrides})

    def replace(self, **changes: Any) -> EvalRequest:
        """A copy with `changes`, checked again (a frozen request is never edited in place)."""
        return EvalRequest.of(**{**self.model_dump(), **changes})

    def jobs(self, checkpoint: str | os.PathLike, *, roots: Sequence[Path | str] | None = None,
             manifest: dict[str, Any] | None = None) -> list[JobPayload]:
        """One job per suite for a published checkpoint (JobError / StoreError / OSError as make_job)."""
        return [self.job(checkpoint, suite, roots=roots, manifest=manifest) for suite in self.suites]

    def job(self, checkpoint: str | os.PathLike | CheckpointRef, suite: str, *,
            roots: Sequence[Path | str] | None = None, manifest: dict[str, Any] | None = None) -> JobPayload:
        return make_job(checkpoint, suite=suite, target=self.target, baseline=self.baseline, wandb=self.wandb,
                        sinks=list(self.sinks) if self.sinks else None, mlflow=self.mlflow,
                        requested_by=self.requested_by, priority=self.priority, options=self.options,
                        manifest=manifest, roots=roots)
