"""The trainer's checkpointer: it owns when to publish, when to save the training state, and retention.

Like torchtitan's checkpoint manager, it is told about every step (`step(n)`) and decides
itself what that step needs (rank 0 only):

- every `publish_every` steps, and at the last one, the drafter is published for evaluation
  (`AsyncPublisher`: a CPU snapshot here, the write, fsync and COMPLETE.json on a thread);
- every `state_every` steps (default: `publish_every`), and at the last one, the resumable
  training state is saved (`train_state.py`);
- each publication that has landed is announced to the callbacks
  (`on_checkpoint_published`, on the training thread), then retention keeps the newest
  `keep_last` plus every pinned or callback-protected one;
- with `publish_to` (an object-store prefix), each checkpoint is also uploaded there on the
  publisher's thread and announced by its URL (jobs name it); retention and the cleanup of
  interrupted uploads apply to the store's run prefix as well as to the local run directory;
  a checkpoint published locally but not uploaded when the run stopped is uploaded (and
  announced) when the run starts again.
"""
from __future__ import annotations

import logging
import queue
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dflash_train.checkpoints import storage
from dflash_train.checkpoints.checkpoint import AsyncPublisher
from dflash_train.checkpoints.publication import (
    MARKER_NAME,
    apply_retention,
    checkpoint_step,
    cleanup_incomplete,
    list_checkpoints,
    step_dir_name,
)
from dflash_train.core.model import DFlashDrafter

from .train_config import TrainConfig
from .train_state import save_training_state

log = logging.getLogger(__name__)


class Checkpointer:
    """Given what it saves, not the trainer: the run's config and directories, the drafter, the
    optimizer and scheduler whose state resumes the run, and two callables for the callbacks
    (`on_published(step, path, manifest)` when a publication has landed, `protects(path)` for
    retention)."""

    def __init__(self, config: TrainConfig, run_id: str, *, run_dir: Path, state_dir: Path, drafter: DFlashDrafter,
                 optimizer: Any, scheduler: Any, on_published: Callable[[int, Path, dict], None],
                 protects: Callable[[Path], bool], dtype=None):
        c = self.config = config
        self.run_id, self.run_dir, self.state_dir = run_id, Path(run_dir), Path(state_dir)
        self.drafter, self.optimizer, self.scheduler = drafter, optimizer, scheduler
        self.on_published, self.protects = on_published, protects
        self.publish_every = c.publish_every
        self.state_every = c.state_every or c.publish_every
        self.published: list[str] = []         # checkpoints published by this run
        self.state_path: str | None = None     # the last training state saved
        self._landed: queue.SimpleQueue = queue.SimpleQueue()
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.store_run = storage.join(c.publish_to, run_id) if c.publish_to else None
        if c.publish_to:  # a missing bucket or no write permission fails now, not at the first upload
            storage.preflight(c.publish_to)
        for where in self._places():
            for p in cleanup_incomplete(where):
                log.info("removed half-written %s", p)
        self.publisher = AsyncPublisher(c.checkpoint_root, run_id, dtype=dtype, publish_to=c.publish_to,
                                        on_published=lambda *landed: self._landed.put(landed))
        if self.store_run:  # published here but never uploaded (the run stopped in between): upload now
            uploaded = {checkpoint_step(u) for u in list_checkpoints(self.store_run)}
            for p in list_checkpoints(self.run_dir):
                step = checkpoint_step(p)
                assert step is not None, p  # list_checkpoints lists step directories only
                if step not in uploaded:
                    log.info("uploading %s, published before the run stopped", p)
                    self.publisher.submit_upload(p, step)

    def _places(self) -> list[Path | str]:
        """Where the run's checkpoints lie: its directory, and its object-store copy when it has one."""
        return [self.run_dir, self.store_run] if self.store_run else [self.run_dir]

    def step(self, step: int, train_metrics: Callable[[], dict], data_position: int) -> None:
        """After optimizer step `step` (the next batch to train on: `data_position`): publish and/or
        save as the cadences say, then announce what landed."""
        last = step == self.config.max_steps
        if step % self.publish_every == 0 or last:
            self._publish(step, train_metrics())
        if step % self.state_every == 0 or last:
            self.state_path = self._save_state(step, data_position)
        self.announce()

    def announce(self) -> None:
        """Tell the callbacks about publications that have landed, then apply retention."""
        while True:
            try:
                step, path, manifest = self._landed.get_nowait()
            except queue.Empty:
                return
            self.published.append(str(path))
            self.on_published(step, path, manifest)
            for where in self._places():
                for p in apply_retention(where, self.config.keep_last, protect=self.protects):
                    log.info("retention removed %s", p)

    def close(self, failing: bool) -> None:
        """Wait for the last publication; its failure is raised unless training is failing already."""
        try:
            self.publisher.close()
        except Exception:
            if not failing:
                raise
            log.exception("checkpoint publication also failed while training was failing")

    def _publish(self, step: int, train_metrics: dict) -> None:
        if (self.run_dir / step_dir_name(step) / MARKER_NAME).exists():
            log.warning("step %d is already published in %s; keeping that one", step, self.run_dir)
            return
        self.publisher.submit(self.drafter, step, train_metrics=train_metrics)

    def _save_state(self, step: int, data_position: int) -> str:
        return str(save_training_state(
            self.state_dir, step, model_state=self.drafter.state_dict(), optimizer_state=self.optimizer.state_dict(),
            scheduler_state=self.scheduler.state_dict(), data_position=data_position, config=self.config.to_dict(),
            extra={"drafter_config": self.drafter.config.to_dict(), "run_id": self.run_id},
            keep=self.config.keep_states))
