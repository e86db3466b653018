"""What tells two numbers of one run apart: the series every sink and view keys its numbers by.

Two numbers of one run at one step are one curve only when nothing that changes them differs: the suite,
the target (its fingerprint: two files under one path are two targets) and the options that change τ
(counting rule, max tokens, prompt count, ...). The common case (default options, the run's first target)
keeps the plain suite name, so its metric names (`eval/<suite>/tau`, and `eval/tau` for the primary) are
those of earlier versions (docs/design.md "Metric names and aliases").
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol


class RunResult(Protocol):
    """What a series is read from (run_results.RunResult; a protocol here: run_results imports this module)."""

    @property
    def key(self) -> str: ...
    @property
    def step(self) -> int: ...
    @property
    def result(self) -> dict[str, Any]: ...
    @property
    def target_id(self) -> str: ...
    @property
    def target_label(self) -> str: ...
    @property
    def options_label(self) -> str: ...

SERIES_OPTIONS_SKIP = frozenset({"temperatures"})  # sampled τ is keyed by temperature inside a result (t<T>/...)
_LABEL_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]+")


def options_of(record: dict) -> dict:
    """The options of a ledger record's job that change a number (engine.options.options_identity)."""
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


def series_of(results: Sequence[RunResult], primary_suite: str | None = None) -> dict[str, Series]:
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


def target_notes(results: Sequence[RunResult]) -> list[str]:
    """A line per target path that holds more than one target (different fingerprints): two files under one
    path measured one run, so its numbers are drawn as separate series (issue 34 D15)."""
    by_path: dict[str, set[str]] = {}
    for r in results:
        target = r.result.get("target") or {}
        by_path.setdefault(str(target.get("path") or "?"), set()).add(str(target.get("fingerprint") or "?"))
    return [f"target {path} changed during the run: {len(fps)} different files (fingerprints "
            f"{', '.join(sorted(fp[:8] for fp in fps))}); their results are separate series, not one curve"
            for path, fps in sorted(by_path.items()) if len(fps) > 1]
