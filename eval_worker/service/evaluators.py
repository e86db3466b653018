"""The worker process's settings and its evaluators: each target loaded once per process and kept.

Why once per process: a target may be tens of GB on a GPU, and the in-memory caches
(tokenizer, reference/feature caches, compiled kernels) stay warm between jobs
(see eval_worker.service.worker for why jobs run in the worker process itself).
"""
from __future__ import annotations

import gc
import logging
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_train.common.settings import Settings
from eval_worker.service.job_schema import JobError

log = logging.getLogger(__name__)


@dataclass
class WorkerSettings:
    """What a worker process needs besides Redis: the environment's settings (`env`), with the
    command line's choices applied (`from_settings`)."""

    results_dir: Path
    roots: Sequence[Path | str] | None
    cache_dir: Path | None = None
    target_roots: Sequence[Path | str] | None = None  # where a job's `target` may lie (confinement.check_target)
    suite_roots: Sequence[Path | str] | None = None   # where a job's suite file may lie (confinement.check_suite)
    default_target: str | None = None
    device: str | None = None
    max_targets: int = 1
    evaluator_factory: str | None = None  # "module:callable(target, cache_dir=..., device=...)"
    spool_dir: Path | None = None  # computed results whose ledger write failed (default: next to the cache)
    env: Settings | None = None  # sinks and their Redis; None: read where the worker starts (a plain `rq worker`)
    checkpoint_cache_dir: Path | None = None  # local copies of checkpoints pulled from a store
    checkpoint_cache_gb: float = 20.0

    def __post_init__(self) -> None:
        if self.spool_dir is None:
            self.spool_dir = (self.cache_dir or self.results_dir).parent / "spool"
        if self.env is None:
            self.env = Settings.from_env()

    @classmethod
    def from_settings(cls, settings: Settings, **overrides) -> WorkerSettings:
        """The worker's settings: `settings` (the environment), with `overrides` (flags given) applied."""
        values: dict[str, Any] = dict(results_dir=settings.results_dir, roots=settings.checkpoint_roots,
                      target_roots=settings.target_roots, suite_roots=settings.suite_roots,
                      cache_dir=settings.cache_dir, default_target=settings.target, device=settings.device,
                      evaluator_factory=settings.evaluator_factory, spool_dir=settings.spool_dir, env=settings,
                      checkpoint_cache_dir=settings.checkpoint_cache_dir,
                      checkpoint_cache_gb=settings.checkpoint_cache_gb)
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


_settings: WorkerSettings | None = None
_checkpoint_cache = None
_evaluators: OrderedDict[str, Any] = OrderedDict()
_loads: dict[str, int] = {}
_lock = threading.Lock()


def configure(settings: WorkerSettings) -> None:
    global _settings, _checkpoint_cache
    _settings, _checkpoint_cache = settings, None


def checkpoint_cache():
    """This process's cache of checkpoints pulled from object stores (eval_worker.service.checkpoint_cache)."""
    global _checkpoint_cache
    s = settings()
    if _checkpoint_cache is None:
        from eval_worker.service.checkpoint_cache import CheckpointCache

        root = s.checkpoint_cache_dir or s.env.checkpoint_cache_dir or Path(s.results_dir).parent / "checkpoint-cache"
        _checkpoint_cache = CheckpointCache(root, max_bytes=int(s.checkpoint_cache_gb * 2**30))
    return _checkpoint_cache


def settings() -> WorkerSettings:
    global _settings
    if _settings is None:  # a plain `rq worker` running our jobs: its process is the edge
        _settings = WorkerSettings.from_settings(Settings.from_env())
    return _settings


def target_loads(target: str | None = None) -> int:
    """How many times this process has loaded `target` (or any target)."""
    if target is None:
        return sum(_loads.values())
    return _loads.get(os.path.realpath(target), 0)


def loaded_targets() -> list[str]:
    """The targets this process holds loaded (real paths), least recently used first."""
    with _lock:
        return list(_evaluators)


def _new_evaluator(target: str, s: WorkerSettings):
    if s.evaluator_factory:
        from importlib import import_module

        module, _, name = s.evaluator_factory.partition(":")
        factory = getattr(import_module(module), name)
    else:
        from eval_worker.engine.acceptance import Evaluator as factory
    kwargs: dict[str, Any] = {"cache_dir": str(s.cache_dir) if s.cache_dir else None}
    if s.device:
        kwargs["device"] = s.device
    return factory(target, **kwargs)


def get_evaluator(target: str):
    """The Evaluator for `target`, loaded once per process and kept (LRU of `max_targets`)."""
    s = settings()
    key = os.path.realpath(target)
    with _lock:
        ev = _evaluators.get(key)
        if ev is not None:
            _evaluators.move_to_end(key)
            return ev
        if not os.path.isdir(key):
            raise JobError(f"target {target} is not a directory on this worker")
        while len(_evaluators) >= max(1, s.max_targets):
            old, _ = _evaluators.popitem(last=False)
            log.info("unloading target %s to make room for %s", old, key)
            gc.collect()
            _empty_device_cache()
        t0 = time.monotonic()
        ev = _new_evaluator(key, s)
        _evaluators[key] = ev
        _loads[key] = _loads.get(key, 0) + 1
        log.info("loaded target %s in %.1fs (load #%d in pid %d)", key, time.monotonic() - t0, _loads[key], os.getpid())
        return ev


def _empty_device_cache() -> None:
    import torch  # loaded already (an evaluator was); not at import: `rq worker` imports this module

    if torch.cuda.is_available():
        torch.cuda.empty_cache()

