"""Structure rules of the code base, checked on the source rather than trusted."""
from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("dflash_train", "eval_worker", "hooks")
OURS = ("dflash_train", "eval_worker", "hooks", "tests", "bench")


def _sources(*dirs: str):
    for d in dirs:
        for path in sorted((REPO / d).rglob("*.py")):
            yield path.relative_to(REPO).as_posix(), ast.parse(path.read_text())


def _imported(node) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom):
        return ["." * node.level + (node.module or "")]
    return []


def test_tests_do_not_import_bench():
    found = [(rel, name) for rel, tree in _sources("tests") for node in ast.walk(tree)
             for name in _imported(node) if name == "bench" or name.startswith("bench.")]
    assert found == []


def test_no_import_error_guard_around_our_own_modules():
    """A module of ours that fails to import is a bug to see, not a feature to skip."""
    found = []
    for rel, tree in _sources(*PACKAGES):
        for node in ast.walk(tree):
            if not isinstance(node, ast.Try):
                continue
            caught = {n.id for h in node.handlers for n in ast.walk(h.type or ast.Name("BaseException"))
                      if isinstance(n, ast.Name)}
            if not caught & {"ImportError", "ModuleNotFoundError"}:
                continue
            names = [name for stmt in node.body for n in ast.walk(stmt) for name in _imported(n)]
            if any(name.startswith(".") or name.split(".")[0] in OURS for name in names):
                found.append((rel, node.lineno))
    assert found == []


def test_one_run_id_pattern():
    """The run-id rule is written once (dflash_train/publication.py); everyone else imports it."""
    pattern = re.compile(r"\[A-Za-z0-9\]\[A-Za-z0-9\._-\]|\[A-Za-z0-9\]\[A-Za-z0-9\.\\_-\]")
    found = [p.relative_to(REPO).as_posix() for d in PACKAGES for p in (REPO / d).rglob("*.py")
             if pattern.search(p.read_text())]
    assert found == ["dflash_train/publication.py"]


def test_each_redis_key_belongs_to_one_module():
    """Our Redis keys (besides RQ's) are named in exactly one module each: the one that reads and writes them."""
    key = re.compile(r"^dflash(-eval)?:[\w-]+:?$")
    owners: dict[str, set[str]] = {}
    for rel, tree in _sources(*PACKAGES):
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and key.match(node.value):
                owners.setdefault(node.value, set()).add(rel)
    assert len(owners) >= 7, owners  # jobs, attempt, ledger x3, quarantine, probe, wandb lock
    assert {k: m for k, m in owners.items() if len(m) > 1} == {}
    runs = {k for k in owners if "runs" in k}
    assert runs == {"dflash:ledger-runs"}  # one RUNS_KEY


def test_job_func_is_defined_once_and_names_the_job_function():
    from importlib import import_module

    from eval_worker.service.eval_job import run_eval_job
    from eval_worker.service.queue import JOB_FUNC

    defined = [rel for rel, tree in _sources(*PACKAGES) for node in ast.walk(tree)
               if isinstance(node, (ast.Assign, ast.AnnAssign))
               and any(isinstance(t, ast.Name) and t.id == "JOB_FUNC"
                       for t in (node.targets if isinstance(node, ast.Assign) else [node.target]))]
    assert defined == ["eval_worker/service/queue.py"]
    module, _, name = JOB_FUNC.rpartition(".")
    assert getattr(import_module(module), name) is run_eval_job


def test_eval_worker_does_not_import_hooks():
    """`hooks` uses the job service; the service, the engine and the results never use `hooks` (no cycle)."""
    found = [(rel, name) for rel, tree in _sources("eval_worker") for node in ast.walk(tree)
             for name in _imported(node) if name == "hooks" or name.startswith("hooks.")]
    assert found == []


def test_readme_layout_table_names_every_eval_worker_module():
    """The README's layout table is the map of eval_worker/: every module and folder in it, nothing that is gone."""
    readme = (REPO / "README.md").read_text()
    table = readme[readme.index("| **`eval_worker/`**"):readme.index("| **`hooks/`**")]
    listed, sub = set(), ""
    for row in table.splitlines():
        first = row.split("|")[1]
        head = re.fullmatch(r"\s*\*\*`(\w+)/`\*\*\s*", first)
        if head:
            sub = "" if head.group(1) == "eval_worker" else head.group(1) + "/"
            continue
        if first.strip().startswith("`cli.py`"):
            sub = ""
        listed |= {sub + name for name in re.findall(r"`([\w.]+/?)`", first)}
    root = REPO / "eval_worker"
    present = {p.relative_to(root).as_posix() + ("/" if p.is_dir() else "")
               for pattern in ("*", "*/*") for p in root.glob(pattern)
               if not p.name.startswith(("_", ".")) and (p.suffix == ".py" or p.is_dir())
               and p.relative_to(root).parts[0] != "commands" or p.name == "commands"}
    present -= {"engine/", "service/", "results/"}
    assert listed == present
