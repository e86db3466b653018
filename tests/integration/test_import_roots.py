"""One roots rule for `import`, `watch` and `enqueue --external` (issue 35 item 7), the same check on
`enqueue --outbox` as on a plain `enqueue` (item 8), and a missing bucket named as such by `enqueue` (item 13).

The rule, as docs/adoption.md documents it: only the record root (`--into`) must be a checkpoint root of the
worker. A trainer's checkpoint outside the roots is only read here: converted into the record root, never
recorded in place where the worker could not read it. Real CLI, real redis-server, real moto S3 server.

Select with `pytest -k "import_roots_rule or outbox_roots or bucket_missing_enqueue"`.
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from dflash_train.checkpoints.checkpoint import save_drafter
from dflash_train.checkpoints.publication import read_manifest, verify_checkpoint
from dflash_train.common.settings import Settings
from eval_worker.cli import main as cli
from eval_worker.service.jobs.builder import make_job
from eval_worker.service.queueing.outbox import Outbox
from eval_worker.service.queueing.queue import get_queue, queue_name
from tests.support.factories import drafter_for, qwen3_target
from tests.support.sidecar_support import publish_random


def _settings(home, **env) -> Settings:
    return Settings.from_env({"DFLASH_HOME": str(home), **env})


@pytest.fixture
def layout(tmp_path):
    """A run directory outside the roots (a loop's .pt, a drafter directory) and a root for the records."""
    zdir = tmp_path / "train" / "release"
    save_drafter(drafter_for(qwen3_target(layers=6, hidden=32), layers=1, features=2), zdir)
    run_dir = tmp_path / "train" / "run-a"
    run_dir.mkdir()
    torch.save({"model_state_dict": load_file(str(zdir / "model.safetensors")), "step": 20000},
               run_dir / "checkpoint_step20k.pt")
    root = tmp_path / "ckpts"
    root.mkdir()
    return {"config": zdir / "config.json", "drafter_dir": zdir, "pt": run_dir / "checkpoint_step20k.pt",
            "run_dir": run_dir, "root": root, "settings": _settings(tmp_path / "home",
                                                                     DFLASH_CHECKPOINT_ROOTS=str(root))}


def _queued(redis_url) -> list:
    from eval_worker.redis_client import connect

    q = get_queue(connect(redis_url), queue_name("dflash-eval", "default"))
    return sorted((j.meta["run_id"], j.meta["step"]) for j in q.get_jobs())


def test_import_roots_rule_a_converted_checkpoint_outside_the_roots_is_imported(layout, capsys):
    """The adoption doc's by-hand import: `import RUN_DIR/checkpoint_step20k.pt --config CFG` with only the
    record root a checkpoint root (the .pt is converted into it: the worker never reads RUN_DIR)."""
    rc = cli(["import", str(layout["pt"]), "--config", str(layout["config"]), "--json"], settings=layout["settings"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["errors"] == [], out
    record = layout["root"] / "run-a" / "step-00020000"
    assert out["records"][0]["record"] == str(record)
    assert make_job(record, suite="builtin:coding-v1", roots=[layout["root"]]).step == 20000  # the worker's check


def test_import_roots_rule_a_drafter_directory_outside_the_roots_is_converted(layout, capsys):
    """A drafter directory that would be recorded in place is converted when the worker could not read it
    where it is: the record is whole inside the record root, and the worker's own check passes."""
    rc = cli(["import", str(layout["drafter_dir"]), "--run", "rel", "--json"], settings=layout["settings"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["errors"] == [], out
    record = layout["root"] / "rel" / "step-00000000"
    manifest = verify_checkpoint(record, roots=[layout["root"]])
    assert "source" not in manifest and manifest["imported_from"]["path"] == str(layout["drafter_dir"])
    assert make_job(record, suite="builtin:coding-v1", roots=[layout["root"]]).run_id == "rel"
    # inside the roots it is still recorded in place (nothing copied)
    inside = layout["root"] / "releases" / "z"
    save_drafter(drafter_for(qwen3_target(layers=6, hidden=32), layers=1, features=2), inside)
    assert cli(["import", str(inside), "--run", "rel2"], settings=layout["settings"]) == 0
    assert read_manifest(layout["root"] / "rel2" / "step-00000000")["source"] == str(inside)


def test_import_roots_rule_the_record_root_is_checked_alike_everywhere(layout, tmp_path, redis_url, capsys):
    """A record root outside the roots is refused with one sentence by `import`, `enqueue --external` and
    `watch` alike, before anything is converted or queued."""
    outside = tmp_path / "elsewhere"
    settings = layout["settings"]
    common = ["--into", str(outside)]
    assert cli(["import", str(layout["pt"]), "--config", str(layout["config"]), *common], settings=settings) == 2
    assert cli(["enqueue", "--external", str(layout["drafter_dir"]), *common, "--redis-url", redis_url],
               settings=settings) == 2
    assert cli(["watch", str(layout["run_dir"]), "--config", str(layout["config"]), *common, "--once",
                "--redis-url", redis_url], settings=settings) == 2
    said = capsys.readouterr()
    sentence = f"record root --into {outside} is outside the checkpoint roots"
    assert (said.out + said.err).count(sentence) == 3, said
    assert not outside.exists() and _queued(redis_url) == []
    # and the same layout is accepted by all three with the record root inside
    assert cli(["enqueue", "--external", str(layout["drafter_dir"]), "--redis-url", redis_url],
               settings=settings) == 0
    assert cli(["watch", str(layout["run_dir"]), "--config", str(layout["config"]), "--once", "--settle", "0",
                "--redis-url", redis_url], settings=settings) == 0
    assert _queued(redis_url) == [("release", 0), ("run-a", 20000)]


def test_outbox_roots_enqueue_outbox_refuses_out_of_root_checkpoints(tmp_path, redis_url, capsys):
    """A hook's outbox holding a job for a checkpoint outside the roots: `enqueue --outbox` sets it aside with
    the reason a plain `enqueue` gives, and delivers the one inside."""
    inside = publish_random(tmp_path / "ckpts", "run-o", 1)
    outside = publish_random(tmp_path / "other", "run-o", 2, seed=2)
    box = Outbox(tmp_path / "box")
    for ck in (inside, outside):
        box.put(make_job(ck, suite="builtin:coding-v1").to_json())
    settings = _settings(tmp_path / "home", DFLASH_CHECKPOINT_ROOTS=str(tmp_path / "ckpts"))
    assert cli(["enqueue", str(outside), "--redis-url", redis_url], settings=settings) == 2
    plain = capsys.readouterr().out
    assert "is outside the checkpoint roots" in plain
    assert cli(["enqueue", "--outbox", str(box.dir), "--redis-url", redis_url], settings=settings) == 2
    out = capsys.readouterr().out
    assert "delivered 1, rejected 1" in out and "is outside the checkpoint roots" in out, out
    assert _queued(redis_url) == [("run-o", 1)]
    assert "is outside the checkpoint roots" in list(box.rejected().values())[0]


def test_bucket_missing_enqueue_names_the_bucket(s3_server, tmp_path, redis_url, capsys):
    url = "s3://no-such-bucket-here/runs/r/step-00000001"
    settings = _settings(tmp_path / "home", DFLASH_CHECKPOINT_ROOTS="s3://no-such-bucket-here/runs")
    assert cli(["enqueue", url, "--redis-url", redis_url], settings=settings) == 2
    out = capsys.readouterr().out
    assert "bucket 'no-such-bucket-here' does not exist" in out and "aws s3 mb s3://no-such-bucket-here" in out
    assert "no COMPLETE.json" not in out and "not published" not in out
    # a bucket that exists but has no such step still says just that
    s3_server.make_bucket("here-bucket")
    settings = _settings(tmp_path / "home", DFLASH_CHECKPOINT_ROOTS="s3://here-bucket/runs")
    assert cli(["enqueue", "s3://here-bucket/runs/r/step-00000001", "--redis-url", redis_url], settings=settings) == 2
    assert "no COMPLETE.json" in capsys.readouterr().out
