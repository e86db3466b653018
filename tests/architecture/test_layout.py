"""Structure rules of the code base, checked on the source rather than trusted."""
from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("dflash_train", "eval_worker", "hooks")
OURS = ("dflash_train", "eval_worker", "hooks", "tests", "bench", "tools")


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
    """The run-id rule is written once (dflash_train/checkpoints/publication.py); everyone else imports it."""
    pattern = re.compile(r"\[A-Za-z0-9\]\[A-Za-z0-9\._-\]|\[A-Za-z0-9\]\[A-Za-z0-9\.\\_-\]")
    found = [p.relative_to(REPO).as_posix() for d in PACKAGES for p in (REPO / d).rglob("*.py")
             if pattern.search(p.read_text())]
    assert found == ["dflash_train/checkpoints/publication.py"]


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

    from eval_worker.service.queueing.queue import JOB_FUNC
    from eval_worker.service.worker.eval_job import run_eval_job

    defined = [rel for rel, tree in _sources(*PACKAGES) for node in ast.walk(tree)
               if isinstance(node, (ast.Assign, ast.AnnAssign))
               and any(isinstance(t, ast.Name) and t.id == "JOB_FUNC"
                       for t in (node.targets if isinstance(node, ast.Assign) else [node.target]))]
    assert defined == ["eval_worker/service/queueing/queue.py"]
    module, _, name = JOB_FUNC.rpartition(".")
    assert getattr(import_module(module), name) is run_eval_job


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


# --- layer rules -------------------------------------------------------------------------------------------------
# dflash_train: common < core < checkpoints < training (a module imports its own layer or lower ones only);
# eval_worker: engine and results sit beside each other above dflash_train, service above both, commands on top;
# hooks uses the service. Every import counts, lazy ones inside functions too.
LAYERS = {"dflash_train.common": 0, "dflash_train.core": 1, "dflash_train.checkpoints": 2, "dflash_train.training": 3}


def _module_of(rel: str) -> str:
    return rel[:-3].replace("/", ".").removesuffix(".__init__")


def _resolved_imports(rel: str, tree) -> list[str]:
    """Absolute dotted names of what `rel` imports (relative imports resolved; `from X import y` gives X.y too)."""
    pkg = _module_of(rel) if rel.endswith("__init__.py") else _module_of(rel).rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = pkg.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            out += [base] + [f"{base}.{a.name}" for a in node.names]
    return out


def _graph(*dirs: str) -> dict[str, set[str]]:
    return {_module_of(rel): set(_resolved_imports(rel, tree)) for rel, tree in _sources(*dirs)}


