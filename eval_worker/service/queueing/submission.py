"""Submitting evaluations: checkpoints (or run directories) named by a user turned into jobs and queued.

The service side of `dflash-eval enqueue`: which paths a run directory stands for, one job per
checkpoint and suite, the workers' own target spelled out, each job sent through the `JobClient`
(its `deliver_outbox` delivers hook outboxes). The command parses flags and prints what it gets
back; nothing here prints.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_train.checkpoints import storage
from dflash_train.checkpoints.location import CheckpointRef
from dflash_train.checkpoints.publication import MARKER_NAME, list_checkpoints
from eval_worker.service.jobs.request import EvalRequest
from eval_worker.service.jobs.schema import JobError, JobPayload
from eval_worker.service.queueing.client import EnqueueOutcome, JobClient
from eval_worker.service.queueing.queue import queue_name, workers_target


def _ref(path: str) -> CheckpointRef | None:
    """The location's ref; None for a store URL that breaks the rules (make_job says what is wrong with it)."""
    try:
        return CheckpointRef.parse(path)
    except storage.StoreError:
        return None


def is_published(path: str) -> bool:
    """Whether `path` is a published checkpoint or a run directory of them (else: a drafter to import)."""
    ref = _ref(path)
    if ref is None or not ref.on_this_machine:  # never imported: a store URL is published or refused by make_job
        return True
    return (ref.path / MARKER_NAME).exists() or bool(list_checkpoints(ref.path))


def expand_checkpoints(paths: Sequence[str]) -> list[str]:
    """A run directory (no marker of its own, published step-* inside) stands for its checkpoints."""
    out: list = []
    for p in paths:
        ref = _ref(p)
        if ref is None:
            inner = []  # make_job says what is wrong with it
        elif not ref.on_this_machine:  # a run prefix in a store stands for its marked step prefixes
            try:
                inner = [] if ref.store().exists(storage.join(ref.text, MARKER_NAME)) else list_checkpoints(ref.text)
            except (storage.StoreError, OSError):  # no library for its protocol, the store unreachable
                inner = []  # make_job says what is wrong with it
        else:
            inner = [] if (Path(p) / MARKER_NAME).exists() else list_checkpoints(p)
        out.extend(str(c) for c in inner) if inner else out.append(p)
    return out


@dataclass
class Submission:
    """What was asked (the request: everything but the checkpoints) and what came of it."""

    request: EvalRequest
    roots: Sequence[Path | str] | None = None
    jobs: list[JobPayload] = field(default_factory=list)
    outcomes: list[EnqueueOutcome] = field(default_factory=list)
    errors: list[dict[str, Any]] = field(default_factory=list)  # {"checkpoint", ["suite"], "error"}

    def make_jobs(self, paths: Sequence[str]) -> None:
        """One job per checkpoint and suite (suites deduplicated); what cannot be made goes to `errors`."""
        for path in paths:
            for suite in self.request.suites:
                try:
                    self.jobs.append(self.request.job(path, suite, roots=self.roots))
                except (JobError, storage.StoreError, OSError) as e:  # OSError: StoreUnavailable, no answer
                    self.errors.append({"checkpoint": path, "suite": suite, "error": str(e)})

    def enqueue_all(self, client: JobClient, *, force: bool = False) -> None:
        """Enqueue every job made through `client` (its roots checked again at the queue); a job naming no
        target gets the workers' own, spelled out (the same job as one naming it). A server that refuses
        writes (out of memory, MISCONF, ...) stops the loop: that job and every one after it is an error
        saying why and what fixes it."""
        import redis

        from eval_worker.redis_client import refusal_message, server_unavailable

        for i, job in enumerate(self.jobs):
            try:
                if not job.target:
                    queue = queue_name(client.config.base, job.priority)
                    job = job.replace(target=workers_target(client.connection(), queue))
                self.outcomes.append(client.send(job, force=force))
            except (JobError, storage.StoreError, OSError) as e:
                self.errors.append({"checkpoint": job.checkpoint, "error": str(e)})
            except redis.exceptions.RedisError as e:
                if not server_unavailable(e):
                    raise
                why = f"not queued: {refusal_message(e, client.connection())}"
                self.errors += [{"checkpoint": j.checkpoint, "error": why} for j in self.jobs[i:]]
                return
