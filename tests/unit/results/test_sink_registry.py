"""The sinks come from one registry and keep one contract (`sinks/base.py`), published through one child
entry point (`sinks/child.py`) that is given the Redis URL the worker is connected with."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest

from dflash_train.common.settings import KNOWN_SINKS, Settings
from eval_worker.results.sinks import publish_result, registry
from eval_worker.results.sinks.base import Sink, SinkError, register


@pytest.fixture
def settings(tmp_path):
    return Settings.from_env({"DFLASH_HOME": str(tmp_path / "home")})


def test_sink_registry_resolves_every_configured_sink_name():
    """Every name `--sink`, `$DFLASH_SINKS` and the job schema accept (settings.KNOWN_SINKS) is a registered sink,
    and every registered sink is such a name: a sink added on one side only fails here."""
    assert registry.names() == list(KNOWN_SINKS)
    for name in KNOWN_SINKS:
        assert registry.get(name).name == name


def test_sink_registry_unknown_name_is_a_clear_error(settings, tmp_path):
    """An unknown name says which names there are; the worker turns it into that sink's error and still
    publishes to the others (before, a job's unknown sink was dropped without a word)."""
    with pytest.raises(registry.UnknownSink, match=r"unknown sink 'tensorbored'; known: wandb, tensorboard, mlflow"):
        registry.get("tensorbored")
    with pytest.raises(ValueError):  # a bad name, for callers that catch ValueError
        registry.get("")
    outcome = publish_result({"path": str(tmp_path / "results" / "r" / "x.json")}, {"run_id": "r", "sinks": ["nope"]},
                             settings)
    assert outcome == {"nope": {"ok": False, "error": "UnknownSink: unknown sink 'nope'; known: wandb, tensorboard, "
                                                      "mlflow"}}


def test_sink_registry_every_sink_implements_the_protocol(settings):
    """Each registered sink is a `Sink`: a name and label, a target built from a job block and the settings
    that survives the JSON trip to the child, a timeout, and a clear error for an option it does not take."""
    labels = set()
    for name in registry.names():
        sink = registry.get(name)
        assert isinstance(sink, Sink) and not getattr(type(sink), "__abstractmethods__", None)
        labels.add(sink.label)
        target = sink.target(None, settings)
        data = json.loads(json.dumps(target.to_json()))  # what the child reads from its stdin
        assert sink.target_from_json(data) == target, name
        assert dataclasses.is_dataclass(target)
        assert sink.timeout_s(settings) > 0
        assert sink.skipped(target) is None  # the defaults publish (W&B offline)
        with pytest.raises(TypeError, match=f"{sink.label} target: unknown option"):
            sink.target(None, settings, no_such_option=1)
    assert len(labels) == len(KNOWN_SINKS)


def test_sink_registry_targets_follow_the_job_block_and_the_overrides(settings, tmp_path):
    """The job's block of a sink's name is its configuration (`wandb`, `mlflow`); the overrides win over it."""
    wandb = registry.get("wandb").target({"project": "p", "tags": ["a"], "mode": "disabled"}, settings)
    assert (wandb.project, wandb.tags, wandb.mode) == ("p", ["a"], "disabled")
    assert registry.get("wandb").skipped(wandb) == {"mode": "disabled"}
    assert registry.get("wandb").target({"mode": "disabled"}, settings, mode="offline").mode == "offline"
    ml = registry.get("mlflow").target({"experiment": "e", "parent_run_id": "abc"}, settings,
                                       tracking_uri="http://127.0.0.1:1")
    assert (ml.experiment, ml.parent_run_id, ml.tracking_uri) == ("e", "abc", "http://127.0.0.1:1")
    tb = registry.get("tensorboard").target(None, settings, root=tmp_path / "tb")
    assert tb.root == (tmp_path / "tb").resolve()
    assert registry.get("tensorboard").target(None, settings).root == settings.tensorboard_dir


def test_sink_registry_refuses_a_second_sink_of_one_name():
    before = registry.names()
    with pytest.raises(TypeError, match="two sinks named 'wandb'"):
        @register
        class Impostor(type(registry.get("tensorboard"))):  # type: ignore[misc]
            name = "wandb"
            label = "Impostor"
    with pytest.raises(TypeError, match="names no sink"):
        @register
        class Nameless(type(registry.get("tensorboard"))):  # type: ignore[misc]
            name = ""
    assert registry.names() == before and type(registry.get("wandb")).__name__ == "WandbSink"


def test_sink_registry_one_child_entry_point_reads_the_target_from_stdin(tmp_path, settings):
    """Every sink publishes through `python -m eval_worker.results.sinks.child`, its target on stdin: there is no
    `--target` on argv any more (the W&B child took its target there, visible to every user of the box)."""
    from eval_worker.results.sinks.child import publish_in_child

    sink = registry.get("tensorboard")
    target = sink.target(None, settings, root=tmp_path / "tb")
    with pytest.raises(SinkError, match=r"TensorBoard publication for 'no-run' failed \(exit 1\): ResultsError: "
                                        r"no results for run 'no-run'"):
        publish_in_child(sink, "no-run", target, results_dir=tmp_path / "results", redis_url=None, timeout_s=120)
    argv = [sys.executable, "-m", "eval_worker.results.sinks.child", "--sink", "wandb", "--run", "r",
            "--results", str(tmp_path), "--target", json.dumps({"project": "p"})]
    out = subprocess.run(argv, input="\n", capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "unrecognized arguments: --target" in out.stderr
    out = subprocess.run(argv[:4] + ["nope"] + argv[5:8], input="\n", capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "invalid choice: 'nope'" in out.stderr and "'mlflow'" in out.stderr


# --------------------------------------------------------------------------- the Redis URL the child gets


def seen_in_job(settings_url: str | None) -> str | None:
    """RQ job function: the URL a sink's child would be given inside a job run by a worker."""
    from eval_worker.results.sinks import _redis_url

    return _redis_url(dataclasses.replace(Settings.from_env(), redis_url=settings_url))


def test_rediss_sink_url_is_the_connection_the_worker_runs_the_job_on(redis_url):
    """Inside a job the child gets the URL of the worker's own connection, not `$REDIS_URL`: a worker started
    with `--redis-url` (or on `rediss://user:...@`) while the environment names another server took the lock
    on that other server, or over plain TCP."""
    from rq import Queue, SimpleWorker
    from rq.serializers import JSONSerializer

    from eval_worker.redis_client import connect

    conn = connect(redis_url)
    queue = Queue("sink-url", connection=conn, serializer=JSONSerializer)
    job = queue.enqueue(f"{__name__}.seen_in_job", "rediss://alice:s3cret@elsewhere.example:6380/0")
    SimpleWorker([queue], connection=conn, serializer=JSONSerializer).work(burst=True)
    job.refresh()
    assert job.get_status() == "finished", job.latest_result()
    assert job.return_value() == redis_url
    assert seen_in_job("rediss://alice:s3cret@elsewhere.example:6380/0") == (  # no RQ job: the settings' URL
        "rediss://alice:s3cret@elsewhere.example:6380/0")
