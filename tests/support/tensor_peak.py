"""Peak live tensor bytes of a call, from the torch profiler's allocation events (CPU; deterministic).

RSS sampling (bench/eval_speed.py `peak_during`) sees the allocator and the page cache as well as
tensors, and its spread between runs is ~0.3 MB: too coarse for sub-MB differences between two
paths. The profiler records every tensor allocation and free (size, pointer) while it runs; the
peak here is the high-water mark of the bytes the call itself allocated and had not yet freed.
Frees of tensors allocated before the call are left out (the profiler does not know their size),
so the figure does not depend on what the process held before. Only torch tensor storage is seen
(not numpy arrays, Python objects or the allocator's slack). The profiler slows the call: time it
in separate runs. Standalone (torch only), so a bench child running another checkout of the
engine can load this file by path.
"""
from __future__ import annotations

import functools
import time
import warnings
from collections.abc import Callable
from typing import Any


def allocation_events(prof) -> list[tuple[int, int, int]]:
    """(time ns, pointer, +/- bytes) of every allocation event the profiler recorded, in time order."""
    from torch._C._profiler import _EventType

    out, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.tag == _EventType.Allocation and str(node.extra_fields.device) == "cpu":
            out.append((node.start_time_ns, node.extra_fields.ptr, node.extra_fields.alloc_size))
    return sorted(out, key=lambda e: e[0])


def peak_live_bytes(events: list[tuple[int, int, int]], since: int | None = None, until: int | None = None) -> int:
    """Highest sum of the sizes allocated by `events` and not yet freed by them (frees of unknown blocks
    ignored). With `since` / `until` (ns, the events' clock: `time.time_ns()`): the highest such sum
    reached inside that window, above the sum at its start (a phase of the call)."""
    live: dict[int, int] = {}
    total = peak = base = 0
    started = since is None
    for t, ptr, size in events:
        if until is not None and t > until:
            break
        if since is not None and not started and t >= since:
            started, base, peak = True, total, total
        if size > 0:
            live[ptr] = size
            total += size
        elif ptr in live:
            total -= live.pop(ptr)
        if started:
            peak = max(peak, total)
    return peak - base if started else 0


def marked(fn: Callable[..., Any], marks: list[int]) -> Callable[..., Any]:
    """`fn`, appending `time.time_ns()` to `marks` as each call starts and ends (a phase's window for
    `peak_live_bytes`: wrap the method that is the phase)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        marks.append(time.time_ns())
        try:
            return fn(*args, **kwargs)
        finally:
            marks.append(time.time_ns())

    return wrapper


def tensor_events_during(fn: Callable[[], Any]) -> tuple[Any, list[tuple[int, int, int]]]:
    """(fn(), `allocation_events` of the call) under the profiler."""
    from torch.profiler import ProfilerActivity, profile

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the profiler's notes on empty traces
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            out = fn()
    return out, allocation_events(prof)


def tensor_peak_during(fn: Callable[[], Any]) -> tuple[Any, int]:
    """(fn(), peak bytes of CPU tensors allocated during the call and live at once)."""
    out, events = tensor_events_during(fn)
    return out, peak_live_bytes(events)
