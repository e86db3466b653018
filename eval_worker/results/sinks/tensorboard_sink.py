"""TensorBoard sink: one event file per training run, rebuilt from the results ledger.

Layout: ``<root>/<run_id>-eval/events.out.tfevents.*`` (the W&B eval run's id), so
``tensorboard --logdir <root>`` (or the trainer's own logdir used as root) shows the eval run beside
the training runs. Every scalar is written at its training step (``global_step``): our keys
(``eval/tau``, ``eval/<suite>/tau``, ...), the field's aliases (``sinks/names.py``); the
accept-length histogram as a TensorBoard histogram (``eval/<suite>/accept_hist``) and the per-position
curve as an image (``eval/<suite>/pos_curve``, when matplotlib is installed).

Why a rebuild: TensorBoard reads an event file in order and, seeing a step lower than one before it,
drops the later points as a restart's orphans. So a re-evaluated old checkpoint must not be appended;
each publication writes the complete run, in step order, into a staging directory beside the root
(``.<root name>-staging``, same filesystem) and swaps the event file in (the run directory always holds
one complete file; the old one is deleted after the swap).
Offline by nature; one writer per run (`wandb_lock.writer_lock`, Redis + file lock).
"""
from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import struct
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_train.common.fsutil import atomic_write_text
from dflash_train.common.settings import Settings
from eval_worker.results.run_results import RunResult, Series, lag_scalars, load_run, series_of
from eval_worker.results.sinks.base import Sink, register
from eval_worker.results.sinks.common import eval_run_id, read_json
from eval_worker.results.sinks.names import points, suite_prefix
from eval_worker.results.sinks.wandb_lock import writer_lock

log = logging.getLogger(__name__)


@dataclass
class TensorBoardTarget:
    root: Path  # Settings.tensorboard_dir: $DFLASH_TENSORBOARD_DIR, else $DFLASH_HOME/tensorboard
    primary_suite: str | None = None
    images: bool = True  # the per-position curve as an image (needs matplotlib)

    def to_json(self) -> dict:
        return {"root": str(self.root), "primary_suite": self.primary_suite, "images": self.images}

    @classmethod
    def from_json(cls, data: dict) -> TensorBoardTarget:
        return cls(**{**data, "root": Path(data["root"])})


def _png_size(png: bytes) -> tuple[int, int]:
    width, height = struct.unpack(">II", png[16:24])  # the IHDR chunk
    return height, width


def _curve_png(res: RunResult) -> bytes | None:
    if importlib.util.find_spec("matplotlib") is None:  # the worker extra; scalars and histograms need none
        return None
    if not (res.result.get("per_position") or {}).get("conditional_accept"):
        return None
    from eval_worker.results.report_figures import per_position

    return per_position([res])


def _write(writer, res: RunResult, series: Series, images: bool) -> None:
    from tensorboard.compat.proto.summary_pb2 import Summary

    step = res.step
    for key, value in sorted({**points(res.result, None, series), **lag_scalars(res)}.items()):
        writer.add_scalar(key, value, global_step=step, new_style=False)
    prefix = suite_prefix(series.label)
    hist = [int(c) for c in res.result.get("acceptance_histogram") or []]
    if sum(hist):
        lengths = [k for k, c in enumerate(hist, start=1) if c]
        writer.add_histogram_raw(prefix + "accept_hist", min=min(lengths), max=max(lengths), num=sum(hist),
                                 sum=float(sum(k * c for k, c in enumerate(hist, start=1))),
                                 sum_squares=float(sum(k * k * c for k, c in enumerate(hist, start=1))),
                                 bucket_limits=[k + 0.5 for k in range(1, len(hist) + 1)], bucket_counts=hist,
                                 global_step=step)
    png = _curve_png(res) if images else None
    if png:
        h, w = _png_size(png)
        img = Summary.Image(height=h, width=w, colorspace=4, encoded_image_string=png)
        writer._get_file_writer().add_summary(Summary(value=[Summary.Value(tag=prefix + "pos_curve", image=img)]), step)


