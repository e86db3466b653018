"""The job schema, the checkpoint contract and the enqueue path import no torch.

`dflash-eval enqueue`, pin/unpin and the hook's job building read a JSON marker and hash
files; importing torch (seconds, hundreds of MB) for that is what these checks keep out. Each
check runs in a fresh interpreter, so what the test process already imported does not count.
"""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers", "safetensors", "numpy")


def _imported_after(code: str) -> list[str]:
    probe = code + f"\nimport json, sys\nprint(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("code", [
    "import dflash_train.checkpoints.publication",
    "import dflash_train.checkpoints.storage, dflash_train.checkpoints.hub",
    "import eval_worker.service.worker.checkpoint_cache",
    "import eval_worker.service.jobs.schema, eval_worker.service.jobs.ids, eval_worker.service.jobs.confinement",
    "import eval_worker.service.jobs.checkpoints, eval_worker.service.jobs.builder",
    "import eval_worker.service.queueing.submission",
    "import eval_worker.service.queueing.queue, eval_worker.results.ledger",
    "import eval_worker.redis_client, eval_worker.service.local_redis.server",
    "import eval_worker.commands.enqueue",
    "import eval_worker.service.queueing.outbox, hooks",  # the hook's job building and delivery
    # a plain `rq worker` imports the job function: torch comes with the first evaluator, not before
    "import eval_worker.service.worker.eval_job, eval_worker.service.worker.job_guard",
    "import eval_worker.service.worker.worker",
    "from eval_worker.cli import build_parser; build_parser()",
    "import dflash_train.training.corpus",  # the stdlib corpus: the tiny-target builder's first stage
])
def test_module_imports_no_torch(code):
    assert _imported_after(code) == []


def test_enqueue_path_imports_no_torch(tmp_path):
    """Make and validate a job for a published checkpoint, pin it: the whole enqueue path minus Redis."""
    code = f"""
import hashlib, json, pathlib
from dflash_train.checkpoints.publication import publish_directory, pin_checkpoint
from eval_worker.service.jobs.builder import make_job
from eval_worker.service.jobs.checkpoints import check_checkpoint
from eval_worker.service.jobs.ids import job_fingerprint, job_id_for

def write(tmp):
    (tmp / "config.json").write_text("{{}}")
    (tmp / "model.safetensors").write_bytes(b"weights")
ck = publish_directory({str(tmp_path)!r}, "run-a", 5, write)
job = make_job(ck, suite="builtin:coding-v1", options={{"max_new_tokens": 8, "counting": "published"}})
check_checkpoint(job, None, verify_digest=True)
assert pin_checkpoint(ck, job_id_for(job, job_fingerprint(job)))
"""
    assert _imported_after(code) == []


def test_enqueue_command_imports_no_torch(tmp_path, redis_url):
    """`dflash-eval enqueue` for a published checkpoint, into a real Redis: queued, and no torch loaded."""
    from eval_worker.redis_client import connect
    from eval_worker.service.queueing.queue import fetch_job

    root = tmp_path / "ck"
    code = f"""
import contextlib, io, json, sys
from dflash_train.checkpoints.publication import publish_directory
from eval_worker.cli import main

def write(tmp):
    (tmp / "config.json").write_text("{{}}")
    (tmp / "model.safetensors").write_bytes(b"weights")
ck = publish_directory({str(root)!r}, "run-a", 5, write)
out = io.StringIO()
with contextlib.redirect_stdout(out):
    rc = main(["enqueue", str(ck), "--json", "--redis-url", {redis_url!r}, "--checkpoint-root", {str(root)!r}])
ids = [o["job_id"] for o in json.loads(out.getvalue())["outcomes"]]
print(json.dumps({{"rc": rc, "ids": ids, "heavy": [m for m in {HEAVY!r} if m in sys.modules]}}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert seen["rc"] == 0 and len(seen["ids"]) == 1 and seen["heavy"] == []
    assert fetch_job(connect(redis_url), seen["ids"][0]) is not None  # really queued
