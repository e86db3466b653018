"""`EvalRequest`: one typed request, checked once at each edge (enqueue flags, the hook, a training config)."""
from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eval_worker.service.jobs.builder import make_job
from eval_worker.service.jobs.request import EvalRequest
from eval_worker.service.jobs.schema import JobError
from tests.support.sidecar_support import publish_random

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def published(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpts")
    return root, publish_random(root, "run-r", 200)


def test_eval_request_names_every_problem_at_once():
    with pytest.raises(JobError) as e:
        EvalRequest.of(options={"max_new_tokns": 8}, priority="urgent", sinks=["wandb", "splunk"])
    text = str(e.value)
    assert "max_new_tokns" in text and "priority" in text and "sinks" in text


@given(suites=st.lists(st.sampled_from(["builtin:coding-v1", "hf:gsm8k", "builtin:other"]), min_size=1, max_size=5),
       max_new=st.one_of(st.none(), st.integers(1, 512)), priority=st.sampled_from(["high", "default", "low"]))
@settings(max_examples=25, deadline=None)
def test_eval_request_jobs_equal_make_job_for_every_suite(published, suites, max_new, priority):
    """The request makes exactly the jobs make_job makes (same ids: a job's identity never depends on the edge)."""
    root, ckpt = published
    options = {"max_new_tokens": max_new} if max_new else None
    request = EvalRequest.of(suites=suites, options=options, priority=priority, requested_by="hook")
    assert list(request.suites) == list(dict.fromkeys(suites))  # each suite once, in the order asked
    want = [make_job(ckpt, suite=s, options=options, priority=priority, requested_by="hook", roots=[root])
            for s in dict.fromkeys(suites)]
    assert request.jobs(ckpt, roots=[root]) == want


def test_eval_request_from_train_config_maps_the_eval_flags():
    config = SimpleNamespace(eval_suite=["builtin:coding-v1", "hf:gsm8k"], eval_target="/t", eval_baseline=None,
                             eval_num_prompts=4, eval_max_new_tokens=None, wandb=True, wandb_project="p",
                             wandb_entity=None, wandb_mode="offline")
    r = EvalRequest.from_train_config(config, options={"max_new_tokens": 32})
    assert r.suites == ("builtin:coding-v1", "hf:gsm8k") and r.target == "/t" and r.requested_by == "hook"
    assert r.options == {"num_prompts": 4, "max_new_tokens": 32}  # the overrides merged key by key
    assert r.wandb == {"project": "p", "entity": None, "mode": "offline"}
    with pytest.raises(JobError, match="num_prompts"):
        EvalRequest.from_train_config(config, options={"num_prompts": 0})


def test_eval_request_a_hook_with_a_typo_fails_when_built_not_at_its_first_checkpoint():
    from hooks.eval_on_checkpoint import EvalOnCheckpoint

    with pytest.raises(JobError, match="tree_budgt"):
        EvalOnCheckpoint(every_n_steps=10, options={"tree_budgt": 8}, redis_url="redis://127.0.0.1:1/0")


def test_eval_request_replace_checks_again():
    r = EvalRequest.of(wandb={"project": "a"})
    assert r.replace(wandb={"project": "b", "group": "g"}).wandb == {"project": "b", "group": "g"}
    with pytest.raises(JobError):
        r.replace(wandb={"projekt": "b"})
    assert r.wandb == {"project": "a"}  # frozen: the original unchanged


def test_eval_request_is_the_only_maker_of_jobs():
    """Every producer (hook, enqueue, watch, DeepSpec's drop-in) makes its jobs through EvalRequest."""
    callers = set()
    for d in ("eval_worker", "hooks"):
        for path in (REPO / d).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "make_job":
                    callers.add(path.relative_to(REPO).as_posix())
    assert callers == {"eval_worker/service/jobs/request.py"}