def _under(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def test_dflash_train_never_imports_hooks_or_eval_worker():
    found = {(m, i) for m, imps in _graph("dflash_train").items() for i in imps
             if _under(i, "hooks") or _under(i, "eval_worker")}
    assert found == set()


def test_dflash_train_layers_import_downward_only():
    def layer(name: str) -> int | None:
        return next((v for k, v in LAYERS.items() if _under(name, k)), None)

    found = {(m, i) for m, imps in _graph("dflash_train").items() if layer(m) is not None for i in imps
             if layer(i) is not None and layer(i) > layer(m)}  # type: ignore[operator]
    assert found == set()


def test_installed_packages_never_import_tools():
    """tools/ is not installed: an import of it would work in a checkout and fail where the package is installed."""
    found = {(m, i) for m, imps in _graph(*PACKAGES).items() for i in imps if _under(i, "tools")}
    assert found == set()


def test_every_dflash_train_module_has_a_layer():
    """Every module sits in a layer's package (a layer's own `__init__` is that layer); `assets/` holds data only."""
    loose = {m for m in _graph("dflash_train") if m.count(".") == 1 and m not in LAYERS
             and m not in ("dflash_train.__main__",)}
    assert loose == set(), "a module outside common/core/checkpoints/training: give it a layer"


def test_engine_imports_only_the_core_checkpoints_and_kernel():
    allowed = ("dflash_train.core", "dflash_train.checkpoints", "dflash_train.common", "eval_worker.engine")
    found = {(m, i) for m, imps in _graph("eval_worker/engine").items() for i in imps
             if i.split(".")[0] in ("dflash_train", "eval_worker", "hooks") and not any(_under(i, a) for a in allowed)
             and i not in ("dflash_train", "eval_worker")}
    assert found == set()


def test_results_never_import_the_service_or_commands():
    found = {(m, i) for m, imps in _graph("eval_worker/results").items() for i in imps
             if _under(i, "eval_worker.service") or _under(i, "eval_worker.commands") or _under(i, "hooks")}
    assert found == set()


def test_only_commands_import_commands_and_hooks():
    """`hooks` uses the service; below the commands (the top layer, e.g. the demo composing trainer, hook and
    worker) nothing in eval_worker imports hooks or a command."""
    found = {(m, i) for m, imps in _graph("eval_worker").items() if not _under(m, "eval_worker.commands")
             and m != "eval_worker.cli" for i in imps if _under(i, "eval_worker.commands") or _under(i, "hooks")}
    assert found == set()


def test_no_import_cycles_between_modules():
    """No two modules of ours import each other, directly or around a loop (lazy imports included)."""
    graph = _graph(*PACKAGES)
    mods = set(graph)
    edges = {m: {i for i in imps if i in mods and i != m} for m, imps in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[set[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = set()
            while True:
                w = stack.pop()
                comp.add(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(comp)

    for m in sorted(mods):
        if m not in index:
            visit(m)
    assert cycles == [], cycles


def test_the_service_reads_a_validated_job_by_attribute():
    """A job is validated once into a frozen model and read as `job.step`, not `job["step"]`: dicts only where it
    leaves the process (the outbox's files are JSON data, read back before validation)."""
    json_side = {"eval_worker/service/queueing/outbox.py"}
    trees = [*_sources("eval_worker/service", "hooks"),
             ("eval_worker/results/ledger.py", ast.parse((REPO / "eval_worker/results/ledger.py").read_text()))]
    found = [(rel, node.lineno) for rel, tree in trees if rel not in json_side for node in ast.walk(tree)
             if (isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id == "job"
                 and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str))
             or (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get"
                 and isinstance(node.func.value, ast.Name) and node.func.value.id == "job")]
    assert found == []


def test_every_test_lives_where_its_kind_says():
    """tests/: unit/<package>/ (a folder per package layer), integration/, reliability/, architecture/; helpers in
    support/ (importable, also by bench/); nothing loose at the top but conftest.py."""
    units = {"common", "core", "checkpoints", "training", "engine", "service", "results", "hooks"}
    kinds = {"integration", "reliability", "architecture", "support", "unit"}
    root = REPO / "tests"
    loose = sorted(p.name for p in root.glob("*.py") if p.name not in ("__init__.py", "conftest.py"))
    assert loose == []
    assert {p.name for p in root.iterdir() if p.is_dir() and not p.name.startswith((".", "_"))} == kinds
    assert {p.name for p in (root / "unit").iterdir() if p.is_dir() and not p.name.startswith((".", "_"))} == units
    assert not list((root / "support").glob("test_*.py")), "support/ holds helpers, not tests"
    folders = [root / k for k in kinds - {"unit"}] + [root / "unit" / u for u in units]
    assert all((d / "__init__.py").exists() for d in folders), "each folder a package: test names may repeat"


def test_readme_layout_table_names_every_dflash_train_module():
    """The README's map of dflash_train/: each layer's header, then every module and folder of that layer."""
    readme = (REPO / "README.md").read_text()
    table = readme[readme.index("| **`dflash_train/`**"):readme.index("| **`eval_worker/`**")]
    listed, sub = set(), ""
    for row in table.splitlines()[1:]:
        first = row.split("|")[1]
        head = re.fullmatch(r"\s*\*\*`(\w+)/`\*\*\s*", first)
        if head:
            sub = head.group(1) + "/"
            continue
        names = re.findall(r"`([\w.]+/?)`", first)
        listed |= {("" if name == "assets/" else sub) + name for name in names}  # assets/: the package's data
    root = REPO / "dflash_train"
    present = {p.relative_to(root).as_posix() + ("/" if p.is_dir() else "")
               for layer in LAYERS for p in (REPO / layer.replace(".", "/")).iterdir()
               if not p.name.startswith(("_", ".")) and (p.suffix == ".py" or p.is_dir())}
    present.add("assets/")
    assert listed == present
