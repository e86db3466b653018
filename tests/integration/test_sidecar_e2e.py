"""End to end on the bundled tiny target: trainer + EvalOnCheckpoint -> Redis queue -> worker subprocess -> ledger."""
from __future__ import annotations

import json

from dflash_train.training.train_config import TrainConfig
from dflash_train.training.trainer import train
from eval_worker.cli import main as cli
from eval_worker.redis_client import connect
from eval_worker.results.ledger import Ledger
from eval_worker.service.queueing.queue import fetch_job, status
from hooks import EvalOnCheckpoint
from tests.integration.test_sidecar_worker import _target
from tests.support.sidecar_support import WorkerProcess, wait_for, write_suite


def test_hook_queue_worker_ledger(tmp_path, redis_url, capsys):
    target = _target()
    root = tmp_path / "ckpts"
    suite = write_suite(tmp_path / "suite.jsonl", n_prompts=2, max_new_tokens=12)
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps({"text": f"def f{i}(x):\n    return x + {i}\n" * 3}) + "\n" for i in range(8)))
    conn = connect(redis_url)
    worker = WorkerProcess(tmp_path, redis_url, [root], name="w-e2e", target=target,
                           env={"DFLASH_SUITE_ROOTS": str(tmp_path)})  # the suite file lies beside the root
    try:
        worker.wait_registered(conn)  # warm before training starts
        hook = EvalOnCheckpoint(every_n_steps=4, queue="dflash-eval", suite=str(suite), target=str(target),
                                redis_url=redis_url)
        summary = train(TrainConfig(target=str(target), data=str(data), regenerate=False, max_steps=6,
                                    publish_every=2, keep_last=1, batch_size=2, num_anchors=4, max_seq_len=64,
                                    seq_multiple=0, block_size=8, progress=False, checkpoint_root=str(root),
                                    run_id="e2e", log_every=2), callbacks=[hook])
        assert summary.step == 6 and not hook.errors
        assert [o.status for o in hook.outcomes] == ["enqueued", "enqueued"]  # step 4, and the final step 6
        for o in hook.outcomes:
            j = fetch_job(conn, o.job_id)
            wait_for(lambda j=j: j.get_status(refresh=True).value in ("finished", "failed"), 180, f"{o.job_id}")
            assert j.get_status().value == "finished", j.latest_result().exc_string
        ledger = Ledger(tmp_path / "results")
        records = [e.read() for e in ledger.entries("e2e")]
        assert [r["step"] for r in records] == [4, 6]
        for r in records:
            assert r["result"]["schema"] == "dflash-eval-result/1"
            assert r["result"]["checkpoint"]["step"] == r["step"]
            assert r["job"]["requested_by"] == "hook" and "loss" in r["job"]["train_metrics"]
            assert isinstance(r["result"]["tau"]["macro"], float)
        assert not (root / "e2e" / "step-00000002").exists()  # not evaluated: retention took it
        runs = status(conn, run="e2e")["runs"]
        assert runs["e2e"]["evaluated"] == 2 and runs["e2e"]["latest"]["step"] == 6
        assert cli(["status", "--run", "e2e", "--redis-url", redis_url]) == 0
        assert "e2e: 2 evaluated; latest τ" in capsys.readouterr().out
    finally:
        worker.stop()
        conn.close()
