"""A worker's settings and its evaluators (`Evaluators`): each target loaded once per process and kept.

Why once per process: a target may be tens of GB on a GPU, and the in-memory caches
(tokenizer, reference/feature caches, compiled kernels) stay warm between jobs
(see eval_worker.service.worker.worker for why jobs run in the worker process itself).
"""
from __future__ import annotations

import contextlib
import gc
import logging
import os
import tempfile
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any, ClassVar

from dflash_train.common.settings import Settings
from eval_worker.service.jobs.schema import JobError

log = logging.getLogger(__name__)

PROBE_BYTES = 64 * 1024  # the cache directory's start-up write probe: what a small cache entry takes


@dataclass
class WorkerSettings:
    """What a worker process needs besides Redis: the environment's settings (`env`), with the
    command line's choices applied (`from_settings`). Every field but the worker-only ones
    (`WORKER_ONLY`) is read from the Settings field of the same name (or the one `SETTINGS_NAME`
    gives), so a setting added to both is never left uncopied."""

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

    SETTINGS_NAME: ClassVar[dict[str, str]] = {"roots": "checkpoint_roots", "default_target": "target"}
    WORKER_ONLY: ClassVar[frozenset[str]] = frozenset({"max_targets", "env"})  # a flag, and Settings itself

    def __post_init__(self) -> None:
        if self.spool_dir is None:
            self.spool_dir = (self.cache_dir or self.results_dir).parent / "spool"
        if self.env is None:
            self.env = Settings.from_env()

    @classmethod
    def from_settings(cls, settings: Settings, **overrides) -> WorkerSettings:
        """The worker's settings: `settings` (the environment), with `overrides` (flags given) applied."""
        values: dict[str, Any] = {f.name: getattr(settings, cls.SETTINGS_NAME.get(f.name, f.name))
                                  for f in fields(cls) if f.name not in cls.WORKER_ONLY}
        values["env"] = settings
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


class Evaluators:
    """A worker's settings, its checkpoint cache and the targets it holds loaded (an LRU of
    `settings.max_targets` evaluators), each loaded once and kept.

    The worker makes one and `install`s it before serving; the job function, called by RQ by
    name, finds it with `current()`. Tests make their own: `Evaluators(settings)`, installed, and
    `configure(settings)` to change the settings and keep what is loaded.
    """

    def __init__(self, settings: WorkerSettings | None = None) -> None:
        self._settings = settings  # None: read from the environment when first needed
        self._checkpoint_cache = None
        self._loaded: OrderedDict[str, Any] = OrderedDict()
        self._loads: dict[str, int] = {}
        self._states: dict[str, Any] = {}  # target -> its files' stat identities when it was loaded
        self._lock = threading.Lock()

    @property
    def settings(self) -> WorkerSettings:
        if self._settings is None:  # a plain `rq worker` running our jobs: its process is the edge
            self._settings = WorkerSettings.from_settings(Settings.from_env())
        return self._settings

    def configure(self, settings: WorkerSettings | None) -> None:
        """New settings (None: the environment's); the loaded targets are kept, the checkpoint cache
        is opened again from the new settings."""
        self._settings, self._checkpoint_cache = settings, None

    def checkpoint_cache(self):
        """The cache of checkpoints pulled from object stores (eval_worker.service.worker.checkpoint_cache)."""
        s = self.settings
        if self._checkpoint_cache is None:
            from eval_worker.service.worker.checkpoint_cache import CheckpointCache

            assert s.env is not None, "WorkerSettings fills env"
            root = (s.checkpoint_cache_dir or s.env.checkpoint_cache_dir
                    or Path(s.results_dir).parent / "checkpoint-cache")
            self._checkpoint_cache = CheckpointCache(root, max_bytes=int(s.checkpoint_cache_gb * 2**30))
        return self._checkpoint_cache

    def target_loads(self, target: str | None = None) -> int:
        """How many times `target` (or any target) has been loaded."""
        if target is None:
            return sum(self._loads.values())
        return self._loads.get(os.path.realpath(target), 0)

    def loaded_targets(self) -> list[str]:
        """The targets held loaded (real paths), least recently used first."""
        with self._lock:
            return list(self._loaded)

    def get(self, target: str):
        """The Evaluator for `target`, loaded once and kept (LRU of `settings.max_targets`)."""
        s = self.settings
        key = os.path.realpath(target)
        with self._lock:
            ev = self._loaded.get(key)
            if ev is not None and _files_state(key) == self._states.get(key):
                self._loaded.move_to_end(key)
                return ev
            if ev is not None:  # replaced in place (a user updated the target): the loaded copy is stale
                log.warning("target %s changed on disk since it was loaded (its files were replaced in place): "
                            "loading it again, so this job measures the target the directory holds now", key)
                del self._loaded[key]
                ev = None
                gc.collect()
                _empty_device_cache()
            if not os.path.isdir(key):
                raise JobError(f"target {target} is not a directory on this worker")
            while len(self._loaded) >= max(1, s.max_targets):
                old, _ = self._loaded.popitem(last=False)
                log.info("unloading target %s to make room for %s", old, key)
                gc.collect()
                _empty_device_cache()
            t0 = time.monotonic()
            state = _files_state(key)  # before the load: a change during it shows at the next job
            ev = _new_evaluator(key, s)
            self._loaded[key] = ev
            self._states[key] = state
            self._loads[key] = self._loads.get(key, 0) + 1
            log.info("loaded target %s in %.1fs (load #%d in pid %d)", key, time.monotonic() - t0, self._loads[key],
                     os.getpid())
            return ev


