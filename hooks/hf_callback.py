"""A Hugging Face `TrainerCallback` that publishes DFlash drafter checkpoints and queues their eval.

`on_save` (after the HF Trainer saved its own checkpoint), on the main process only:
the drafter inside the HF model is snapshotted to CPU on the training thread (the only
synchronous part), then a background thread writes and publishes it atomically as
`<checkpoint_root>/<run_id>/step-<step:08d>/` (dflash_train.checkpoint.AsyncPublisher:
temporary dir, fsync, rename, COMPLETE.json last), and only then hands it to
`EvalOnCheckpoint`, which queues the job (outbox first, so a Redis outage loses nothing).
`on_train_end` waits for the publications in flight, queues the final checkpoint and
flushes the outbox. Errors are logged, never raised into the HF training loop.

    trainer = transformers.Trainer(model=wrapper, args=args, ...,
        callbacks=[DFlashEvalCallback(checkpoint_root="runs", target="/models/qwen", every_n_steps=500)])

The drafter is found as: `drafter_getter(model)` if given, else the model itself if it is a
`DFlashDrafter`, else its `.drafter` attribute, else the first `DFlashDrafter` submodule
(DDP/accelerate `.module` wrappers are unwrapped first).
"""
from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import Any, Callable

from transformers import TrainerCallback

from dflash_train.checkpoint import AsyncPublisher
from dflash_train.model import DFlashDrafter
from dflash_train.publication import run_id_from

from .eval_on_checkpoint import EvalOnCheckpoint

log = logging.getLogger("hooks.hf")


def find_drafter(model: Any):
    seen = 0
    while hasattr(model, "module") and not isinstance(model, DFlashDrafter) and seen < 4:
        model, seen = model.module, seen + 1
    if isinstance(model, DFlashDrafter):
        return model
    inner = getattr(model, "drafter", None)
    if isinstance(inner, DFlashDrafter):
        return inner
    if hasattr(model, "modules"):
        for m in model.modules():
            if isinstance(m, DFlashDrafter):
                return m
    raise TypeError(f"no DFlashDrafter found in {type(model).__name__}; pass drafter_getter=")


def _run_id_from(args) -> str:
    raw = getattr(args, "run_name", None) or Path(getattr(args, "output_dir", None) or "hf-run").name
    return run_id_from(raw, default="hf-run")


def _train_metrics(state) -> dict:
    for entry in reversed(getattr(state, "log_history", None) or []):
        if "loss" in entry:
            return {k: float(v) for k, v in entry.items()
                    if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)}
    return {}


class DFlashEvalCallback(TrainerCallback):
    """HF adapter: `on_save` -> publish the drafter (off the training thread) -> enqueue its eval."""

    def __init__(self, checkpoint_root: str | Path, *, run_id: str | None = None, every_n_steps: int = 1,
                 drafter_getter: Callable[[Any], Any] | None = None, dtype=None, max_pending: int = 2,
                 publish_timeout: float = 600.0, **eval_kwargs):
        self.checkpoint_root = Path(checkpoint_root)
        self.run_id = run_id
        self.drafter_getter = drafter_getter
        self.dtype = dtype
        self.max_pending = max_pending
        self.publish_timeout = publish_timeout
        # the hook sees every published checkpoint; the cadence is applied here, in on_save
        self.every_n_steps = int(every_n_steps)
        self.hook = EvalOnCheckpoint(every_n_steps=1, **eval_kwargs)
        self.publisher = None
        self.errors: list[str] = []
        self._last_bucket = 0

    # ---- HF events -----------------------------------------------------------------
    def on_save(self, args, state, control, model=None, **kwargs):
        if not getattr(state, "is_world_process_zero", True):
            return control
        step = int(state.global_step)
        bucket = step // max(self.every_n_steps, 1)
        if bucket <= self._last_bucket:
            return control
        try:
            drafter = (self.drafter_getter or find_drafter)(model)
            publisher = self._publisher(args)
            publisher.submit(drafter, step, train_metrics=_train_metrics(state))  # CPU snapshot, then async write
            self._last_bucket = bucket
        except Exception as e:  # noqa: BLE001 - never break the HF loop
            self._note(f"DFlash eval checkpoint at step {step} not published: {type(e).__name__}: {e}")
        return control

    def on_train_end(self, args, state, control, **kwargs):
        if not getattr(state, "is_world_process_zero", True):
            return control
        try:
            if self.publisher is not None:
                self.publisher.wait(self.publish_timeout)
        except Exception as e:  # noqa: BLE001
            self._note(f"DFlash eval checkpoint publication failed: {type(e).__name__}: {e}")
        finally:
            if self.publisher is not None:
                try:
                    self.publisher.close()
                except Exception as e:  # noqa: BLE001
                    self._note(f"closing the checkpoint publisher: {type(e).__name__}: {e}")
                self.publisher = None
            self.hook.on_train_end(None)
        return control

    # ---- internals -------------------------------------------------------------------
    def _publisher(self, args):
        if self.publisher is None:
            self.run_id = self.run_id or _run_id_from(args)
            self.publisher = AsyncPublisher(self.checkpoint_root, self.run_id, on_published=self._published,
                                            dtype=self.dtype, max_pending=self.max_pending)
        return self.publisher

    def _published(self, step: int, path: Path, manifest: dict) -> None:
        # publisher thread: marker present -> queue (outbox write + wake the delivery thread)
        self.hook.on_checkpoint_published(None, step, path, manifest)

    def _note(self, message: str) -> None:
        self.errors.append(message)
        log.warning(message)
