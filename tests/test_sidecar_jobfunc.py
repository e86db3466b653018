"""The RQ job function itself, in this process (no queue): order of checks, ledger, sinks, caching."""
from __future__ import annotations

import pytest

from eval_worker import worker as worker_mod
from eval_worker.jobs import JobError, make_job
from eval_worker.ledger import Ledger
from eval_worker.worker import WorkerSettings, run_eval_job
from tests.sidecar_support import publish_random, tiny_target_drafter_config, write_suite
from tests.test_sidecar_worker import _target


@pytest.fixture
def env(tmp_path, monkeypatch):
    target = _target()
    cfg, mask = tiny_target_drafter_config(target)
    root = tmp_path / "ckpts"
    ckpts = [publish_random(root, "run-f", s, target_config=cfg, mask_token_id=mask, seed=s) for s in (1, 2)]
    suite = write_suite(tmp_path / "suite.jsonl", n_prompts=1, max_new_tokens=8)
    settings = WorkerSettings(results_dir=tmp_path / "results", roots=[root], cache_dir=tmp_path / "cache",
                              default_target=str(target))
    monkeypatch.setattr(worker_mod, "_settings", settings)
    monkeypatch.setattr(worker_mod, "_evaluators", type(worker_mod._evaluators)())
    monkeypatch.setattr(worker_mod, "_loads", {})
    jobs = [make_job(c, suite=str(suite)) for c in ckpts]  # no target: the worker's default
    return settings, jobs


def test_evaluates_records_and_keeps_the_target(env, monkeypatch):
    settings, (j1, j2) = env
    told = []
    from eval_worker import sinks

    monkeypatch.setattr(sinks, "publish_result", lambda record, job: told.append(record["path"]) or {"x": {"ok": True}})
    r1, r2 = run_eval_job(j1), run_eval_job(j2)
    assert r1["recorded_now"] and r2["recorded_now"] and r1["sink_error"] is None
    assert worker_mod.target_loads() == 1 and r2["target_loads"] == 1
    entries = Ledger(settings.results_dir).entries("run-f")
    assert [e.step for e in entries] == [1, 2]
    assert told == [r1["ledger_path"], r2["ledger_path"]]  # sinks hear of it after the ledger has it
    again = run_eval_job(j1)  # same attempt again: nothing new is recorded, sinks are not told twice
    assert again["recorded_now"] is False and len(told) == 2


def test_a_failing_sink_does_not_fail_the_job(env, monkeypatch):
    settings, (j1, _) = env
    from eval_worker import sinks

    def boom(record, job):
        raise RuntimeError("wandb is down")

    monkeypatch.setattr(sinks, "publish_result", boom)
    r = run_eval_job(j1)
    assert r["recorded_now"] and "wandb is down" in r["sink_error"]
    assert Ledger(settings.results_dir).entries("run-f")[0].read()["job_id"] == r["job_id"]


def test_refuses_before_loading_anything(env, monkeypatch, tmp_path):
    settings, (j1, _) = env
    monkeypatch.setattr(worker_mod, "_settings", WorkerSettings(results_dir=tmp_path / "r", roots=None))
    with pytest.raises(JobError, match="no checkpoint roots configured"):
        run_eval_job(j1)
    monkeypatch.setattr(worker_mod, "_settings", WorkerSettings(results_dir=tmp_path / "r", roots=[tmp_path / "x"],
                                                                default_target=settings.default_target))
    with pytest.raises(JobError, match="outside the checkpoint roots"):
        run_eval_job(j1)
    with pytest.raises(JobError, match="unknown job schema version"):
        run_eval_job({**j1, "schema": "dflash-eval-job/9"})
    assert worker_mod.target_loads() == 0 and not (tmp_path / "r").exists()


def test_a_drafter_for_another_target_fails_with_the_reason(env, tmp_path):
    settings, _ = env
    wrong = publish_random(settings.roots[0], "run-f", 9, seed=9)  # shaped for a 32-wide random target
    with pytest.raises(ValueError, match="do not fit"):
        run_eval_job(make_job(wrong, suite=str(tmp_path / "suite.jsonl")))
    assert Ledger(settings.results_dir).entries("run-f") == []


def test_a_job_may_only_name_targets_inside_the_target_roots(env, monkeypatch, tmp_path):
    settings, (j1, _) = env
    import shutil

    elsewhere = tmp_path / "elsewhere" / "target"  # a real, loadable target, but outside every root
    shutil.copytree(settings.default_target, elsewhere)
    with pytest.raises(JobError, match="outside the checkpoint roots.*--target-root"):
        run_eval_job({**j1, "target": str(elsewhere)})
    link = settings.roots[0] / "escape"  # a symlink inside a root that leads out of it
    link.symlink_to(elsewhere)
    with pytest.raises(JobError, match="a symlink may not lead out"):
        run_eval_job({**j1, "target": str(link)})
    assert worker_mod.target_loads() == 0  # refused before anything was loaded
    assert Ledger(settings.results_dir).entries("run-f") == []

    # the worker's own target by its own path is always fine; a target root admits the copy
    assert run_eval_job({**j1, "target": settings.default_target})["recorded_now"]
    monkeypatch.setattr(worker_mod, "_settings",
                        WorkerSettings(**{**settings.__dict__, "target_roots": [tmp_path / "elsewhere"]}))
    r = run_eval_job({**j1, "target": str(elsewhere), "attempt": 1})
    assert r["tau"] is not None and worker_mod.target_loads(str(elsewhere)) == 1
