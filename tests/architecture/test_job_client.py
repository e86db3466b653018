"""One way to enqueue (issue 33): every producer puts its jobs on the queue through `JobClient`.

Checked on the source by AST: only `eval_worker/service/queueing/client.py` calls RQ's enqueue methods;
no producer imports its `enqueue` primitive (they hold a `JobClient`: outbox, delivery, resend, dedupe).
"""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("dflash_train", "eval_worker", "hooks")
CLIENT = "eval_worker/service/queueing/client.py"
# RQ's ways to put a job on a queue (Queue methods, the private one included)
ENQUEUE_METHODS = {"enqueue", "enqueue_call", "enqueue_job", "_enqueue_job", "enqueue_many", "enqueue_at",
                   "enqueue_in", "enqueue_dependents"}
# (module, method): not a producer, each named with why
EXCEPTIONS = {
    # the worker puts a job it was running back at the front of its queue (same job, same id: a hand-back
    # on shutdown or a Redis outage, not a new job); RQ internals, checked in test_rq_internals.py
    ("eval_worker/service/worker/worker.py", "_enqueue_job"),
}
PRODUCERS = ("hooks/eval_on_checkpoint.py", "hooks/deepspec.py", "eval_worker/commands/watch.py",
             "eval_worker/service/queueing/submission.py", "eval_worker/commands/enqueue.py")


def _sources():
    for d in PACKAGES:
        for path in sorted((REPO / d).rglob("*.py")):
            yield path.relative_to(REPO).as_posix(), ast.parse(path.read_text())


def test_jobclient_is_the_only_caller_of_rq_enqueue():
    found = set()
    for rel, tree in _sources():
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ENQUEUE_METHODS and rel != CLIENT):
                found.add((rel, node.func.attr))
    assert found - EXCEPTIONS == set(), "enqueue through eval_worker.service.queueing.client.JobClient"
    assert EXCEPTIONS <= found, "an exception no longer needed: remove it from EXCEPTIONS"


def test_jobclient_primitive_is_not_imported_by_producers():
    """`job_client.enqueue` is the client's own queue write; producers hold a `JobClient`."""
    found = []
    for rel, tree in _sources():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").endswith("job_client") and rel != CLIENT:
                found += [(rel, a.name) for a in node.names if a.name == "enqueue"]
    assert found == []


def test_jobclient_every_producer_holds_one():
    trees = dict(_sources())
    without = [rel for rel in PRODUCERS
               if not any(isinstance(n, ast.Name) and n.id == "JobClient" for n in ast.walk(trees[rel]))]
    assert without == []
