"""The GPU-only paths no test here runs still match the code they call.

Some code runs only on a CUDA machine or under torchrun (the compiled flex_attention mask, the
CUDA-stream hidden-state queue, NCCL and the DDP wrapper, the CUDA branches of bench/gpu_check.py),
so a renamed module, class or torch name would first break on a machine lent for minutes.
`bench/gpu_check.sh --dry-run` runs the device check's parts on the CPU (tests/integration/test_gpu_check.py);
here, on CPU, for the modules and scripts with GPU-only branches (`GPU_PATHS`): every import (lazy ones
inside functions too) and every attribute chain off an imported name (`torch.cuda.Event`,
`dist.ReduceOp.SUM`, `torch.nn.parallel.DistributedDataParallel`, ...) resolves.
"""
from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# files whose CUDA / torchrun branches no CPU test executes, and what those branches are
GPU_PATHS = {
    "dflash_train/core/masks.py": "flex_attention BlockMask, compiled on CUDA",
    "dflash_train/core/model.py": "torch.compile'd flex_attention on CUDA",
    "dflash_train/training/hidden_queue.py": "CUDA streams and events between producer and trainer",
    "dflash_train/training/distributed.py": "NCCL process group, collectives",
    "dflash_train/training/trainer.py": "DDP wrapper, pinned host staging",
    "bench/train_throughput.py": "run by bench/gpu_check.py (smoke) on cuda",
    "bench/gpu_check.py": "the device check's CUDA branches (peak memory, synchronize, device name)",
    "tests/support/ddp_worker.py": "one rank under torchrun (tests/unit/training/test_ddp.py, slow pass)",
}


def _package_of(rel: str) -> str:
    return rel[:-3].replace("/", ".").rpartition(".")[0]


def _import_bindings(tree: ast.AST, package: str = "") -> dict[str, object]:
    """Import every module and name `tree` imports (anywhere, lazy imports too); {bound name: object}."""
    bound: dict[str, object] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                module = importlib.import_module(alias.name)
                if alias.asname:
                    bound[alias.asname] = module
                else:
                    top = alias.name.split(".")[0]
                    bound[top] = importlib.import_module(top)
        elif isinstance(node, ast.ImportFrom):
            name = "." * node.level + (node.module or "")
            module = importlib.import_module(name, package or None)
            for alias in node.names:
                if hasattr(module, alias.name):
                    obj = getattr(module, alias.name)
                else:  # a submodule not imported by its package
                    try:
                        obj = importlib.import_module(f"{module.__name__}.{alias.name}")
                    except ModuleNotFoundError:
                        pytest.fail(f"`from {name} import {alias.name}`: {module.__name__} has no {alias.name}")
                bound[alias.asname or alias.name] = obj
    return bound


def _chains(tree: ast.AST, roots: set[str]) -> set[tuple[str, ...]]:
    """Dotted attribute chains off the names in `roots` (`torch.cuda.Event` -> ("torch", "cuda", "Event"))."""
    found = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        parts = []
        cur: ast.expr = node
        while isinstance(cur, ast.Attribute):
            parts.append(cur.attr)
            cur = cur.value
        if isinstance(cur, ast.Name) and cur.id in roots:
            found.add((cur.id, *reversed(parts)))
    # the longest chains cover their prefixes
    return {c for c in found if not any(o != c and o[:len(c)] == c for o in found)}


def _unresolved_chains(tree: ast.AST, bound: dict[str, object]) -> list[str]:
    missing = []
    for chain in sorted(_chains(tree, set(bound))):
        obj = bound[chain[0]]
        for i, attr in enumerate(chain[1:], 1):
            if not hasattr(obj, attr):
                missing.append(".".join(chain[:i + 1]))
                break
            obj = getattr(obj, attr)
    return missing


@pytest.mark.parametrize("rel", sorted(GPU_PATHS))
def test_gpu_only_paths_resolve(rel):
    """Every import of the file (lazy ones too) and every attribute chain off an imported name exists here."""
    tree = ast.parse((ROOT / rel).read_text())
    bound = _import_bindings(tree, _package_of(rel))
    assert bound, f"{rel} imports nothing: update GPU_PATHS"
    assert _unresolved_chains(tree, bound) == [], f"{rel} ({GPU_PATHS[rel]}) uses names that are gone"


def test_gpu_paths_name_what_they_guard():
    """The branches GPU_PATHS stands for are still in those files (a move elsewhere needs this list updated)."""
    chains = {rel: {".".join(c) for c in _chains(ast.parse((ROOT / rel).read_text()),
                                                  {"torch", "dist", "nn"})} for rel in GPU_PATHS}
    sources = {rel: (ROOT / rel).read_text() for rel in GPU_PATHS}
    assert "create_block_mask" in sources["dflash_train/core/masks.py"]
    assert "flex_attention" in sources["dflash_train/core/model.py"] and "torch.compile" in chains[
        "dflash_train/core/model.py"]
    assert {"torch.cuda.Stream", "torch.cuda.Event", "torch.cuda.stream"} <= chains[
        "dflash_train/training/hidden_queue.py"]
    assert "dist.init_process_group" in chains["dflash_train/training/distributed.py"]
    assert "DistributedDataParallel" in sources["dflash_train/training/trainer.py"]
