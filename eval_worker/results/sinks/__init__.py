"""Result sinks: where a finished evaluation goes after the ledger has it.

The worker calls :func:`publish_result` right after the ledger record is written. A sink
failure must never fail the job: the ledger already holds the result, and
``dflash-eval publish --run RUN`` fills any gap later. So every sink runs inside a
try/except here and the outcome is returned (and logged), never raised.

Which sinks run: the job's ``sinks`` list when it has one, else ``settings.sinks`` (``$DFLASH_SINKS``,
``--sink`` of the worker; comma-separated ``wandb``, ``tensorboard``, ``mlflow``; default ``wandb``;
``none`` turns publication off). Each comes from the registry (``registry.py``; the contract is
``base.Sink``), builds its target from the job's block of its name (``wandb``, ``mlflow``) and the
settings, and publishes in a child process with a timeout (``child.py``) that is given the Redis URL
the worker is connected with.
"""
from __future__ import annotations

import logging
from pathlib import Path
from urllib.parse import quote, urlencode

from dflash_train.common.settings import KNOWN_SINKS, Settings

log = logging.getLogger(__name__)


def _results_dir(record: dict, settings: Settings) -> Path:
    """The ledger root the record was written to, from its own path when the worker gives it
    (not the settings' default: a worker may write elsewhere with --results-dir)."""
    from eval_worker.results.ledger import Ledger

    path = record.get("path")
    return Ledger.root_of(path) if path else settings.results_dir


def _redis_url(settings: Settings, connection=None) -> str | None:
    """The Redis the worker is connected with, for the sink's child (its writer lock), so the lock is taken on
    the server the worker's jobs live on, over the same transport: the URL the connection (the given one,
    else the running RQ job's) was opened with (`redis_client.url_of`: scheme, user, password and TLS
    options as given); else, for a connection opened elsewhere (a plain `rq worker`), one rebuilt from it
    that keeps TLS, user, password and the TLS options (a `rediss://user:...@` worker must never hand its
    child a plain `redis://`); without a connection (no RQ job), ``settings.redis_url``."""
    from eval_worker.redis_client import url_of

    if connection is None:
        try:
            from rq import get_current_job

            job = get_current_job()
            connection = job.connection if job is not None else None
        except Exception as e:  # noqa: BLE001 - publish_result never raises; without a job: the settings' URL
            log.debug("no RQ job to take the Redis connection from: %s", e)
    if connection is None:
        return settings.redis_url
    url = url_of(connection)
    if url:
        return url
    try:
        return _rebuilt_url(connection.connection_pool)
    except Exception as e:  # noqa: BLE001 - an unusual client: the settings' URL, else the local file lock alone
        log.warning("cannot tell the sink which Redis the worker uses (%s: %s); using %s", type(e).__name__, e,
                    "$REDIS_URL" if settings.redis_url else "the local file lock alone")
        return settings.redis_url


_TLS_OPTIONS = ("ssl_cert_reqs", "ssl_ca_certs", "ssl_ca_path", "ssl_certfile", "ssl_keyfile", "ssl_check_hostname",
                "ssl_min_version")


def _rebuilt_url(pool) -> str:
    """A URL `redis.Redis.from_url` opens as `pool`'s connections: the transport (TCP, TLS, unix socket), the
    credentials, the database and the TLS options redis-py reads from a URL's query."""
    from redis.connection import SSLConnection, UnixDomainSocketConnection

    kw = pool.connection_kwargs
    query = {"db": kw.get("db", 0)}
    user = quote(kw["username"], safe="") if kw.get("username") else ""
    password = quote(kw["password"], safe="") if kw.get("password") else ""
    auth = f"{user}:{password}@" if password else (f"{user}@" if user else "")
    if issubclass(pool.connection_class, UnixDomainSocketConnection):
        return f"unix://{auth}{kw['path']}?" + urlencode(query)
    if issubclass(pool.connection_class, SSLConnection):
        query = {k: _query_value(kw[k]) for k in _TLS_OPTIONS if kw.get(k) is not None}
        scheme = "rediss"
    else:
        query, scheme = {}, "redis"
    host = kw.get("host", "localhost")
    host = f"[{host}]" if ":" in host else host
    return f"{scheme}://{auth}{host}:{kw.get('port', 6379)}/{kw.get('db', 0)}" + (f"?{urlencode(query)}" if query
                                                                                 else "")


def _query_value(value) -> str:
    import ssl

    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, ssl.VerifyMode):  # from_url reads none / optional / required
        return {ssl.CERT_NONE: "none", ssl.CERT_OPTIONAL: "optional"}.get(value, "required")
    if isinstance(value, int):  # an ssl.TLSVersion too: from_url reads its number
        return str(int(value))
    return str(value)


def _publish(name: str, record: dict, job: dict, settings: Settings, redis_url: str | None) -> dict:
    from eval_worker.results.run_results import result_of
    from eval_worker.results.sinks import registry
    from eval_worker.results.sinks.child import publish_in_child

    sink = registry.get(name)
    target = sink.target(job.get(name), settings)
    skipped = sink.skipped(target)
    if skipped is not None:
        return skipped
    run_id = job.get("run_id") or result_of(record)["checkpoint"]["run_id"]
    return publish_in_child(sink, run_id, target, results_dir=_results_dir(record, settings), redis_url=redis_url,
                            timeout_s=sink.timeout_s(settings))


def publish_result(record: dict, job: dict | None, settings: Settings) -> dict[str, dict]:
    """Publish one ledger record to every enabled sink; never raises.

    Returns ``{sink: {"ok": bool, ...}}`` so the caller can log or show it.
    """
    if settings.unknown_sinks:
        log.warning("ignoring unknown sink(s) %s in $DFLASH_SINKS (known: %s)", list(settings.unknown_sinks),
                    ", ".join(KNOWN_SINKS))
    outcome: dict[str, dict] = {}
    chosen = (job or {}).get("sinks")
    names = settings.sinks if chosen is None else chosen
    redis_url = _redis_url(settings) if names else None
    for name in names:
        try:
            info = _publish(name, record, job or {}, settings, redis_url)
            outcome[name] = {"ok": True, **(info or {})}
        except Exception as e:  # noqa: BLE001 - a sink must never fail the job
            log.warning("sink %s failed (the ledger keeps the result; `dflash-eval publish` retries): %s", name, e)
            outcome[name] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
    return outcome