_current: Evaluators | None = None


def current() -> Evaluators:
    """This process's evaluators: the ones installed (by the worker), else, for a plain `rq worker`
    running our jobs, ones configured from the environment."""
    global _current
    if _current is None:
        _current = Evaluators()
    return _current


def install(evaluators: Evaluators | None) -> Evaluators | None:
    """Make `evaluators` this process's (None: the environment's, made when next needed); returns
    the ones they replace, so a test can put them back."""
    global _current
    previous, _current = _current, evaluators
    return previous


def _new_evaluator(target: str, s: WorkerSettings):
    if s.evaluator_factory:
        from importlib import import_module

        module, _, name = s.evaluator_factory.partition(":")
        factory = getattr(import_module(module), name)
    else:
        from eval_worker.engine.acceptance import Evaluator as factory
    kwargs: dict[str, Any] = {"cache_dir": _writable_cache_dir(s.cache_dir)}
    if s.device:
        kwargs["device"] = s.device
    return factory(target, **kwargs)


def _writable_cache_dir(cache_dir: Path | None) -> str | None:
    """`cache_dir` when this worker can write there, else None (no disk cache) with a warning: the
    references/features cache only saves time, and a worker whose DFLASH_HOME is a read-only mount
    (a container) failed every job after evaluating it, at the cache write."""
    if cache_dir is None:
        return None
    probe = None
    try:
        os.makedirs(cache_dir, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-probe-", dir=cache_dir)
        try:  # real bytes, flushed: an empty file takes no block and passed on a disk full by blocks
            os.write(fd, b"\0" * PROBE_BYTES)
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as e:
        log.warning("the reference/feature cache %s cannot be written (%s): this worker evaluates without a disk "
                    "cache (each job computes the target's references and features again); set DFLASH_CACHE_DIR "
                    "to a writable directory", cache_dir, e.strerror or e)
        return None
    finally:
        if probe is not None:
            with contextlib.suppress(OSError):
                os.unlink(probe)
    return str(cache_dir)


def _files_state(target: str) -> Any:
    """The stat identities (size, mtime, ctime, inode) of a model directory's identity files: a
    cheap per-job check that the loaded target is still the one on disk. None for a directory
    that is not a model directory (a test's stand-in engine) or cannot be read."""
    if not os.path.isfile(os.path.join(target, "config.json")):
        return None
    from dflash_train.core.fingerprint import directory_state  # imports torch, as loading a target does

    try:
        return directory_state(target)
    except OSError:  # a file vanished mid-listing: equal to nothing, so the target is loaded again
        return object()


def _empty_device_cache() -> None:
    import torch  # loaded already (an evaluator was); not at import: `rq worker` imports this module

    if torch.cuda.is_available():
        torch.cuda.empty_cache()

