"""examples/hf_trainer_dflash.py: a few `transformers.Trainer` steps with the project's DFlash loss on
the bundled tiny target; each save is published, queued (real redis-server) and evaluated by a real
`dflash-eval worker` into the ledger."""
from __future__ import annotations

import importlib.util

import pytest

from eval_worker.redis_client import connect
from eval_worker.results.ledger import Ledger
from eval_worker.service.queueing.queue import fetch_job
from tests.integration.test_sidecar_worker import _target
from tests.support.sidecar_support import REPO_ROOT, WorkerProcess, wait_for, write_suite


def _example():
    spec = importlib.util.spec_from_file_location("hf_trainer_dflash", REPO_ROOT / "examples" / "hf_trainer_dflash.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow  # ~10-25 s: CI's slow pass (the default suite stays under 10 min on 2 cores)
def test_hf_example_trains_and_its_evaluations_land_in_the_ledger(tmp_path, redis_url):
    target = _target()
    root = tmp_path / "ckpts"
    root.mkdir()
    suite = write_suite(root / "suite.jsonl", n_prompts=2, max_new_tokens=12)  # in the root: the worker may read it
    conn = connect(redis_url)
    worker = WorkerProcess(tmp_path, redis_url, [root], name="w-hf", target=target)
    try:
        cb = _example().main(["--target", str(target), "--out", str(root), "--run-name", "hf-ex", "--max-steps", "4",
                              "--save-steps", "2", "--suite", str(suite), "--redis-url", redis_url])
        assert not cb.errors and not cb.hook.errors
        assert sorted(o.status for o in cb.hook.outcomes) == ["enqueued", "enqueued"]
        for o in cb.hook.outcomes:
            j = fetch_job(conn, o.job_id)
            wait_for(lambda j=j: j.get_status(refresh=True).value in ("finished", "failed"), 240, o.job_id)
            assert j.get_status().value == "finished", j.latest_result().exc_string
        records = [e.read() for e in Ledger(tmp_path / "results").entries("hf-ex")]
        assert [r["step"] for r in records] == [2, 4]
        for r in records:
            assert r["job"]["requested_by"] == "hook" and r["job"]["train_metrics"]["loss"] > 0
            assert r["result"]["checkpoint"]["step"] == r["step"] and r["result"]["tau"]["macro"] >= 1.0
        # the drafter trained: the two checkpoints hold different weights
        assert records[0]["checkpoint_digest"] != records[1]["checkpoint_digest"]
    finally:
        worker.stop()
        conn.close()
