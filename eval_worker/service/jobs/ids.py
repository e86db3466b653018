"""Job identity: one id per distinct evaluation, one spelling per target, the suite fingerprint in the id.

`eval-<run>-<step>-<digest[:12]>-<suitefp[:8]>[-r<attempt>]` is enqueued with RQ's `unique=True`,
so the same evaluation asked twice is one job (service/queueing/queue.py); the attempt suffix is
results/attempts.py's (the ledger's index reads it too).
"""
from __future__ import annotations

import hashlib
import json
import os
import re
from typing import Any

from eval_worker.engine.options import OptionsError, options_identity, shorten
from eval_worker.engine.suite import request_fingerprint
from eval_worker.results.attempts import with_attempt
from eval_worker.service.jobs.schema import JobError, JobPayload

_JOB_ID_UNSAFE = re.compile(r"[^A-Za-z0-9_-]")


def _safe_part(text: str) -> str:
    """`text` with characters RQ refuses in job ids replaced; a short hash keeps it unique."""
    safe = _JOB_ID_UNSAFE.sub("_", text)
    if safe != text:
        safe += "_" + hashlib.sha256(text.encode()).hexdigest()[:6]
    return safe


def base_job_id(run_id: str, step: int, digest: str, suite_fp: str) -> str:
    """`eval-<run>-<step>-<digest[:12]>-<suitefp[:8]>`: one id per distinct evaluation."""
    return f"eval-{_safe_part(run_id)}-{int(step)}-{digest[:12]}-{_safe_part(suite_fp[:8])}"


def job_id_for(job: JobPayload, suite_fp: str) -> str:
    """The RQ job id of `job`: the base id, plus `-r<attempt>` for forced re-evaluations."""
    return with_attempt(base_job_id(job.run_id, job.step, job.checkpoint_digest, suite_fp), job.attempt)


def canonical_target(target: str | os.PathLike) -> str:
    """One spelling per target directory (symlinks, `..` and trailing slashes resolved), so that
    `--target ./t/`, `--target /abs/t` and a worker's own `--target t` name the same job."""
    return os.path.realpath(os.fspath(target))


def suite_fingerprint(suite: str, options: dict[str, Any] | None = None, target: str | None = None,
                      baseline: str | None = None) -> str:
    """Identity of what a job evaluates (its job id's last part): the suite's fingerprint
    (eval_worker.engine.suite), folded with the options that change a result (EvalOptions.identity:
    non-default, not performance-only), the job's `target` and its `baseline` (Δτ is part of the
    result) when it has any."""
    try:
        fp = request_fingerprint(suite)  # an hf: suite: its request, so no dataset is read here
    except (OSError, ValueError, KeyError) as e:
        raise JobError(f"unknown or unreadable suite {shorten(suite)}: {shorten(str(e), 300)}") from None
    try:
        options = options_identity(options)
    except OptionsError as e:
        raise JobError(str(e)) from None
    if options or target or baseline:
        spec = {"suite": fp, "options": options, **({"target": target} if target else {}),
                **({"baseline": baseline} if baseline else {})}
        fp = hashlib.sha256(json.dumps(spec, sort_keys=True).encode()).hexdigest()[:16]
    return fp


def job_fingerprint(job: JobPayload) -> str:
    """`suite_fingerprint` of a job's suite, options, target and baseline."""
    return suite_fingerprint(job.suite, job.options, job.target, job.baseline)
