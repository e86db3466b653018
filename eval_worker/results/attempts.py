"""The attempt suffix of a job id: `<base id>-r<n>` is the n-th forced re-evaluation of `<base id>`.

Written by the service (service/jobs/ids.py names jobs), read by the ledger (its index is keyed by
base id), so it lives here, below both.
"""
from __future__ import annotations

import re

_SUFFIX = re.compile(r"-r\d+$")


def with_attempt(base_id: str, attempt: int) -> str:
    """The job id of attempt `attempt` of `base_id` (attempt 0 is the base id itself)."""
    return base_id if not attempt else f"{base_id}-r{int(attempt)}"


def strip_attempt(job_id: str) -> str:
    """The base id of a job id (`...-r3` -> `...`)."""
    return _SUFFIX.sub("", job_id)
