"""The sink contract: what a result sink is, in code.

A sink brings one tracker (W&B, TensorBoard, MLflow) up to date with the ledger for one training run.
Every sink keeps the same promises: one writer per eval run (`wandb_lock.writer_lock`, a lock name per
sink), a publication complete from the ledger (read under the lock, so concurrent publications coalesce),
offline by default, and, in the worker, a child process with a hard timeout (`child.py`).

A sink module defines one :class:`Sink` subclass and registers it with :func:`register`; the sinks are
looked up by name in `registry.py` and nowhere else (tests/architecture/test_sink_registry.py).
"""
from __future__ import annotations

import os
from abc import ABC, abstractmethod
from typing import Any, ClassVar, Generic, Protocol, TypeVar

from dflash_train.common.errors import DFlashError
from dflash_train.common.settings import Settings


class SinkError(DFlashError, RuntimeError):
    """A publication that did not happen; the ledger still holds the result."""

    retryable = True


class SinkTarget(Protocol):
    """Where and how a sink publishes: everything a publication needs, so the child gets it whole as JSON."""

    def to_json(self) -> dict: ...


T = TypeVar("T", bound=SinkTarget)


class Sink(ABC, Generic[T]):
    """One tracker the ledger's results are published to."""

    name: ClassVar[str]   # as `--sink`, `$DFLASH_SINKS` and a job's `sinks` spell it (settings.KNOWN_SINKS)
    label: ClassVar[str]  # for messages

    @abstractmethod
    def target(self, cfg: dict | None, settings: Settings, **over: Any) -> T:
        """The target from the job's block of this sink (``job[name]``, None when it has none), the settings,
        and explicit overrides (the flags of `dflash-eval publish`, the demo's directories)."""

    @abstractmethod
    def target_from_json(self, data: dict) -> T:
        """The inverse of the target's ``to_json`` (the child's side)."""

    @abstractmethod
    def publish_run(self, run_id: str, target: T, *, results_dir: str | os.PathLike, redis_url: str | None = None,
                    force: bool = False, lock_wait_s: float = 600.0) -> dict:
        """The whole publication: take the writer lock, read the ledger under it, bring the tracker up to
        date. Returns what was done; ``records`` lists every record the tracker now holds (`owed.holds`)."""

    @abstractmethod
    def summary(self, info: dict, target: T) -> list[str]:
        """What `dflash-eval publish` prints after a publication: what was done and where to look."""

    def _options(self, over: dict[str, Any], *known: str) -> dict[str, Any]:
        """`over` with every key of `known` (None when not given); a key the sink does not know is an error."""
        unknown = sorted(set(over) - set(known))
        if unknown:
            raise TypeError(f"{self.label} target: unknown option(s) {', '.join(unknown)}; known: {', '.join(known)}")
        return {k: over.get(k) for k in known}

    def timeout_s(self, settings: Settings) -> float:
        """How long the worker waits for one publication before it kills the child."""
        return settings.sink_timeout_s

    def skipped(self, target: T) -> dict | None:
        """The outcome without a publication (no child started), or None to publish."""
        return None


_REGISTERED: dict[str, Sink] = {}


def register(cls: type[Sink]) -> type[Sink]:
    """Class decorator of a sink module: make its sink known to `registry.py` by its name."""
    if not getattr(cls, "name", None) or not getattr(cls, "label", None):
        raise TypeError(f"{cls.__name__} names no sink (`name` and `label` class attributes)")
    known = _REGISTERED.get(cls.name)
    if known is not None and (type(known).__module__, type(known).__qualname__) != (cls.__module__, cls.__qualname__):
        raise TypeError(f"two sinks named {cls.name!r}: {type(known).__name__} and {cls.__name__}")
    _REGISTERED[cls.name] = cls()
    return cls
