"""A checkpoint location's kind is decided in one place (issue 33): `CheckpointRef` and the storage interface.

Checked on the source by AST: outside the modules that define locations (`common/urls.py`: the syntax,
`checkpoints/storage.py`: the stores, `checkpoints/location.py`: the value), no module asks a string what
kind of place it names (`is_url(...)`, `.startswith("s3://")` or another store protocol's), derives
a Store (`store_for(...)`) or reads a store's `.local` / `.read_only`. Every other layer parses once
(`CheckpointRef.parse`) and asks the value (`ref.on_this_machine`, `ref.kind`, `ref.store()`, `ref.within`).
"""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("dflash_train", "eval_worker", "hooks")
HOME = {"dflash_train/common/urls.py", "dflash_train/checkpoints/storage.py", "dflash_train/checkpoints/location.py"}
CALLS = {"is_url", "store_for"}
ATTRIBUTES = {"local", "read_only"}
# checkpoint-store protocols (an MLflow `sqlite:///` or a `rediss://` URL is not a checkpoint location)
STORE_PROTOCOLS = {"s3", "s3a", "gs", "gcs", "hf", "memory", "az", "abfs", "file"}
# (module, name): at most 4, each with why
EXCEPTIONS = {
    # the checkpoint contract is written once against the Store interface: it opens the store of a location
    # it was handed (with the published file modes) and asks it whether pins may be written (the Hub: never)
    ("dflash_train/checkpoints/publication.py", "store_for"),
    ("dflash_train/checkpoints/publication.py", "read_only"),
    # the checkpoint cache downloads a URL a confined job named: the store is the transport
    ("eval_worker/service/worker/checkpoint_cache.py", "store_for"),
}


def _sources():
    for d in PACKAGES:
        for path in sorted((REPO / d).rglob("*.py")):
            rel = path.relative_to(REPO).as_posix()
            if rel not in HOME:
                yield rel, ast.parse(path.read_text())


def _kind_questions(tree: ast.AST) -> list[tuple[str, int]]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
            if name in CALLS:
                found.append((name, node.lineno))
            if (name == "startswith" and node.args and isinstance(node.args[0], ast.Constant)
                    and isinstance(node.args[0].value, str) and "://" in node.args[0].value
                    and node.args[0].value.split("://")[0] in STORE_PROTOCOLS):
                found.append(("startswith", node.lineno))
        elif isinstance(node, ast.Attribute) and node.attr in ATTRIBUTES and isinstance(node.ctx, ast.Load):
            found.append((node.attr, node.lineno))
    return found


def test_location_kind_is_decided_only_by_the_ref_and_the_storage_interface():
    offenders = [(rel, name, line) for rel, tree in _sources() for name, line in _kind_questions(tree)
                 if (rel, name) not in EXCEPTIONS]
    assert offenders == [], ("parse the location once (dflash_train.checkpoints.location.CheckpointRef) and ask "
                             f"the value: {offenders}")


def test_exceptions_are_few_and_still_needed():
    assert len(EXCEPTIONS) <= 4
    used = {(rel, name) for rel, tree in _sources() for name, _ in _kind_questions(tree)}
    assert EXCEPTIONS <= used, f"stale exceptions: {EXCEPTIONS - used}"


def test_the_rule_sees_what_it_forbids():
    """The checker itself: each forbidden form is found (a rule that finds nothing proves nothing)."""
    code = ('storage.is_url(x)\nis_url(x)\nstore_for(x).local\np.startswith("s3://")\ns.read_only\n'
            'ref.on_this_machine\np.startswith("/")\nu.startswith("sqlite:///")\n')
    assert sorted(n for n, _ in _kind_questions(ast.parse(code))) == sorted(
        ["is_url", "is_url", "store_for", "local", "startswith", "read_only"])
