"""The client side of the project's Redis: URLs, connecting, and what its errors mean.

Here, at the top of `eval_worker`, rather than in `service/`: the results' sinks (the W&B writer
lock, the sinks' messages) talk to Redis too, and results never import the service; the service,
the commands and `hooks` import it alike. Not in `dflash_train.common`: the drafter and its trainer
never talk to Redis (the trainer reaches it only through the `hooks` plug-in). The embedded
redis-server that commands start when no URL is given is the service's
(`eval_worker.service.local_redis.server`).

:func:`connect` opens a client for ``redis://``, ``rediss://`` (TLS; ``ssl_*`` options go in
the URL query, e.g. ``?ssl_cert_reqs=required&ssl_ca_certs=/ca.pem``) and ``unix://`` URLs;
its errors show the URL redacted (``dflash_train.common.redaction.redact_url``, the one
redaction: use it whenever a URL is logged or shown). :func:`server_unavailable` tells a
server that cannot take a write now from a command that was wrong.
"""
from __future__ import annotations

import contextlib
import re
import weakref
from urllib.parse import quote

import redis

from dflash_train.common.errors import DFlashError
from dflash_train.common.redaction import redact_url

__all__ = [
    "ENV_URL",
    "RedisAccessError",
    "RedisAuthError",
    "RedisConnectError",
    "build_url",
    "connect",
    "refusal_message",
    "server_unavailable",
]

ENV_URL = "REDIS_URL"  # named in messages (dflash_train.common.settings reads it)


class RedisAccessError(DFlashError, RuntimeError):
    """Redis cannot be reached or set up: no or an invalid URL, a server that does not answer or
    refuses the credentials, an embedded server that cannot be started."""

    retryable = True  # a condition of the server, not of a job


class RedisConnectError(RedisAccessError, redis.exceptions.ConnectionError):
    """Could not reach the Redis named by a URL."""


class RedisAuthError(RedisConnectError, redis.exceptions.AuthenticationError):
    """Redis rejected the credentials (wrong or missing password)."""


def build_url(host: str, port: int, password: str | None, db: int = 0) -> str:
    """``redis://[:password@]host:port/db``, the password percent-encoded."""
    auth = f":{quote(password, safe='')}@" if password else ""
    return f"redis://{auth}{host}:{port}/{db}"


_URLS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # connection pool -> the URL `connect` opened


def url_of(client) -> str | None:
    """The URL a client was opened with by `connect` (scheme, user, TLS options and all), else None."""
    try:
        return _URLS.get(client.connection_pool)
    except (AttributeError, TypeError):
        return None


def connect(url: str, *, ping: bool = True, **kwargs) -> redis.Redis:
    """Open a :class:`redis.Redis` client for ``url``.

    Supports ``redis://[[user]:password@]host[:port][/db]``, ``rediss://`` (TLS;
    ``ssl_cert_reqs``, ``ssl_ca_certs``, ``ssl_certfile``, ``ssl_keyfile``,
    ``ssl_check_hostname`` ... are taken from the URL query) and
    ``unix:///path/to/redis.sock?db=0[&password=...]``. Extra keyword
    arguments go to :meth:`redis.Redis.from_url`.

    With ``ping=True`` (default) the server is contacted once, so a wrong
    password or an unreachable host fails here with :class:`RedisAuthError` /
    :class:`RedisConnectError`, whose messages show the URL redacted.
    """
    if not url:
        raise RedisAccessError(f"no Redis URL given (set {ENV_URL})")
    try:
        client = redis.Redis.from_url(url, **kwargs)
    except ValueError as exc:
        raise RedisAccessError(f"invalid Redis URL {redact_url(url)}: {exc}") from None
    _URLS[client.connection_pool] = url  # what a child process is given (`url_of`): this very URL
    if ping:
        try:
            client.ping()
        except redis.exceptions.AuthenticationError as exc:
            client.close()
            raise RedisAuthError(
                f"Redis at {redact_url(url)} rejected the credentials "
                f"(wrong or missing password in the URL): {exc}"
            ) from None
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError) as exc:
            client.close()
            raise RedisConnectError(f"cannot connect to Redis at {redact_url(url)}: {exc}") from None
        except redis.exceptions.ResponseError as exc:
            client.close()
            if "NOAUTH" in str(exc) or "WRONGPASS" in str(exc):
                raise RedisAuthError(
                    f"Redis at {redact_url(url)} rejected the credentials: {exc}"
                ) from None
            raise
    return client


