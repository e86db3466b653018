"""A new user's first hour: leftover daemons, state that can be found, checks before a long run."""
from __future__ import annotations

import os

import pytest

from dflash_train.fsutil import pid_alive
from dflash_train.settings import Settings
from eval_worker.cli import main as cli


def _settings(home, **env) -> Settings:
    return Settings.from_env({"DFLASH_HOME": str(home), **env})


# --------------------------------------------------------------------------- embedded redis: notice, status, stop


def test_redis_stop_notice_status_and_stop(tmp_path, capsys):
    """The command that starts the server says so first (stderr); `redis status` finds it and `redis stop` ends it."""
    from eval_worker.service.redis_local import LocalRedis

    settings = _settings(tmp_path)
    try:
        assert cli(["status", "--json"], settings=settings) == 0
        first = capsys.readouterr()
        assert first.err.splitlines()[0].startswith("note: started a local redis-server")
        assert "dflash-eval redis stop" in first.err
        pid = LocalRedis(settings.redis_dir).attach() and LocalRedis(settings.redis_dir)._read_state()["pid"]
        assert pid and pid_alive(pid)
        # the next command reuses it and says nothing
        assert cli(["status", "--json"], settings=settings) == 0
        assert "started" not in capsys.readouterr().err
        assert cli(["redis", "status"], settings=settings) == 0
        assert f"pid {pid}" in capsys.readouterr().out
        assert cli(["redis", "stop"], settings=settings) == 0
        assert f"stopped the local redis-server (pid {pid})" in capsys.readouterr().out
        assert not pid_alive(pid) or not LocalRedis(settings.redis_dir).attach()
        assert cli(["redis", "status"], settings=settings) == 0
        assert "no local redis-server running" in capsys.readouterr().out
        assert cli(["redis", "stop"], settings=settings) == 0  # nothing to stop is not an error
    finally:
        LocalRedis(settings.redis_dir).stop()


def test_redis_stop_refuses_while_a_worker_is_served_unless_forced(tmp_path, capsys):
    from rq.serializers import JSONSerializer
    from rq.worker import Worker

    from eval_worker.service.redis_local import LocalRedis, connect

    settings = _settings(tmp_path)
    local = LocalRedis(settings.redis_dir).start()
    try:
        conn = connect(local.url)
        worker = Worker(["dflash-eval"], connection=conn, serializer=JSONSerializer, name="w-newcomer")
        worker.register_birth()  # a registered worker whose process (this one) is alive
        assert cli(["redis", "stop"], settings=settings) == 1
        err = capsys.readouterr().err
        assert "w-newcomer" in err and "--force" in err
        assert local.is_running()
        assert cli(["redis", "status", "--json"], settings=settings) == 0
        assert '"w-newcomer"' in capsys.readouterr().out
        assert cli(["redis", "stop", "--force"], settings=settings) == 0
        assert not local.is_running()
    finally:
        LocalRedis(settings.redis_dir).stop()
