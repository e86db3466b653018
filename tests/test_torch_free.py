"""The job schema, the checkpoint contract and the enqueue path import no torch.

`dflash-eval enqueue`, pin/unpin and the hook's job building read a JSON marker and hash
files; importing torch (seconds, hundreds of MB) for that is what issue 12 removed. Each
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
    "import dflash_train.publication",
    "import dflash_train.storage, dflash_train.checkpoint_cache",
    "import eval_worker.service.jobs",
    "import eval_worker.service.queue, eval_worker.results.ledger, eval_worker.service.redis_local",
    "import eval_worker.commands.enqueue",
    "from eval_worker.cli import build_parser; build_parser()",
])
def test_module_imports_no_torch(code):
    assert _imported_after(code) == []


def test_enqueue_path_imports_no_torch(tmp_path):
    """Make and validate a job for a published checkpoint, pin it: the whole enqueue path minus Redis."""
    code = f"""
import hashlib, json, pathlib
from dflash_train.publication import publish_directory, pin_checkpoint
from eval_worker.service.jobs import check_checkpoint, job_fingerprint, job_id_for, make_job

def write(tmp):
    (tmp / "config.json").write_text("{{}}")
    (tmp / "model.safetensors").write_bytes(b"weights")
ck = publish_directory({str(tmp_path)!r}, "run-a", 5, write)
job = make_job(ck, suite="builtin:coding-v1", options={{"max_new_tokens": 8, "counting": "published"}})
check_checkpoint(job, None, verify_digest=True)
assert pin_checkpoint(ck, job_id_for(job, job_fingerprint(job)))
"""
    assert _imported_after(code) == []
