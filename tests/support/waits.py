"""Every wall-clock bound a test waits under, scaled by one documented factor.

Tests wait on events (a file appearing, a job's status, a process exiting) and poll for them;
the bound only says when to give up. On a busy machine (the suite on 2 cores next to other
work) everything is slower by about the load per core, so the bound is

    seconds * DFLASH_TEST_TIMEOUT_SCALE

where `DFLASH_TEST_TIMEOUT_SCALE` defaults to max(1, 1-minute load average / CPU count) when the
session starts; set it (e.g. 3) to give a slow CI runner more room. A test that passes only by
waiting longer is still correct: nothing asserts how fast anything was (that is `bench/`).
"""
from __future__ import annotations

import os
import time


def _default_scale() -> float:
    try:
        load = os.getloadavg()[0]
    except OSError:  # not available on this platform
        return 1.0
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1.0, load / max(cores, 1))


SCALE = float(os.environ.get("DFLASH_TEST_TIMEOUT_SCALE") or _default_scale())


def scaled(seconds: float) -> float:
    """A wait bound for this machine: `seconds` on an idle one."""
    return seconds * SCALE


def deadline(seconds: float) -> float:
    """time.monotonic() value after which a wait of `seconds` (scaled) gives up."""
    return time.monotonic() + scaled(seconds)
