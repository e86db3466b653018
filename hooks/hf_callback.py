"""A Hugging Face `TrainerCallback` that publishes DFlash drafter checkpoints and queues their eval.

`on_save` (after the HF Trainer saved its own checkpoint), on the main process only:
the drafter inside the HF model is snapshotted to CPU on the training thread (the only
synchronous part), then a background thread writes and publishes it atomically as
`<checkpoint_root>/<run_id>/step-<step:08d>/` (dflash_train.checkpoints.checkpoint.AsyncPublisher:
temporary dir, fsync, rename, COMPLETE.json last), and only then hands it to
`EvalOnCheckpoint`, which queues the job (outbox first, so a Redis outage loses nothing).
With `publish_to="s3://bucket/runs"` the same thread then uploads it (files, then the marker)
and the job names the store URL, for workers that share no filesystem with the trainer.
`on_train_end` waits for the publications in flight, queues the final checkpoint and
flushes the outbox. A failed publication or delivery is logged (`errors`), never raised
into the HF training loop; a drafter that cannot be found is raised, at `on_train_begin`
(or the first `on_save`), before a step is spent on a run whose evals would never come.

    trainer = transformers.Trainer(model=wrapper, args=args, ...,
        callbacks=[DFlashEvalCallback(checkpoint_root="runs", target="/models/qwen", every_n_steps=500)])

Finding the drafter, `drafter_getter(model) -> DFlashDrafter`: without one, the model itself
if it is a `DFlashDrafter`, else its `.drafter` attribute, else the first `DFlashDrafter`
submodule (DDP/accelerate `.module` wrappers are unwrapped first). A model that holds another
trainer's drafter module (SpecForge's `DFlashDraftModel` as `.draft_model`, ...) needs a
getter; `drafter_from_module` converts such a module (the same weights under our names, its
config.json-style config read like a published one):

    DFlashEvalCallback("runs", drafter_getter=lambda m: drafter_from_module(m.draft_model), ...)

W&B: with `report_to` including "wandb" and a live W&B run, the eval jobs go to that run's
project and entity, in its group (`WANDB_RUN_GROUP`, or `group=` at `wandb.init`) or else in a
group named after the callback's run id (the HF `run_name`); an explicit `wandb=` wins. The eval
run's step axis `train/step` is HF's `state.global_step` at `on_save`; it is also logged as
`train/global_step`, HF's own x-axis, so a panel of the group plots both runs on one axis.

MLflow: with `report_to` including "mlflow" and an active MLflow run (HF's `MLflowCallback` starts
it), the jobs carry `mlflow.parent_run_id` = that run, so the worker's MLflow sink nests the eval
run under it (the worker must use the same tracking server); an explicit `mlflow=` wins.
"""
from __future__ import annotations

import logging
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

# drafter_from_module is re-exported: users convert other trainers' modules with it from here
from dflash_train.checkpoints.checkpoint import AsyncPublisher
from dflash_train.checkpoints.checkpoint import drafter_from_module as drafter_from_module
from dflash_train.checkpoints.publication import run_id_from
from dflash_train.core.model import DFlashDrafter

from .eval_on_checkpoint import EvalOnCheckpoint

log = logging.getLogger(__name__)


