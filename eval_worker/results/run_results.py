"""The evaluations of one training run, as the W&B sink and the report see them.

Read from the results ledger (docs/design.md "Results and W&B"): for every
(step, record key) — one checkpoint, suite, target and set of options — only the latest
attempt counts; two checkpoints evaluated at one step are two results. The ledger is the source of truth;
W&B and the report are both rebuilt from it.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from pathlib import Path

from dflash_train.common.errors import DFlashError
from eval_worker.results.series import (  # noqa: F401 - re-exported: the sinks and views read them here
    Series,
    options_label,
    options_of,
    series_of,
    target_identity,
    target_label,
    target_notes,
)

RESULT_SCHEMA = "dflash-eval-result/1"


class ResultsError(DFlashError, ValueError):
    """Results that cannot be read; the message says which file and why."""


@dataclass(frozen=True)
class RunResult:
    """One ledger record: where it lies, which attempt, and the result dict."""

    step: int
    record_key: str  # the ledger record's key (eval_worker.results.ledger.record_key)
    attempt: int
    path: Path
    result: dict
    # the training run's metrics when the checkpoint was published (its COMPLETE.json, via the job):
    # recent-window means of loss, accuracy and streak (1 + leading correct slots: the train-side accept length)
    train_metrics: dict | None = None
    # the queue's view when the record was written: {"eval_lag": {"lag_steps", "lag_s", ...}} (queueing/routing.py)
    queue: dict | None = None
    # the job's options that change a recorded number (engine.options.options_identity; {}: every default)
    options: dict = field(default_factory=dict)

    @property
    def target_id(self) -> str:
        """The target the number was measured against: its fingerprint, else its path."""
        return target_identity(self.result)

    @property
    def target_label(self) -> str:
        return target_label(self.result)

    @property
    def options_label(self) -> str:
        return options_label(self.options)

    @property
    def key(self) -> str:
        return f"{self.step}:{self.record_key}:{self.attempt}"


def result_of(record: dict) -> dict:
    """The `dflash-eval-result/1` dict inside a ledger record (or the record itself)."""
    if not isinstance(record, dict):
        raise ResultsError(f"ledger record must be a JSON object, got {type(record).__name__}")
    if record.get("schema") == RESULT_SCHEMA:
        return record
    inner = record.get("result")
    if isinstance(inner, dict) and inner.get("schema") == RESULT_SCHEMA:
        return inner
    raise ResultsError(f"not a {RESULT_SCHEMA} record (schema={record.get('schema')!r})")


def load_run(run_id: str, results_dir: str | os.PathLike) -> list[RunResult]:
    """Latest attempt of every (step, record key) of ``run_id``, in that order."""
    from eval_worker.results.ledger import Ledger, LedgerError

    ledger = Ledger(results_dir)
    try:
        entries = ledger.entries(run_id)
    except LedgerError as e:
        raise ResultsError(str(e)) from None
    if not entries:
        raise ResultsError(f"no results for run {run_id!r} under {ledger.root}")
    out = []
    for entry in entries:
        try:
            record = entry.read()
            result = result_of(record)
        except (LedgerError, ResultsError) as err:
            raise ResultsError(f"{entry.path}: {err}") from None
        out.append(RunResult(entry.step, entry.key, entry.attempt, entry.path, result, _train_metrics(record),
                             record.get("queue") if isinstance(record.get("queue"), dict) else None,
                             options_of(record)))
    return out


def lag_scalars(res: RunResult) -> dict[str, float]:
    """`eval/lag_steps` and `eval/lag_s` of a record (the run's eval lag when it was recorded), if known."""
    lag = (res.queue or {}).get("eval_lag") or {}
    return {f"eval/{k}": float(lag[k]) for k in ("lag_steps", "lag_s")
            if isinstance(lag.get(k), (int, float)) and math.isfinite(lag[k])}


def _train_metrics(record: dict) -> dict | None:
    """The finite numbers of the job's `train_metrics` (None when the record has none)."""
    job = record.get("job") if isinstance(record, dict) else None
    metrics = job.get("train_metrics") if isinstance(job, dict) else None
    if not isinstance(metrics, dict):
        return None
    out = {k: float(v) for k, v in metrics.items()
           if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
    return out or None
