"""Sinks come only from the registry (`eval_worker/results/sinks/registry.py`), checked on the source.

Outside `eval_worker/results/sinks/` no module imports a concrete sink module (`wandb_sink`, `tensorboard_sink`,
`mlflow_sink`) or names one as a string (`importlib.import_module`, a `python -m` command line): the worker,
`publish`, the demo and the benchmarks ask `registry.get(name)`. Inside the folder only the registry imports
them, so no sink leans on another one's module (TensorBoard and MLflow took `eval_run_id` from the W&B sink).

Not scanned, by design: `tests/`, whose unit tests of one sink read that sink's own module (its target class,
its `publish_run` against a real backend); the rule is about the code that ships and the benchmarks.
"""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SCANNED = ("dflash_train", "eval_worker", "hooks", "bench", "tools")
SINKS_DIR = "eval_worker/results/sinks/"
CONCRETE = {f"eval_worker.results.sinks.{m}" for m in ("wandb_sink", "tensorboard_sink", "mlflow_sink")}
# module -> why it may reach a concrete sink module directly; keep it short
EXCEPTIONS: dict[str, str] = {
    "eval_worker/results/sinks/registry.py": "imports the built-in sink modules so that they register",
}


def _sources():
    for d in SCANNED:
        for path in sorted((REPO / d).rglob("*.py")):
            yield path.relative_to(REPO).as_posix(), ast.parse(path.read_text())


def _package_of(rel: str) -> str:
    mod = rel[:-3].replace("/", ".")
    return mod.removesuffix(".__init__") if rel.endswith("__init__.py") else mod.rpartition(".")[0]


def _concrete_sinks_reached(rel: str, tree: ast.AST) -> list[tuple[int, str]]:
    """(line, module) of every import of a concrete sink module, relative or absolute, `from sinks import x`
    included, and every string constant naming one."""
    found = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = _package_of(rel).split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names = [node.value]
        line = getattr(node, "lineno", 0)
        found += [(line, n) for n in names if any(n == c or n.startswith(c + ".") for c in CONCRETE)]
    return found


def test_sink_registry_is_the_only_way_to_a_concrete_sink():
    found = {rel: hits for rel, tree in _sources() if rel not in EXCEPTIONS
             if (hits := _concrete_sinks_reached(rel, tree))}
    assert found == {}, "ask eval_worker.results.sinks.registry.get(name) for a sink instead"


def test_sink_registry_exceptions_are_still_needed():
    """An exception that no longer reaches a concrete sink module is stale: remove it."""
    sources = dict(_sources())
    assert {rel for rel in EXCEPTIONS if _concrete_sinks_reached(rel, sources[rel])} == set(EXCEPTIONS)


def test_sink_registry_registers_every_sink_module():
    """A sink module in the folder is one the registry imports (one that is not would never be found)."""
    present = {f"eval_worker.results.sinks.{p.stem}" for p in (REPO / SINKS_DIR).glob("*_sink.py")}
    registry = ast.parse((REPO / SINKS_DIR / "registry.py").read_text())
    assert present == CONCRETE == {n for _, n in _concrete_sinks_reached(SINKS_DIR + "registry.py", registry)
                                   if n in CONCRETE}


def test_sink_registry_one_child_entry_point():
    """One `python -m` entry point publishes for every sink (`child.py`), none of its own per sink."""
    mains = set()
    for path in sorted((REPO / SINKS_DIR).glob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if (isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
                    and isinstance(node.test.left, ast.Name) and node.test.left.id == "__name__"):
                mains.add(path.name)
    assert mains == {"child.py"}
