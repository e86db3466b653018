"""Shared fixtures. Keep this file small; put feature-specific fixtures next to their tests."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
TINY_TARGET = REPO_ROOT / "dflash_train" / "assets" / "tiny_target"

# 2 shared cores: keep BLAS/torch from oversubscribing. Set before torch is imported.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Nothing is downloaded in tests: `datasets` and `huggingface_hub` read these when imported.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"

# fixtures of support modules, available to every test without importing them
pytest_plugins = ["tests.support.reliability_support"]


def _hypothesis_profiles() -> None:
    """``HYPOTHESIS_PROFILE=ci`` (set by ``.ci/run``) draws the same examples every run,
    so a CI result can be reproduced here; plain ``make test`` keeps exploring."""
    try:
        from hypothesis import settings
    except ImportError:
        return
    settings.register_profile("ci", derandomize=True, print_blob=True)
    settings.register_profile("dev")
    settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "dev"))


_hypothesis_profiles()


@pytest.hookimpl(tryfirst=True)  # before pytest-timeout reads its setting
def pytest_configure(config: pytest.Config) -> None:
    # the per-test bound (pyproject's `timeout`) scales like every wait in the tests (tests/support/waits.py)
    if getattr(config.option, "timeout", None) is None and not os.environ.get("PYTEST_TIMEOUT"):
        from tests.support import waits

        try:
            ini = config.getini("timeout")
        except ValueError:  # pytest-timeout not installed: no such setting
            ini = None
        if ini:
            config.option.timeout = float(ini) * waits.SCALE
    try:
        import torch
    except ImportError:  # torch-free test subsets still run
        return
    torch.set_num_threads(1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip ``@pytest.mark.gpu`` tests when no CUDA device is available."""
    gpu_items = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu_items:
        return
    try:
        import torch

        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if not has_cuda:
        skip = pytest.mark.skip(reason="needs a CUDA device")
        for item in gpu_items:
            item.add_marker(skip)


@pytest.fixture(scope="session", autouse=True)
def _isolated_dflash_home(tmp_path_factory: pytest.TempPathFactory):
    """No test touches ~/.cache or a real Redis by accident.

    DFLASH_HOME points at a per-session temp dir and REDIS_URL is unset, so code
    that calls ``resolve_redis_url()`` starts its local server there; that server
    is stopped when the session ends.
    """
    home = tmp_path_factory.mktemp("dflash_home")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DFLASH_HOME", str(home))
        mp.setenv("HF_DATASETS_CACHE", str(home / "hf-datasets"))  # read when `datasets` is imported
        for var in ("REDIS_URL", "DFLASH_REDIS_PASSWORD"):
            mp.delenv(var, raising=False)
        yield home
    if (home / "redis").exists():
        from eval_worker.service.local_redis.server import LocalRedis

        LocalRedis(home / "redis").stop()


@pytest.fixture(autouse=True)
def _no_repeat_limiter_left(request: pytest.FixtureRequest):
    """A command run in-process (`cli(["worker", ...])`) installs the RepeatLimiter on every root handler,
    pytest's log-capture handlers included, which pytest keeps for the whole session: a later test's
    warning would then be held back as a repeat of an earlier test's. Each test starts without it."""
    yield
    from dflash_train.common.progress import RepeatLimiter

    plugin = request.config.pluginmanager.get_plugin("logging-plugin")
    handlers = [*logging.getLogger().handlers, getattr(plugin, "caplog_handler", None),
                getattr(plugin, "report_handler", None)]
    for handler in handlers:
        for f in list(getattr(handler, "filters", ())):
            if isinstance(f, RepeatLimiter):
                handler.removeFilter(f)


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory):
    """A real ``redis-server`` for the whole session (a :class:`LocalRedis`).

    Has ``.url``, ``.port``, ``.stop()`` and ``.start()``; ``start()`` after
    ``stop()`` restarts on the same port from the same AOF directory, so fault
    tests can take Redis away and bring it back. ``appendfsync always`` makes
    every acknowledged write survive even a SIGKILL.
    """
    from eval_worker.service.local_redis.server import LocalRedis

    server = LocalRedis(tmp_path_factory.mktemp("redis_server"), appendfsync="always")
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def redis_url(redis_server) -> str:
    """URL of the session Redis, flushed before the test (restarted if a test stopped it)."""
    from eval_worker.redis_client import connect

    if not redis_server.is_running():
        redis_server.start()
    client = connect(redis_server.url)
    try:
        client.flushall()
    finally:
        client.close()
    return redis_server.url


@pytest.fixture
def worker_evaluators():
    """`worker_evaluators(settings)`: fresh `Evaluators` with those settings, installed as this process's
    (what the job function uses) for the test; the ones installed before come back after it."""
    from eval_worker.service.worker import evaluators

    previous = evaluators.install(None)

    def install(settings) -> evaluators.Evaluators:
        made = evaluators.Evaluators(settings)
        evaluators.install(made)
        return made

    yield install
    evaluators.install(previous)


@pytest.fixture
def conn(redis_url):
    """A client of the session's redis-server (its database flushed per test by `redis_url`)."""
    from eval_worker.redis_client import connect

    c = connect(redis_url)
    yield c
    c.close()


@pytest.fixture
def tiny_target_path() -> Path:
    """The bundled tiny target model directory (skips if it is not there yet)."""
    if not (TINY_TARGET / "config.json").is_file():
        pytest.skip(f"bundled tiny target missing: {TINY_TARGET}")
    return TINY_TARGET


@pytest.fixture
def wandb_offline(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """W&B in offline mode, writing under a temp dir; returns WANDB_DIR."""
    wandb_dir = tmp_path / "wandb"
    wandb_dir.mkdir()
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(wandb_dir))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb_config"))
    monkeypatch.setenv("WANDB_CACHE_DIR", str(tmp_path / "wandb_cache"))
    monkeypatch.setenv("WANDB_DATA_DIR", str(tmp_path / "wandb_data"))
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_SERVICE", raising=False)
    yield wandb_dir
    # wandb keeps a process-wide service and the settings it read at its first init (WANDB_DIR
    # among them) and exports WANDB_SERVICE to children: reset both so no test writes into
    # another test's directory or publishes through its service.
    if "wandb" in sys.modules:
        sys.modules["wandb"].teardown()
    os.environ.pop("WANDB_SERVICE", None)


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory):
    """A real S3-compatible server (moto, subprocess) with this process pointed at it through
    the standard AWS variables; `s3_server.make_bucket(name)` creates a bucket."""
    pytest.importorskip("s3fs", reason="s3fs is in the dev extra (pip install -e '.[dev]')")
    pytest.importorskip("moto.server", reason="moto[server] is in the dev extra (pip install -e '.[dev]')")
    from dflash_train.checkpoints import storage
    from tests.support.s3_server import S3Server

    server = S3Server(tmp_path_factory.mktemp("s3") / "moto.log")
    with pytest.MonkeyPatch.context() as mp:
        for k, v in server.env().items():
            mp.setenv(k, v)
        storage._filesystem.cache_clear()
        try:
            yield server
        finally:
            storage._filesystem.cache_clear()
            server.stop()
