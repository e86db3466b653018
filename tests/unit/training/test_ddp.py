"""torchrun with 2 CPU processes (gloo): ranks stay identical and equal one process on the global batch."""
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dflash_train.training.trainer import Trainer
from tests.support.train_helpers import small_config, target_and_examples

OVERRIDES = {"max_steps": 4, "batch_size": 4, "publish_every": 2, "queue_depth": 2, "noise_std": 0.01}

DDP_WORKER = Path(__file__).resolve().parents[2] / "support" / "ddp_worker.py"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow  # ~10-25 s: CI's slow pass (the default suite stays under 10 min on 2 cores)
def test_two_process_ddp_matches_single_process(tmp_path):
    out = tmp_path / "ddp"
    out.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).resolve().parents[3])}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(_free_port()), str(DDP_WORKER), str(out),
           json.dumps(OVERRIDES)]
    # Own process group: on a timeout the ranks torchrun started die with it (a plain
    # subprocess.run timeout kills torchrun alone and leaves the ranks running).
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        _, stderr = proc.communicate(timeout=480)  # ~20 s alone, minutes on a loaded 2-core box; under pytest-timeout
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, stderr[-4000:]

    r0, r1 = (torch.load(out / f"rank{r}.pt", weights_only=True) for r in (0, 1))
    for k in r0:
        assert torch.equal(r0[k], r1[k]), f"ranks diverged at {k}"
    info0, info1 = (json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1))
    assert info0["step"] == info1["step"] == 4
    assert info0["losses"] == info1["losses"]  # the logged loss is the global one on every rank
    assert len(info0["checkpoints"]) == 2 and info1["checkpoints"] == []  # rank 0 alone publishes

    target, examples = target_and_examples()
    single = Trainer(small_config(tmp_path / "single", **OVERRIDES), target=target, examples=list(examples))
    summary = single.train()
    for k, v in single.drafter.state_dict().items():
        torch.testing.assert_close(r0[k], v, rtol=1e-4, atol=1e-6, msg=f"DDP != single process at {k}")
    assert max(abs(a - b) for a, b in zip(summary.losses, info0["losses"], strict=False)) < 1e-5
    moved = sum(float((v - r0[k]).abs().max()) for k, v in Trainer(
        small_config(tmp_path / "init", **OVERRIDES), target=target,
        examples=list(examples)).drafter.state_dict().items())
    assert moved > 1e-3  # the weights did train (the comparison is not of two untouched inits)
