"""The trainer's hook interface (design.md "Trainer hook interface").

Callbacks are plain objects passed to the Trainer; every method is optional and is
called on rank 0 only, from the training thread:

- `on_step_end(trainer, step, metrics)`: after each optimizer step;
- `on_checkpoint_published(trainer, step, path, manifest)`: the marker exists;
- `on_train_end(trainer)`: after the last checkpoint is published;
- `protects(path) -> bool`: retention keeps `path` while any callback says True
  (e.g. an eval still queued for it).

The trainer never imports `hooks` or `eval_worker`; those packages implement this, and register
the callbacks the command line can attach by name as plug-ins (`load_plugin`).
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

log = logging.getLogger(__name__)

PLUGIN_GROUP = "dflash_train.callbacks"  # entry points: name -> factory(config, settings, redis_url, **options)


def load_plugin(name: str) -> Callable[..., Any]:
    """The callback factory a package registers under `name` (`eval`: hooks.eval_flags.eval_hook).

    Entry points invert the dependency: the package that implements a callback names itself
    to the trainer in its packaging metadata, and the trainer imports nothing of it."""
    found = entry_points(group=PLUGIN_GROUP, name=name)
    if not found:
        raise LookupError(f"no {name!r} callback plug-in is installed (entry point group {PLUGIN_GROUP}); "
                          "install the project (`pip install -e .`) so its `hooks` package registers one")
    return next(iter(found)).load()


@runtime_checkable
class TrainerCallback(Protocol):
    """Structural type; implement any subset of the methods."""

    def on_step_end(self, trainer: Any, step: int, metrics: dict) -> None: ...

    def on_checkpoint_published(self, trainer: Any, step: int, path: Path, manifest: dict) -> None: ...

    def on_train_end(self, trainer: Any) -> None: ...

    def protects(self, path: Path) -> bool: ...


class CallbackList:
    """Dispatches to the callbacks that define a method.

    A failing callback is logged and training continues (an eval sidecar must not kill a
    long run) unless `strict`, which re-raises.
    """

    def __init__(self, callbacks=(), strict: bool = False):
        self.callbacks = list(callbacks or [])
        self.strict = strict

    def _call(self, name: str, *args) -> None:
        for cb in self.callbacks:
            fn = getattr(cb, name, None)
            if fn is None:
                continue
            try:
                fn(*args)
            except Exception:
                if self.strict:
                    raise
                log.exception("callback %s.%s failed; training continues", type(cb).__name__, name)

    def on_step_end(self, trainer, step: int, metrics: dict) -> None:
        self._call("on_step_end", trainer, step, metrics)

    def on_checkpoint_published(self, trainer, step: int, path: Path, manifest: dict) -> None:
        self._call("on_checkpoint_published", trainer, step, path, manifest)

    def on_train_end(self, trainer) -> None:
        self._call("on_train_end", trainer)

    def protects(self, path: Path) -> bool:
        for cb in self.callbacks:
            fn = getattr(cb, "protects", None)
            if fn is None:
                continue
            try:
                if fn(path):
                    return True
            except Exception:
                if self.strict:
                    raise
                log.exception("callback %s.protects failed; keeping %s", type(cb).__name__, path)
                return True  # when unsure, keep the checkpoint
        return False
