"""Where the latest `dflash-eval demo` put things, so `results`, `report` and `status` find it without flags.

The demo keeps everything in its workdir (its own Redis, ledger, report), not under
`$DFLASH_HOME`; it records the paths in `$DFLASH_HOME/demo-latest.json` when it starts and again
when it ends. The commands read the ledger they are given (`--results`, `$DFLASH_RESULTS_DIR`,
`$DFLASH_HOME/results`) first, and fall back on the latest demo's for a run found only there.
"""
from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from dflash_train.common.fsutil import atomic_write_json

POINTER = "demo-latest.json"


def pointer_path(settings) -> Path:
    return Path(settings.home) / POINTER


def record(settings, *, run_id: str, workdir: Path, results: Path, report: Path, state: str) -> None:
    """Write the pointer (`state`: running, finished, failed)."""
    path = pointer_path(settings)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_json(path, {"run_id": run_id, "workdir": str(workdir), "results": str(results),
                             "report": str(report), "state": state, "at": time.time()}, durable=False)


def read(settings) -> dict[str, Any] | None:
    """The pointer, or None when there is none (or it is unreadable: it is only a convenience)."""
    try:
        data = json.loads(pointer_path(settings).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("run_id"), str) or not data.get("results"):
        return None
    return data


def _has_run(results_dir: Path, run_id: str) -> bool:
    return (Path(results_dir) / run_id).is_dir()


def results_dir_for(run_id: str | None, given: str | None, settings) -> tuple[str | None, Path, str | None]:
    """(run, ledger directory, note) for a command asked about `run_id` (None: the latest demo's run).

    An explicit `--results` is used as it is. Otherwise the configured ledger, unless the run is
    only in the latest demo's ledger; the note says when the demo's was chosen.
    """
    if given:
        return run_id, Path(given), None
    demo = read(settings)
    if run_id is None:
        if demo is None:
            return None, Path(settings.results_dir), None
        return demo["run_id"], Path(demo["results"]), f"the latest demo's run {demo['run_id']} ({demo['results']})"
    if not _has_run(settings.results_dir, run_id) and demo and _has_run(Path(demo["results"]), run_id):
        return run_id, Path(demo["results"]), f"run {run_id} found in the latest demo's ledger ({demo['results']})"
    return run_id, Path(settings.results_dir), None


def known_runs(settings) -> list[tuple[str, Path]]:
    """(run, ledger directory) of every run in the configured ledger and the latest demo's."""
    from eval_worker.results.ledger import Ledger

    dirs = [Path(settings.results_dir)]
    demo = read(settings)
    if demo and Path(demo["results"]) not in dirs:
        dirs.append(Path(demo["results"]))
    return [(run, d) for d in dirs for run in Ledger(d).runs()]


def ledgers_for(run_id: str, given: str | None, settings) -> list[tuple[Path, str | None]]:
    """Every ledger holding `run_id`, each with a note for a reader: an explicit `--results` alone; else the
    configured ledger and the latest demo's, both when both hold the run (a demo run named like one of the
    configured ledger's must not hide the other's rows)."""
    if given:
        return [(Path(given), None)]
    demo = read(settings)
    out: list[tuple[Path, str | None]] = []
    if _has_run(settings.results_dir, run_id):
        out.append((Path(settings.results_dir), None))
    if demo and _has_run(Path(demo["results"]), run_id) and Path(demo["results"]) != Path(settings.results_dir):
        out.append((Path(demo["results"]), f"run {run_id} found in the latest demo's ledger ({demo['results']})"))
    if len(out) > 1:
        out = [(d, f"run {run_id} is in {len(out)} ledgers: rows from {d}") for d, _ in out]
    return out or [(Path(settings.results_dir), None)]

