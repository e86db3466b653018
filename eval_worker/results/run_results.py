"""The evaluations of one training run, as the W&B sink and the report see them.

Read from the results ledger (docs/design.md "Results and W&B"): for every
(step, record key) — one checkpoint, suite, target and set of options — only the latest
attempt counts; two checkpoints evaluated at one step are two results. The ledger is the source of truth;
W&B and the report are both rebuilt from it.
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from dflash_train.common.errors import DFlashError

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
    # the queue's view when the record was written: {"eval_lag": {"lag_steps", "lag_s", ...}} (service/routing.py)
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
                             _options(record)))
    return out


# --------------------------------------------------------------------------- series: what tells numbers apart
# Two numbers of one run at one step are one curve only when nothing that changes them differs: the suite,
# the target (its fingerprint: two files under one path are two targets) and the options that change τ
# (counting rule, max tokens, prompt count, ...). Every sink and view keys its numbers by the series below;
# the common case (default options, the run's first target) keeps the plain suite name, so its metric names
# (`eval/<suite>/tau`, and `eval/tau` for the primary) are those of earlier versions.

SERIES_OPTIONS_SKIP = frozenset({"temperatures"})  # sampled τ is keyed by temperature inside a result (t<T>/...)
_LABEL_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")


def _options(record: dict) -> dict:
    from eval_worker.engine.options import OptionsError, options_identity

    job = record.get("job") if isinstance(record, dict) else None
    try:
        return options_identity(job.get("options") if isinstance(job, dict) else None)
    except OptionsError:
        return {}


def options_label(identity: dict | None) -> str:
    """``counting-sglang.max_new_tokens-64``: the options that change a number, '' for the defaults."""
    parts = [f"{k}-{_label_value(v)}" for k, v in sorted((identity or {}).items()) if k not in SERIES_OPTIONS_SKIP]
    return ".".join(parts)


def _label_value(v) -> str:
    text = ",".join(map(str, v)) if isinstance(v, (list, tuple)) else str(v)
    return _LABEL_UNSAFE.sub("_", text)[:32]


def target_identity(result: dict) -> str:
    target = result.get("target") or {}
    return str(target.get("fingerprint") or target.get("path") or "")


def target_label(result: dict) -> str:
    """``<directory name>-<fingerprint[:8]>``: short, and different for two files under one path."""
    target = result.get("target") or {}
    name = _LABEL_UNSAFE.sub("_", Path(str(target.get("path") or "target")).name or "target")[:24]
    fp = str(target.get("fingerprint") or "")[:8]
    return f"{name}-{fp}" if fp else name


@dataclass(frozen=True)
class Series:
    """One curve: a suite, against one target, under one set of options. `label` names it in every sink
    (`eval/<label>/...`); `primary` also draws it under plain `eval/...`."""

    label: str
    suite: str
    target: str    # target_label; shown in `label` only for a target other than the run's first
    options: str   # options_label ('' for the defaults)
    primary: bool = False


def _created(r: RunResult) -> tuple[str, int]:
    return (r.result.get("provenance", {}).get("created_at") or "", r.step)


def series_of(results: list[RunResult], primary_suite: str | None = None) -> dict[str, Series]:
    """RunResult.key -> its Series. The run's first target (first evaluated) and the default options keep
    the plain suite name; anything else adds what differs. The primary series (plain `eval/...`) is the
    configured suite's, else the first evaluated suite's, with default options on the first target."""
    if not results:
        return {}
    first_target = min(results, key=_created).target_id
    labels = {}
    for r in results:
        target = "" if r.target_id == first_target else r.target_label
        name = r.result["suite"]["name"]
        labels[r.key] = (".".join(p for p in (name, target and f"target-{target}", r.options_label) if p),
                         name, r.target_label, r.options_label)
    plain = [r for r in results if labels[r.key][0] == r.result["suite"]["name"]
             and (primary_suite is None or r.result["suite"]["name"] == primary_suite)]
    primary = primary_suite if primary_suite else (min(plain, key=_created).result["suite"]["name"] if plain else None)
    return {k: Series(label, suite, target, opts, primary=label == primary)
            for k, (label, suite, target, opts) in labels.items()}


def target_notes(results: list[RunResult]) -> list[str]:
    """A line per target path that holds more than one target (different fingerprints): two files under one
    path measured one run, so its numbers are drawn as separate series (issue 34 D15)."""
    by_path: dict[str, set[str]] = {}
    for r in results:
        target = r.result.get("target") or {}
        by_path.setdefault(str(target.get("path") or "?"), set()).add(str(target.get("fingerprint") or "?"))
    return [f"target {path} changed during the run: {len(fps)} different files (fingerprints "
            f"{', '.join(sorted(fp[:8] for fp in fps))}); their results are separate series, not one curve"
            for path, fps in sorted(by_path.items()) if len(fps) > 1]


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
