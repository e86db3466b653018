"""`eval_worker/service` is four sub-packages that import in one direction (issue 33).

- `jobs/`: what a job is (schema, ids, builder, confinement, the checkpoint checks): imports no other one;
- `local_redis/`: the embedded redis-server manager: imports no other one;
- `queueing/`: putting jobs on the queue and reading it (queue, outbox, the JobClient, routing): jobs, local_redis;
- `worker/`: the worker runtime (EvalWorker, the job function, evaluators, the checkpoint cache, rq_compat).

Checked on every import statement (function-level ones included) by AST; a name inside a string
(`JOB_FUNC`) is not an import.
"""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SERVICE = REPO / "eval_worker" / "service"
ALLOWED = {"jobs": set(), "local_redis": set(), "queueing": {"jobs", "local_redis"},
           "worker": {"jobs", "queueing", "local_redis"}}


def _imported(tree: ast.AST) -> set[str]:
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return out


def _subpackage(module: str) -> str | None:
    parts = module.split(".")
    return parts[2] if parts[:2] == ["eval_worker", "service"] and len(parts) > 2 else None


def test_service_subpackages_import_in_one_direction():
    wrong = []
    for path in sorted(SERVICE.rglob("*.py")):
        rel = path.relative_to(SERVICE).parts
        if len(rel) < 2:
            continue
        mine = rel[0]
        for module in _imported(ast.parse(path.read_text())):
            other = _subpackage(module)
            if other and other != mine and other not in ALLOWED[mine]:
                wrong.append((path.relative_to(REPO).as_posix(), module))
    assert wrong == [], f"imports against the service's direction ({ALLOWED}): {wrong}"


def test_service_holds_only_its_subpackages():
    loose = sorted(p.name for p in SERVICE.glob("*.py") if p.name != "__init__.py")
    assert loose == [], f"a module belongs in one of {sorted(ALLOWED)}: {loose}"
    assert sorted(p.name for p in SERVICE.iterdir() if p.is_dir() and p.name != "__pycache__") == sorted(ALLOWED)


def test_rq_subclasses_live_in_rq_compat_or_name_why():
    """RQ's classes are subclassed in `worker/rq_compat.py`, besides the worker itself (worker.py) and the job
    guard (job_guard.py): the internals test (tests/architecture/test_rq_internals.py) lists what they override."""
    import_names = {"Worker", "SimpleWorker", "Job", "RQScheduler", "StartedJobRegistry", "Queue"}
    homes = set()
    for path in sorted((REPO / "eval_worker").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                    isinstance(b, ast.Name) and b.id in import_names for b in node.bases):
                homes.add(path.relative_to(REPO).as_posix())
    assert homes <= {"eval_worker/service/worker/rq_compat.py", "eval_worker/service/worker/worker.py",
                     "eval_worker/service/worker/job_guard.py"}, homes