class DrafterNotFound(TypeError):
    """The HF model holds no drafter the callback can publish; the message says what to pass."""


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
    raise DrafterNotFound(
        f"DFlashEvalCallback: no DFlashDrafter in the HF model ({type(model).__name__}): neither the model, nor its "
        ".drafter, nor a submodule is one. Pass drafter_getter=, a callable(model) returning the "
        "dflash_train.core.model.DFlashDrafter to publish; for another trainer's drafter module (SpecForge's "
        "DFlashDraftModel, ...) convert it: drafter_getter=lambda m: drafter_from_module(m.draft_model) "
        "(from hooks.hf_callback)")


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
                 publish_timeout: float = 600.0, publish_to: str | None = None, **eval_kwargs):
        self.checkpoint_root = Path(checkpoint_root)
        self.publish_to = publish_to  # an object-store prefix: each checkpoint is also uploaded, jobs name the URL
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
        self._wandb_given = eval_kwargs.get("wandb") is not None
        self._mlflow_given = eval_kwargs.get("mlflow") is not None

    # ---- HF events -----------------------------------------------------------------
    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if not getattr(state, "is_world_process_zero", True):
            return control
        self._drafter(model)  # raises: a run whose evals would never come should not start
        if self.publish_to:  # likewise a missing bucket or a key that cannot write there
            from dflash_train.checkpoints import storage

            storage.preflight(self.publish_to)
        self.run_id = self.run_id or _run_id_from(args)
        self._join_hf_wandb(args)
        self._nest_under_hf_mlflow(args)
        return control

    def on_save(self, args, state, control, model=None, **kwargs):
        if not getattr(state, "is_world_process_zero", True):
            return control
        step = int(state.global_step)
        bucket = step // max(self.every_n_steps, 1)
        if bucket <= self._last_bucket:
            return control
        try:
            drafter = self._drafter(model)
            publisher = self._publisher(args)
            publisher.submit(drafter, step, train_metrics=_train_metrics(state))  # CPU snapshot, then async write
            self._last_bucket = bucket
        except DrafterNotFound:
            raise  # set-up, not a passing fault: training on without evals is what must not happen
        except Exception as e:  # noqa: BLE001 - never break the HF loop over a write or a queue
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
    def _drafter(self, model):
        drafter = (self.drafter_getter or find_drafter)(model)
        if not isinstance(drafter, DFlashDrafter):
            raise DrafterNotFound(
                f"DFlashEvalCallback: drafter_getter returned {type(drafter).__name__}, not a "
                "dflash_train.core.model.DFlashDrafter; wrap another trainer's module with "
                "drafter_from_module(module) (from hooks.hf_callback)")
        return drafter

    def _join_hf_wandb(self, args) -> None:
        """Send the evals to the HF run's W&B project/entity/group (unless `wandb=` was given)."""
        if self._wandb_given or "wandb" not in (getattr(args, "report_to", None) or []):
            return
        try:
            import wandb
        except ImportError:
            return
        run = wandb.run
        if run is None:
            return
        mode = "offline" if getattr(run, "offline", False) or getattr(run.settings, "mode",
                                                                      "") == "offline" else "online"
        self.hook.request = self.hook.request.replace(wandb={
            "project": run.project, "entity": run.entity or None, "mode": mode,
            "group": run.group or self.run_id or _run_id_from(args)})

    def _nest_under_hf_mlflow(self, args) -> None:
        """Nest the MLflow eval run under the HF run's MLflow run (unless `mlflow=` was given)."""
        if self._mlflow_given or "mlflow" not in (getattr(args, "report_to", None) or []):
            return
        try:
            import mlflow
        except ImportError:
            return
        run = mlflow.active_run()
        if run is not None:
            self.hook.request = self.hook.request.replace(mlflow={"parent_run_id": run.info.run_id})

    def _publisher(self, args):
        if self.publisher is None:
            self.run_id = self.run_id or _run_id_from(args)
            self.publisher = AsyncPublisher(self.checkpoint_root, self.run_id, on_published=self._published,
                                            dtype=self.dtype, max_pending=self.max_pending, publish_to=self.publish_to)
        return self.publisher

    def _published(self, step: int, path: Path, manifest: dict) -> None:
        # publisher thread: marker present -> queue (outbox write + wake the delivery thread)
        self.hook.on_checkpoint_published(None, step, path, manifest)
        if step in self.hook._enqueued_steps:  # HF users watch stdout, not logging: say it once per job
            print(f"[dflash-eval] step {step}: eval queued for {path} (suite(s) {', '.join(self.hook.suites)}; "
                  f"`dflash-eval status` shows it)", flush=True)

    def _note(self, message: str) -> None:
        self.errors.append(message)
        log.warning(message)
