"""The sinks by name: the one place a sink comes from (the worker's `publish_result`, the child process,
`dflash-eval publish`, the demo).

Each sink module registers its :class:`~eval_worker.results.sinks.base.Sink` when it is imported; importing
them here is what makes the built-in ones known. Their names are the settings' `KNOWN_SINKS` (the job
schema and `--sink` check names against that list, which cannot import eval_worker).
"""
from __future__ import annotations

import eval_worker.results.sinks.mlflow_sink
import eval_worker.results.sinks.tensorboard_sink
import eval_worker.results.sinks.wandb_sink  # noqa: F401 - importing a sink module registers its sink
from dflash_train.common.settings import KNOWN_SINKS
from eval_worker.results.sinks.base import _REGISTERED, Sink, SinkError


class UnknownSink(SinkError, ValueError):
    """A sink name no module registered."""

    retryable = False


def get(name: str) -> Sink:
    """The sink registered as `name`; an unknown name is a clear error naming the known ones."""
    try:
        return _REGISTERED[name]
    except (KeyError, TypeError):
        raise UnknownSink(f"unknown sink {name!r}; known: {', '.join(names())}") from None


def names() -> list[str]:
    """The registered sinks, in the settings' order (`wandb`, `tensorboard`, `mlflow`), any other after them."""
    order = {n: i for i, n in enumerate(KNOWN_SINKS)}
    return sorted(_REGISTERED, key=lambda n: (order.get(n, len(order)), n))
