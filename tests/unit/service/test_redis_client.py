"""eval_worker.redis_client: connecting by URL (redis://, unix://; rediss:// is in test_redis_server.py, next to
the TLS-built server it needs), its errors redacted, and what a server's refusal means."""
from __future__ import annotations

import pytest
import redis

from dflash_train.common.redaction import redact_url
from eval_worker.redis_client import RedisAccessError, RedisConnectError, connect, server_unavailable
from eval_worker.service.local_redis import server as embedded
from eval_worker.service.local_redis.server import LocalRedis


@pytest.mark.parametrize(
    "url, expected",
    [
        ("redis://:hunter2@host:6379/0", "redis://:***@host:6379/0"),
        ("redis://user:hunter2@host:6379/0", "redis://user:***@host:6379/0"),
        ("rediss://default:hunter2@h.example:6380/1?ssl_cert_reqs=required", "rediss://default:***@h.example:6380/1?ssl_cert_reqs=required"),
        ("redis://hunter2@host:6379", "redis://***@host:6379"),
        ("unix:///run/redis.sock?db=0&password=hunter2", "unix:///run/redis.sock?db=0&password=***"),
        ("redis://127.0.0.1:6379/0", "redis://127.0.0.1:6379/0"),
        ("redis://:p%40ss%3Aw@host/0", "redis://:***@host/0"),
        ("", ""),
        (None, None),
    ],
)
def test_redact_url(url, expected):
    assert redact_url(url) == expected
    if url:
        assert "hunter2" not in redact_url(url)


def test_invalid_url_message_is_redacted():
    with pytest.raises(RedisAccessError) as info:
        connect("http://:hunter2@host:6379/0")
    assert "hunter2" not in str(info.value)


def test_unreachable_is_connect_error():
    port = embedded.free_port()
    with pytest.raises(RedisConnectError, match=f"127.0.0.1:{port}"):
        connect(f"redis://:hunter2@127.0.0.1:{port}/0", socket_connect_timeout=2)


def test_unix_socket_url(tmp_path):
    sock = tmp_path / "redis.sock"
    server = LocalRedis(tmp_path / "r", extra_config={"unixsocket": str(sock), "unixsocketperm": 700})
    try:
        server.start()
        client = connect(f"unix://{sock}?db=2")
        client.set("via", "unix")
        assert connect(server.url.replace("/0", "/2")).get("via") == b"unix"
    finally:
        server.stop()


@pytest.mark.parametrize("error, unavailable", [
    (redis.exceptions.ConnectionError("Connection refused"), True),
    (redis.exceptions.TimeoutError("Timeout reading from socket"), True),
    (redis.exceptions.OutOfMemoryError("command not allowed when used memory > 'maxmemory'"), True),
    (redis.exceptions.ResponseError("MISCONF Redis is configured to save RDB snapshots"), True),
    (redis.exceptions.ResponseError("BUSY Redis is busy running a script"), True),
    (redis.exceptions.ResponseError("Command # 1 (SET) of pipeline caused error: LOADING Redis is loading"), True),
    (redis.exceptions.ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value"), False),
    (redis.exceptions.ResponseError("ERR unknown command 'FOO'"), False),
    (ValueError("not a redis error"), False),
])
def test_server_unavailable_tells_a_server_condition_from_a_wrong_command(error, unavailable):
    assert server_unavailable(error) is unavailable


def test_connect_errors_are_redis_access_errors_and_retryable(redis_url):
    """A command catches RedisAccessError for every way Redis cannot be reached; none is the job's fault."""
    assert issubclass(RedisConnectError, RedisAccessError) and RedisConnectError.retryable
    assert connect(redis_url).ping()
    with pytest.raises(RedisAccessError, match="no Redis URL given"):
        connect("")
