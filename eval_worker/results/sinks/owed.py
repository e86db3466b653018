"""Publications a job left to a later job of its run, and whether a sink's outcome holds a record.

A job of an offline-W&B run leaves its publication to the run's next queued job (one rebuild for a
backlog instead of one per job: `eval_job._next_job_of_run`). The debt is written down in Redis
(``dflash:sinks-owed:<run>``: deferring job id -> its record's path) so that the job it was left to
pays it whatever its own outcome: a success publishes the whole run and settles it, a failure
publishes the owed records before it fails. Only `dflash-eval publish` settles a debt whose job never runs.
"""
from __future__ import annotations

import contextlib
import json
import logging
from pathlib import Path

log = logging.getLogger(__name__)

OWED_PREFIX = "dflash:sinks-owed:"


def owe(connection, run_id: str, job_id: str, record_path: Path | str, deferred_to: str) -> None:
    """Note that `job_id`'s record at `record_path` is left to `deferred_to`'s publication."""
    if connection is None:
        return
    try:
        connection.hset(OWED_PREFIX + run_id, job_id,
                        json.dumps({"path": str(record_path), "deferred_to": deferred_to}))
    except Exception as e:  # noqa: BLE001 - the later job publishes the whole run anyway when it succeeds
        log.warning("could not note the publication of %s left to %s: %s", job_id, deferred_to, e)


def pending(connection, run_id: str) -> Path | None:
    """The record path of one owed publication of `run_id` (any will do: a publication covers the run)."""
    if connection is None:
        return None
    for raw in connection.hvals(OWED_PREFIX + run_id):
        with contextlib.suppress(ValueError, KeyError, TypeError):
            return Path(json.loads(raw)["path"])
    return None


def settle(connection, run_id: str) -> None:
    """The run was published from the ledger: nothing is owed any more."""
    if connection is None:
        return
    try:
        connection.delete(OWED_PREFIX + run_id)
    except Exception as e:  # noqa: BLE001 - a stale debt only costs one idempotent publication
        log.debug("could not clear the owed publications of %s: %s", run_id, e)


def holds(info: dict, record: dict) -> bool:
    """Whether a sink's outcome (`records`: ``"<step>:<key>:<attempt>"`` of every record it has) includes
    `record` or a newer attempt of it; True when the sink does not say (disabled)."""
    have = info.get("records")
    if not isinstance(have, list):
        return True
    prefix = f"{record.get('step')}:{record.get('key')}:"
    attempts = [int(k[len(prefix):]) for k in have if isinstance(k, str) and k.startswith(prefix)
                and k[len(prefix):].isdigit()]
    return any(a >= int(record.get("attempt") or 0) for a in attempts)
