"""Errors that say whether trying again can help.

Every error class of the project derives from `DFlashError` and declares `retryable`:

- `retryable = False`: the input is at fault (a job, a checkpoint, a config, a suite that
  is wrong), so the same request fails the same way. The eval worker fails such a job at
  once, without RQ's retries; the hook's outbox sets such a job aside.
- `retryable = True`: a condition of the moment (a disk that is full, a server that is
  unreachable, a file that changes while it is read).

Errors from outside the project (OSError, MemoryError, Redis, torch) count as retryable:
a crashed or starved worker is the typical cause, and a retry is cheap next to losing a
result. `retryable(error)` is the one place that decision is made.

The errors of checkpoints and their locations live here too: every layer above the kernel
raises or catches them (the URL rules in `urls.py`, the stores, the Hub, the trainer, the worker).
"""
from __future__ import annotations

__all__ = ["CheckpointError", "DFlashError", "StoreError", "StoreUnavailable", "retryable"]


class DFlashError(Exception):
    """Base of the project's errors; the message is the reason."""

    retryable: bool = False


def retryable(error: BaseException) -> bool:
    """Whether trying the same request again can succeed (see the module docstring)."""
    return error.retryable if isinstance(error, DFlashError) else True


class CheckpointError(DFlashError, ValueError):
    """A checkpoint that is not published, not intact, or cannot be loaded; the message says why."""


class StoreError(DFlashError, ValueError):
    """A location that is not acceptable (bad URL, unknown protocol, outside the allowed prefixes, a write to a
    read-only store)."""


class StoreUnavailable(DFlashError, OSError):
    """The store could not be reached or answered with an error: trying again may help."""

    retryable = True