# Replies of a server that is there but cannot take a write now; none is the request's fault.
_UNAVAILABLE = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError,  # incl. LOADING, auth
                redis.exceptions.OutOfMemoryError, redis.exceptions.ReadOnlyError,
                redis.exceptions.MasterDownError, redis.exceptions.TryAgainError,
                redis.exceptions.ClusterDownError, redis.exceptions.MovedError, redis.exceptions.AskError)
_UNAVAILABLE_RE = re.compile(r"(^|caused error: )(MISCONF|BUSY|NOREPLICAS|OOM|LOADING|READONLY|MASTERDOWN|"
                             r"TRYAGAIN|CLUSTERDOWN|MOVED|ASK)\b")


def server_unavailable(error: BaseException) -> bool:
    """Whether a Redis error means the server cannot serve writes right now (unreachable, out of
    memory at maxmemory, MISCONF, BUSY, LOADING, read-only replica, cluster redirection) rather
    than that the command was wrong: wait and try again."""
    if isinstance(error, _UNAVAILABLE):
        return True
    return isinstance(error, redis.exceptions.ResponseError) and bool(_UNAVAILABLE_RE.search(str(error)))


@contextlib.contextmanager
def ride_out(log, what: str):
    """Skip `what` when Redis is unavailable (`server_unavailable`); other errors propagate. The worker's and
    the scheduler's periodic writes (heartbeats, state, maintenance) wait out an outage this way."""
    try:
        yield
    except redis.exceptions.RedisError as e:
        if not server_unavailable(e):
            raise
        log.warning("%s skipped, Redis unavailable: %s", what, e)


def refusal_message(error: BaseException, connection=None) -> str:
    """One sentence for a user: why the server refused (`server_unavailable`) and what fixes it.
    `connection` (optional) lets an out-of-memory refusal name the server's limit and policy."""
    text = str(error)
    if isinstance(error, redis.exceptions.OutOfMemoryError) or text.startswith("OOM"):
        limit = ""
        if connection is not None:
            try:  # a read: a server refusing writes still answers it
                memory = connection.info("memory")
                limit = (f" (maxmemory {int(memory.get('maxmemory') or 0)} bytes reached, maxmemory-policy "
                         f"{memory.get('maxmemory_policy')})")
            except redis.exceptions.RedisError:
                pass
        return (f"Redis refuses writes: it is out of memory{limit}. Free memory on it (`dflash-eval dismiss "
                "--all` removes failed jobs; other tenants' keys) or raise its limit (`CONFIG SET maxmemory "
                "<bytes>`, or `maxmemory` in its redis.conf), then run the command again")
    if text.startswith("MISCONF"):
        return ("Redis refuses writes: it cannot save its data to disk (MISCONF; its log says why, often a full "
                "disk). Free its disk, then run the command again")
    if isinstance(error, redis.exceptions.ReadOnlyError) or text.startswith("READONLY"):
        return ("Redis refuses writes: this server is a read-only replica. Point REDIS_URL (or --redis-url) at "
                "the primary, then run the command again")
    if text.startswith("BUSY"):
        return ("Redis refuses commands: it is busy running a script (BUSY). Wait for it or stop it "
                "(`SCRIPT KILL`), then run the command again")
    if text.startswith("LOADING"):
        return "Redis is loading its data from disk (LOADING). Run the command again in a moment"
    if isinstance(error, (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError)):
        return f"cannot reach Redis ({text}). Check that it runs and REDIS_URL (or --redis-url), then run it again"
    return f"Redis cannot take writes now ({text}). Run the command again once it does"