def rebuild(run_id: str, results: list[RunResult], target: TensorBoardTarget) -> dict:
    """Write the complete eval run and swap it in. Caller holds the lock."""
    from torch.utils.tensorboard import SummaryWriter

    eid = eval_run_id(run_id)
    run_dir = target.root / eid
    # beside the logdir, not in it: a TensorBoard watching the root would show a half-written build as a run
    staging = target.root.parent / f".{target.root.name}-staging" / f"{eid}-{uuid.uuid4().hex[:8]}"
    staging.mkdir(parents=True)
    try:
        writer = SummaryWriter(log_dir=str(staging), flush_secs=3600)
        try:
            series = series_of(results, target.primary_suite)
            for res in sorted(results, key=lambda r: (r.step, r.record_key)):
                _write(writer, res, series[res.key], target.images)
        finally:
            writer.close()
        (new,) = staging.glob("events.out.tfevents.*")
        run_dir.mkdir(parents=True, exist_ok=True)
        old = [p for p in run_dir.glob("events.out.tfevents.*") if p.name != new.name]
        os.replace(new, run_dir / new.name)  # same filesystem: atomic
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    for p in old:
        p.unlink(missing_ok=True)
    info = {"eval_run_id": eid, "train_run": run_id, "mode": "offline", "run_dir": str(run_dir),
            "event_file": str(run_dir / new.name), "records": [r.key for r in results],
            "steps": sorted({r.step for r in results}), "published_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "view": f"tensorboard --logdir {target.root}"}
    atomic_write_text(target.root / f"{eid}.tensorboard.json", json.dumps(info, indent=1), durable=False)
    return info


def publish_run(run_id: str, target: TensorBoardTarget, *, results_dir, redis_url: str | None = None,
                force: bool = False, lock_wait_s: float = 600.0) -> dict:
    """Bring the eval run's event file up to date with the ledger (skipped when it already is)."""
    target.root.mkdir(parents=True, exist_ok=True)
    eid = eval_run_id(run_id)
    with writer_lock(f"tensorboard-{eid}", redis_url=redis_url, lock_dir=target.root, wait_s=lock_wait_s):
        results = load_run(run_id, results_dir)  # under the lock: a waiting writer sees every record
        current = read_json(target.root / f"{eid}.tensorboard.json")
        if (not force and current and set(current.get("records", [])) == {r.key for r in results}
                and Path(current.get("event_file", "")).is_file()):
            return {**current, "skipped": "up to date"}
        return rebuild(run_id, results, target)


@register
class TensorBoardSink(Sink[TensorBoardTarget]):
    """TensorBoard: no job block; the worker's ``$DFLASH_TENSORBOARD_DIR``."""

    name = "tensorboard"
    label = "TensorBoard"

    def target(self, cfg: dict | None, settings: Settings, **over: Any) -> TensorBoardTarget:
        """`over`: `root` (the logdir, over the settings')."""
        root = self._options(over, "root")["root"]
        return TensorBoardTarget(root=Path(root).expanduser().resolve() if root else settings.tensorboard_dir,
                                 primary_suite=settings.wandb_primary_suite)

    def target_from_json(self, data: dict) -> TensorBoardTarget:
        return TensorBoardTarget.from_json(data)

    def publish_run(self, run_id: str, target: TensorBoardTarget, *, results_dir: str | os.PathLike,
                    redis_url: str | None = None, force: bool = False, lock_wait_s: float = 600.0) -> dict:
        return publish_run(run_id, target, results_dir=results_dir, redis_url=redis_url, force=force,
                           lock_wait_s=lock_wait_s)

    def summary(self, info: dict, target: TensorBoardTarget) -> list[str]:
        what = "already up to date" if info.get("skipped") else "rebuilt"
        return [f"tensorboard eval run {info['eval_run_id']} {what}: steps {', '.join(map(str, info['steps']))}",
                f"  event file: {info['event_file']}",
                f"  to view:    {info['view']}"]
