"""Helpers for the sidecar tests: published checkpoints, suites, worker subprocesses."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.support import waits

REPO_ROOT = Path(__file__).resolve().parents[2]


def publish_random(root: Path, run_id: str, step: int, *, target_config=None, seed: int = 1,
                   mask_token_id: int | None = None, block_size: int = 8, train_metrics=None) -> Path:
    """Publish a small random drafter with the trainer's real `publish_checkpoint`."""
    import torch

    from dflash_train.checkpoints.checkpoint import publish_checkpoint
    from dflash_train.core.config import DrafterConfig
    from dflash_train.core.model import DFlashDrafter

    if target_config is None:
        from tests.support.factories import MASK_ID, qwen3_target

        target_config = qwen3_target(layers=6, hidden=32).model.config
        mask_token_id = MASK_ID if mask_token_id is None else mask_token_id
    torch.manual_seed(seed)
    cfg = DrafterConfig.for_target(target_config, mask_token_id=mask_token_id, num_hidden_layers=1,
                                   num_features=2, block_size=block_size)
    drafter = DFlashDrafter(cfg).eval()
    return publish_checkpoint(drafter, root, run_id, step,
                              train_metrics=train_metrics or {"loss": 1.0 + step / 1000, "accuracy": 0.1})


def tiny_target_drafter_config(target_path: Path):
    from transformers import AutoConfig, AutoTokenizer

    cfg = AutoConfig.from_pretrained(target_path, local_files_only=True)
    tok = AutoTokenizer.from_pretrained(target_path, local_files_only=True)
    mask = tok.convert_tokens_to_ids("<|MASK|>")
    return cfg, int(mask)


def write_suite(path: Path, n_prompts: int = 2, max_new_tokens: int = 12) -> Path:
    lines = [{"suite": "sidecar-test", "version": "1", "chat_template": False, "max_new_tokens": max_new_tokens}]
    texts = ["def add(a, b):\n    return", "import os\nimport sys\n\ndef main():\n", "class Stack:\n    def push"]
    for i in range(n_prompts):
        lines.append({"name": f"p{i}", "prompt": texts[i % len(texts)]})
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path


def enqueue_args(suite: Path, target: Path, redis_url: str, roots: list[Path]) -> list[str]:
    """`dflash-eval enqueue`'s arguments besides the checkpoint: this suite and target, this Redis, these
    checkpoint roots (the worker's), JSON out."""
    return ["--suite", str(suite), "--target", str(target), "--redis-url", redis_url,
            *[a for r in roots for a in ("--checkpoint-root", str(r))], "--json"]


def worker_env(tmp: Path, roots: list[Path], extra: dict | None = None) -> dict:
    env = dict(os.environ)
    env.update({
        "PYTHONPATH": str(REPO_ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
        "DFLASH_CHECKPOINT_ROOTS": os.pathsep.join(map(str, roots)),
        "DFLASH_RESULTS_DIR": str(tmp / "results"),
        "DFLASH_CACHE_DIR": str(tmp / "cache"),
        "DFLASH_SINKS": "none",
        "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
        "PYTHONUNBUFFERED": "1",
    })
    env.update(extra or {})
    return env


class WorkerProcess:
    """`dflash-eval worker` in a subprocess (its own process group), with its log in a file."""

    def __init__(self, tmp: Path, redis_url: str, roots: list[Path], *, name: str, target: Path | None = None,
                 args: list[str] | None = None, env: dict | None = None):
        self.log_path = tmp / f"{name}.log"
        cmd = [sys.executable, "-m", "eval_worker", "worker", "--redis-url", redis_url, "--name", name,
               "--maintenance-interval", "1", "--job-monitoring-interval", "1", "--heartbeat-grace", "2",
               "--worker-ttl", "30", "--log-level", "INFO"]
        if target is not None:
            cmd += ["--target", str(target)]
        cmd += list(args or [])
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=worker_env(tmp, roots, env), stdout=self._log,
                                     stderr=subprocess.STDOUT, start_new_session=True)
        self.name = name

    @property
    def pid(self) -> int:
        return self.proc.pid

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        return self.log_path.read_text(errors="replace")

    def wait_registered(self, connection, timeout: float = 120.0) -> None:
        from rq.worker import Worker

        deadline = waits.deadline(timeout)
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"worker {self.name} exited with {self.proc.returncode}:\n{self.log()}")
            if any(w.name == self.name for w in Worker.all(connection=connection)):
                return
            time.sleep(0.2)
        raise AssertionError(f"worker {self.name} did not register within {waits.scaled(timeout):.0f}s "
                             f"(x{waits.SCALE:.1f}, tests/support/waits.py):\n{self.log()}")

    def signal(self, sig: int) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def kill_group(self) -> None:
        """SIGKILL the worker and everything it started (as if the machine died)."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)

    def wait(self, timeout: float) -> int:
        return self.proc.wait(timeout=timeout)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill_group()
        self._log.close()


def wait_for(predicate, timeout: float, what: str, interval: float = 0.2):
    """Poll `predicate` until it is truthy; give up after `timeout` s scaled for this machine
    (tests/support/waits.py)."""
    deadline = waits.deadline(timeout)
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {waits.scaled(timeout):.0f}s (x{waits.SCALE:.1f}, tests/support/waits.py) "
                         f"waiting for {what}")


# --- a gate in front of the real Evaluator (fault injection for the worker tests) -------------

class _GatedEvaluator:
    """The real Evaluator, but each evaluate() first logs the call to $SIDECAR_CALLS and then
    waits until the file $SIDECAR_GATE exists, so a test can act while a job is running."""

    def __init__(self, inner):
        self.inner = inner

    def evaluate(self, checkpoint_dir, suite, **kw):
        calls, gate = os.environ.get("SIDECAR_CALLS"), os.environ.get("SIDECAR_GATE")
        if calls:
            with open(calls, "a") as fh:
                fh.write(json.dumps({"pid": os.getpid(), "checkpoint": str(checkpoint_dir),
                                     "worker": os.environ.get("RQ_WORKER_ID"), "t": time.time()}) + "\n")
                fh.flush()
                os.fsync(fh.fileno())
        while gate and not os.path.exists(gate):
            time.sleep(0.05)
        return self.inner.evaluate(checkpoint_dir, suite, **kw)


def gated_evaluator(target, **kwargs):
    from eval_worker.engine.acceptance import Evaluator

    return _GatedEvaluator(Evaluator(target, **kwargs))


def read_calls(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def gated_fake_evaluator(target, **kwargs):
    """The stand-in engine (tests.support.fake_evaluator) behind the same gate: no model is loaded."""
    from tests.support.fake_evaluator import FakeEvaluator

    return _GatedEvaluator(FakeEvaluator(target, **kwargs))
