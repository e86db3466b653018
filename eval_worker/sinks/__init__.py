"""Result sinks: where a finished evaluation goes after the ledger has it.

The worker calls :func:`publish_result` right after the ledger record is written. A sink
failure must never fail the job: the ledger already holds the result, and
``dflash-eval publish --run RUN`` fills any gap later. So every sink runs inside a
try/except here and the outcome is returned (and logged), never raised.

Which sinks run: ``$DFLASH_SINKS`` (comma-separated; default ``wandb``; ``none`` turns
publication off). W&B settings come from the job's ``wandb`` block, overridden by
``WANDB_MODE`` / ``DFLASH_WANDB_DIR`` in the worker's environment.
"""
from __future__ import annotations

import logging
import os
from pathlib import Path
from urllib.parse import quote

log = logging.getLogger(__name__)

ENV_SINKS = "DFLASH_SINKS"
KNOWN = ("wandb",)


def enabled_sinks() -> list[str]:
    raw = os.environ.get(ENV_SINKS, "wandb").strip()
    if raw.lower() in ("", "none", "off", "0"):
        return []
    names = [n.strip() for n in raw.split(",") if n.strip()]
    unknown = [n for n in names if n not in KNOWN]
    if unknown:
        log.warning("ignoring unknown sink(s) %s in $%s (known: %s)", unknown, ENV_SINKS, ", ".join(KNOWN))
    return [n for n in names if n in KNOWN]


def _results_dir(record: dict) -> Path | None:
    """The ledger root the record was written to, from its own path when the worker gives it.

    Without a path, None: the default ledger location. (Not the worker module's settings:
    they outlive one worker.)
    """
    from eval_worker.ledger import Ledger

    path = record.get("path")
    return Ledger.root_of(path) if path else None


def _redis_url() -> str | None:
    """The Redis the worker uses: ``$REDIS_URL``, else the current RQ job's connection."""
    if os.environ.get("REDIS_URL"):
        return os.environ["REDIS_URL"]
    try:
        from rq import get_current_job

        job = get_current_job()
        if job is None:
            return None
        kw = job.connection.connection_pool.connection_kwargs
        if kw.get("path"):
            return f"unix://{kw['path']}?db={kw.get('db', 0)}"
        auth = f":{quote(kw['password'], safe='')}@" if kw.get("password") else ""
        return f"redis://{auth}{kw.get('host', 'localhost')}:{kw.get('port', 6379)}/{kw.get('db', 0)}"
    except Exception:  # no RQ context: the local file lock still applies
        return None


def _publish_wandb(record: dict, job: dict) -> dict:
    from eval_worker.run_results import result_of
    from eval_worker.sinks.wandb_sink import publish_in_child, target_from

    result = result_of(record)
    run_id = (job or {}).get("run_id") or result["checkpoint"]["run_id"]
    target = target_from((job or {}).get("wandb"))
    if target.mode == "disabled":
        return {"mode": "disabled"}
    return publish_in_child(run_id, target, results_dir=_results_dir(record), redis_url=_redis_url())


_SINKS = {"wandb": _publish_wandb}


def publish_result(record: dict, job: dict | None) -> dict[str, dict]:
    """Publish one ledger record to every enabled sink; never raises.

    Returns ``{sink: {"ok": bool, ...}}`` so the caller can log or show it.
    """
    outcome: dict[str, dict] = {}
    for name in enabled_sinks():
        try:
            info = _SINKS[name](record, job or {})
            outcome[name] = {"ok": True, **(info or {})}
        except Exception as e:  # noqa: BLE001 - a sink must never fail the job
            log.warning("sink %s failed (the ledger keeps the result; `dflash-eval publish` retries): %s", name, e)
            outcome[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    return outcome
