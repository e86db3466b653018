"""The GPU-only paths no test here runs still match the code they call.

`bench/gpu_smoke.sh` runs only on a CUDA machine, and some code runs only there or under
torchrun (the compiled flex_attention mask, the CUDA-stream hidden-state queue, NCCL and the
DDP wrapper), so a renamed module, class, config field or torch name would first break on a
machine lent for minutes. These checks run on CPU:

- the script's embedded Python: exactly the modules and names it imports, every
  `TrainConfig(...)` field, the attributes it reads off the trainer and its summary, and the
  fake `args` it hands to `bench/train_throughput.random_setup`;
- every flag it passes to a bench script;
- the modules and scripts with GPU-only branches (`GPU_PATHS`): every import (lazy ones
  inside functions too) and every attribute chain off an imported name (`torch.cuda.Event`,
  `dist.ReduceOp.SUM`, `torch.nn.parallel.DistributedDataParallel`, ...) resolves.
"""
from __future__ import annotations

import ast
import dataclasses
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SMOKE = ROOT / "bench" / "gpu_smoke.sh"
# files whose CUDA / torchrun branches no CPU test executes, and what those branches are
GPU_PATHS = {
    "dflash_train/core/masks.py": "flex_attention BlockMask, compiled on CUDA",
    "dflash_train/core/model.py": "torch.compile'd flex_attention on CUDA",
    "dflash_train/training/hidden_queue.py": "CUDA streams and events between producer and trainer",
    "dflash_train/training/distributed.py": "NCCL process group, collectives",
    "dflash_train/training/trainer.py": "DDP wrapper, pinned host staging",
    "bench/train_throughput.py": "run by gpu_smoke.sh with --device cuda",
    "tests/support/ddp_worker.py": "one rank under torchrun (tests/unit/training/test_ddp.py, slow pass)",
}


def _embedded_python() -> list[str]:
    """The bodies of the script's `<<'PYEOF'` here-documents."""
    return re.findall(r"<<'PYEOF'\n(.*?)\nPYEOF", SMOKE.read_text(), flags=re.S)


def _trees() -> list[ast.Module]:
    blocks = _embedded_python()
    assert blocks, "bench/gpu_smoke.sh has no embedded Python any more: update this test"
    return [ast.parse(b) for b in blocks]


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


def test_gpu_smoke_imports_resolve():
    """Exactly what the embedded Python imports, third-party modules included."""
    names = set()
    for tree in _trees():
        bound = _import_bindings(tree)
        names |= set(bound)
        assert _unresolved_chains(tree, bound) == []
    assert {"TrainConfig", "Trainer", "torch"} <= names, names


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


def test_gpu_smoke_train_config_fields_exist():
    from dflash_train.training.train_config import TrainConfig

    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    used = set()
    for tree in _trees():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "TrainConfig":
                used |= {k.arg for k in node.keywords if k.arg}
    assert used, "gpu_smoke.sh builds no TrainConfig any more: update this test"
    assert used <= fields, f"gpu_smoke.sh passes TrainConfig fields that do not exist: {sorted(used - fields)}"


def _assigned_to(tree: ast.AST, call: str) -> set[str]:
    """Names bound to the result of `call(...)` or `x.call()` (`tr = Trainer(...)`, `s = tr.train()`)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            f = node.value.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
            if name == call:
                out |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return out


def _attributes_read(tree: ast.AST, names: set[str]) -> set[str]:
    return {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
            and n.value.id in names}


def test_gpu_smoke_reads_attributes_the_trainer_and_its_summary_have():
    from dflash_train.training.trainer import Trainer, TrainSummary

    source = (ROOT / "dflash_train/training/trainer.py").read_text()
    trainer_attrs = set(dir(Trainer)) | set(re.findall(r"\bself\.(\w+)\s*(?::[^=\n]*)?=", source))
    summary_attrs = {f.name for f in dataclasses.fields(TrainSummary)}
    read_tr, read_s = set(), set()
    for tree in _trees():
        read_tr |= _attributes_read(tree, _assigned_to(tree, "Trainer"))
        read_s |= _attributes_read(tree, _assigned_to(tree, "train"))
    assert read_tr and read_s, "gpu_smoke.sh no longer trains through Trainer(...).train(): update this test"
    assert read_tr <= trainer_attrs, f"Trainer has no {sorted(read_tr - trainer_attrs)}"
    assert read_s <= summary_attrs, f"TrainSummary has no {sorted(read_s - summary_attrs)}"


def test_gpu_smoke_random_setup_args_are_what_it_reads():
    """`--target random` hands `random_setup` a stand-in for its argparse namespace: it has every attribute read."""
    bench = ast.parse((ROOT / "bench/train_throughput.py").read_text())
    setup = next(n for n in ast.walk(bench) if isinstance(n, ast.FunctionDef) and n.name == "random_setup")
    param = setup.args.args[0].arg
    read = _attributes_read(setup, {param})
    given = set()
    for tree in _trees():
        calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", None) == "random_setup"]
        for call in calls:
            stand_in = call.args[0].id
            cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == stand_in)
            given |= {t.id for n in cls.body if isinstance(n, ast.Assign) for t in ast.walk(n.targets[0])
                      if isinstance(t, ast.Name)}
    assert given, "gpu_smoke.sh no longer calls random_setup: update this test"
    assert read <= given, f"random_setup reads {sorted(read - given)}, which gpu_smoke.sh's stand-in lacks"


def test_gpu_smoke_bench_flags_exist():
    """Each `"$PY" bench/X.py --flag ...` line names flags X's parser accepts (parsed, not run)."""
    text = SMOKE.read_text().replace("\\\n", " ")
    calls = re.findall(r'"\$PY" (bench/\w+\.py)([^\n]*)', text)
    assert calls, "gpu_smoke.sh runs no bench script any more: update this test"
    for script, rest in calls:
        source = (ROOT / script).read_text()
        for flag in re.findall(r"(--[\w-]+)", rest):
            assert re.search(rf"""["']{re.escape(flag)}["']""", source), f"{script} has no {flag} option"
