"""The GPU-only scripts no test here runs still match the code they call.

`bench/gpu_smoke.sh` runs only on a CUDA machine, so a renamed module, class or config field
would first break there, on a machine lent for minutes. This reads the script's embedded Python
and its command lines and checks, on CPU, every import, every `TrainConfig(...)` field and every
flag it passes to a bench script.
"""
from __future__ import annotations

import ast
import dataclasses
import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SMOKE = ROOT / "bench" / "gpu_smoke.sh"


def _embedded_python() -> list[str]:
    """The bodies of the script's `<<'PYEOF'` here-documents."""
    return re.findall(r"<<'PYEOF'\n(.*?)\nPYEOF", SMOKE.read_text(), flags=re.S)


def _trees() -> list[ast.Module]:
    blocks = _embedded_python()
    assert blocks, "bench/gpu_smoke.sh has no embedded Python any more: update this test"
    return [ast.parse(b) for b in blocks]


def test_gpu_smoke_imports_resolve():
    seen = 0
    for tree in _trees():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in (
                    "dflash_train", "eval_worker", "hooks", "bench"):
                module = importlib.import_module(node.module)
                for alias in node.names:
                    assert hasattr(module, alias.name), f"gpu_smoke.sh imports {node.module}.{alias.name}: gone"
                seen += 1
    assert seen >= 2


def test_gpu_smoke_train_config_fields_exist():
    from dflash_train.training.train_config import TrainConfig

    fields = {f.name for f in dataclasses.fields(TrainConfig)} if dataclasses.is_dataclass(TrainConfig) else set(
        TrainConfig.model_fields)
    used = set()
    for tree in _trees():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "TrainConfig":
                used |= {k.arg for k in node.keywords if k.arg}
    assert used, "gpu_smoke.sh builds no TrainConfig any more: update this test"
    assert used <= fields, f"gpu_smoke.sh passes TrainConfig fields that do not exist: {sorted(used - fields)}"


def test_gpu_smoke_bench_flags_exist():
    """Each `"$PY" bench/X.py --flag ...` line names flags X's parser accepts (parsed, not run)."""
    text = SMOKE.read_text().replace("\\\n", " ")
    calls = re.findall(r'"\$PY" (bench/\w+\.py)([^\n]*)', text)
    assert calls, "gpu_smoke.sh runs no bench script any more: update this test"
    for script, rest in calls:
        source = (ROOT / script).read_text()
        for flag in re.findall(r"(--[\w-]+)", rest):
            assert re.search(rf"""["']{re.escape(flag)}["']""", source), f"{script} has no {flag} option"
