"""Result sinks: where a finished evaluation goes after the ledger has it.

The worker calls :func:`publish_result` right after the ledger record is written. A sink
failure must never fail the job: the ledger already holds the result, and
``dflash-eval publish --run RUN`` fills any gap later. So every sink runs inside a
try/except here and the outcome is returned (and logged), never raised.

Which sinks run: the job's ``sinks`` list when it has one, else ``settings.sinks`` (``$DFLASH_SINKS``,
``--sink`` of the worker; comma-separated ``wandb``, ``tensorboard``, ``mlflow``; default ``wandb``;
``none`` turns publication off). W&B settings come from the job's ``wandb`` block,
overridden by the worker's settings (``WANDB_MODE``, ``DFLASH_WANDB_DIR``; dflash_train.common.settings);
MLflow's from the job's ``mlflow`` block (experiment, the trainer's run to nest under) and the
settings' tracking URI. Each sink publishes in a child process with a timeout (``sinks/base.py``).
"""
from __future__ import annotations

import logging
from pathlib import Path
from urllib.parse import quote

from dflash_train.common.settings import KNOWN_SINKS, Settings

log = logging.getLogger(__name__)


def _results_dir(record: dict, settings: Settings) -> Path:
    """The ledger root the record was written to, from its own path when the worker gives it
    (not the settings' default: a worker may write elsewhere with --results-dir)."""
    from eval_worker.results.ledger import Ledger

    path = record.get("path")
    return Ledger.root_of(path) if path else settings.results_dir


def _redis_url(settings: Settings, connection=None) -> str | None:
    """The Redis the worker uses, for the sink's child (its writer lock): ``settings.redis_url``, else the URL
    the worker's connection was opened with (`redis_client.url_of`: scheme, user and TLS options unchanged),
    else one rebuilt from a connection opened elsewhere (a plain `rq worker`), its TLS and user kept."""
    if settings.redis_url:
        return settings.redis_url
    try:
        if connection is None:
            from rq import get_current_job

            job = get_current_job()
            if job is None:
                return None
            connection = job.connection
        from eval_worker.redis_client import url_of

        url = url_of(connection)
        if url:
            return url
        pool = connection.connection_pool
        kw = pool.connection_kwargs
        if kw.get("path"):
            return f"unix://{kw['path']}?db={kw.get('db', 0)}"
        user = quote(kw["username"], safe="") if kw.get("username") else ""
        auth = f"{user}:{quote(kw['password'], safe='')}@" if kw.get("password") else (f"{user}@" if user else "")
        scheme = "rediss" if getattr(pool.connection_class, "__name__", "") == "SSLConnection" else "redis"
        return f"{scheme}://{auth}{kw.get('host', 'localhost')}:{kw.get('port', 6379)}/{kw.get('db', 0)}"
    except Exception:  # noqa: BLE001 - no RQ context: the local file lock still applies
        return None


def _publish_wandb(record: dict, job: dict, settings: Settings) -> dict:
    from eval_worker.results.run_results import result_of
    from eval_worker.results.sinks.wandb_sink import publish_in_child, target_from

    result = result_of(record)
    run_id = (job or {}).get("run_id") or result["checkpoint"]["run_id"]
    target = target_from((job or {}).get("wandb"), settings)
    if target.mode == "disabled":
        return {"mode": "disabled"}
    return publish_in_child(run_id, target, results_dir=_results_dir(record, settings), redis_url=_redis_url(settings),
                            timeout_s=settings.wandb_timeout_s)


def _publish_tensorboard(record: dict, job: dict, settings: Settings) -> dict:
    from eval_worker.results.run_results import result_of
    from eval_worker.results.sinks.base import publish_in_child
    from eval_worker.results.sinks.tensorboard_sink import TensorBoardTarget

    run_id = (job or {}).get("run_id") or result_of(record)["checkpoint"]["run_id"]
    target = TensorBoardTarget(root=settings.tensorboard_dir, primary_suite=settings.wandb_primary_suite)
    return publish_in_child("tensorboard", run_id, target, results_dir=_results_dir(record, settings),
                            redis_url=_redis_url(settings), timeout_s=settings.sink_timeout_s)


def _publish_mlflow(record: dict, job: dict, settings: Settings) -> dict:
    from eval_worker.results.run_results import result_of
    from eval_worker.results.sinks.base import publish_in_child
    from eval_worker.results.sinks.mlflow_sink import target_from

    run_id = (job or {}).get("run_id") or result_of(record)["checkpoint"]["run_id"]
    target = target_from((job or {}).get("mlflow"), settings)
    return publish_in_child("mlflow", run_id, target, results_dir=_results_dir(record, settings),
                            redis_url=_redis_url(settings), timeout_s=settings.sink_timeout_s)


_SINKS = {"wandb": _publish_wandb, "tensorboard": _publish_tensorboard, "mlflow": _publish_mlflow}


def publish_result(record: dict, job: dict | None, settings: Settings) -> dict[str, dict]:
    """Publish one ledger record to every enabled sink; never raises.

    Returns ``{sink: {"ok": bool, ...}}`` so the caller can log or show it.
    """
    if settings.unknown_sinks:
        log.warning("ignoring unknown sink(s) %s in $DFLASH_SINKS (known: %s)", list(settings.unknown_sinks),
                    ", ".join(KNOWN_SINKS))
    outcome: dict[str, dict] = {}
    chosen = (job or {}).get("sinks")
    for name in (settings.sinks if chosen is None else [n for n in chosen if n in _SINKS]):
        try:
            info = _SINKS[name](record, job or {}, settings)
            outcome[name] = {"ok": True, **(info or {})}
        except Exception as e:  # noqa: BLE001 - a sink must never fail the job
            log.warning("sink %s failed (the ledger keeps the result; `dflash-eval publish` retries): %s", name, e)
            outcome[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    return outcome
