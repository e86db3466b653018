"""The RQ job function itself, in this process (no queue): order of checks, ledger, sinks, caching."""
from __future__ import annotations

import pytest

from dflash_train.common.settings import Settings
from eval_worker.engine.options import shorten
from eval_worker.results.ledger import Ledger, read_record
from eval_worker.service.jobs.builder import make_job
from eval_worker.service.jobs.schema import JobError
from eval_worker.service.worker import evaluators
from eval_worker.service.worker.eval_job import run_eval_job
from eval_worker.service.worker.evaluators import WorkerSettings
from tests.integration.test_sidecar_worker import _target
from tests.support.sidecar_support import publish_random, tiny_target_drafter_config, write_suite


@pytest.fixture
def env(tmp_path, worker_evaluators):
    target = _target()
    cfg, mask = tiny_target_drafter_config(target)
    root = tmp_path / "ckpts"
    ckpts = [publish_random(root, "run-f", s, target_config=cfg, mask_token_id=mask, seed=s) for s in (1, 2)]
    suite = write_suite(root / "suite.jsonl", n_prompts=1, max_new_tokens=8)  # in a root: the worker may read it
    settings = WorkerSettings(results_dir=tmp_path / "results", roots=[root], cache_dir=tmp_path / "cache",
                              default_target=str(target))
    worker_evaluators(settings)
    jobs = [make_job(c, suite=str(suite)).to_json() for c in ckpts]  # RQ payloads; no target: the worker's default
    return settings, jobs


def test_evaluates_records_and_keeps_the_target(env, monkeypatch):
    settings, (j1, j2) = env
    told = []
    from eval_worker.results import sinks

    monkeypatch.setattr(sinks, "publish_result", lambda record, job,
                        settings: told.append(record["path"]) or {"x": {"ok": True}})
    r1, r2 = run_eval_job(j1), run_eval_job(j2)
    assert r1["recorded_now"] and r2["recorded_now"] and r1["sink_error"] is None
    assert evaluators.current().target_loads() == 1 and r2["target_loads"] == 1
    entries = Ledger(settings.results_dir).entries("run-f")
    assert [e.step for e in entries] == [1, 2]
    assert told == [r1["ledger_path"], r2["ledger_path"]]  # sinks hear of it after the ledger has it
    again = run_eval_job(j1)  # same attempt again: nothing new is recorded; the sinks catch up (idempotent)
    assert again["recorded_now"] is False and told[2:] == [r1["ledger_path"]]
    assert len(Ledger(settings.results_dir).entries("run-f", all_attempts=True)) == 2


def test_sink_catch_up_after_a_kill_between_ledger_and_sinks(wandb_offline, env, monkeypatch):
    """Issue 34 D1: an execution killed after its ledger write, before W&B heard of it; the retry finds the
    record ("already recorded; not evaluating again") and must still bring W&B up to date, not end
    `finished` with `sink_error: null` and nothing published."""
    import json

    from eval_worker.service.worker import eval_job
    from tests.support.wandb_reader import read_run

    settings, (j1, _) = env
    monkeypatch.setenv("DFLASH_SINKS", "wandb")
    settings.env = Settings.from_env()  # W&B offline into the test's directory (the same object the job reads)

    class Killed(BaseException):  # kill -9 at the sink phase: nothing after it runs
        pass

    def killed(record, job):
        raise Killed

    with monkeypatch.context() as m:
        m.setattr(eval_job, "_publish_to_sinks", killed)
        with pytest.raises(Killed):
            run_eval_job(j1)
    assert len(Ledger(settings.results_dir).entries("run-f")) == 1
    assert not (wandb_offline / "run-f-eval.json").exists()  # W&B never heard of it

    retry = run_eval_job(j1)
    assert retry["recorded_now"] is False and retry["sink_error"] is None, retry
    pointer = json.loads((wandb_offline / "run-f-eval.json").read_text())
    assert sorted(read_run(pointer["wandb_file"]).points("eval/tau")) == [1]
    again = run_eval_job(j1)  # up to date: the replay is a no-op, and says so
    assert again["sink_error"] is None
    assert json.loads((wandb_offline / "run-f-eval.json").read_text())["wandb_file"] == pointer["wandb_file"]


def test_sink_catch_up_names_a_sink_that_lacks_the_record(env, monkeypatch):
    """A sink that reports success without the job's record is a visible sink error, never `null`."""
    from eval_worker.results import sinks

    settings, (j1, _) = env
    monkeypatch.setattr(sinks, "publish_result", lambda record, job, settings: {"tensorboard": {
        "ok": True, "records": ["7:0000000000000000:0"]}})
    r = run_eval_job(j1)
    assert r["recorded_now"] and "tensorboard: published without this record" in r["sink_error"]


def test_a_job_hashes_its_checkpoint_files_once(env, monkeypatch):
    """The worker verifies the digests (inside its roots) and hands the verified manifest to the
    engine, which does not hash the weights again (they were once hashed twice per job)."""
    from dflash_train.checkpoints import publication

    _, (j1, _) = env
    hashed = []
    real = publication.sha256_file
    monkeypatch.setattr(publication, "sha256_file", lambda path, *a: hashed.append(str(path)) or real(path, *a))
    run_eval_job(j1)
    listed = publication.read_manifest(j1["checkpoint"])["files"]
    assert sorted(hashed) == sorted(f"{j1['checkpoint']}/{name}" for name in listed)


def test_a_failing_sink_does_not_fail_the_job(env, monkeypatch):
    settings, (j1, _) = env
    from eval_worker.results import sinks

    def boom(record, job, settings):
        raise RuntimeError("wandb is down")

    monkeypatch.setattr(sinks, "publish_result", boom)
    r = run_eval_job(j1)
    assert r["recorded_now"] and "wandb is down" in r["sink_error"]
    assert Ledger(settings.results_dir).entries("run-f")[0].read()["job_id"] == r["job_id"]


def test_refuses_before_loading_anything(env, monkeypatch, tmp_path):
    settings, (j1, _) = env
    evaluators.current().configure(WorkerSettings(results_dir=tmp_path / "r", roots=None))
    with pytest.raises(JobError, match="no checkpoint roots configured"):
        run_eval_job(j1)
    evaluators.current().configure(WorkerSettings(results_dir=tmp_path / "r", roots=[tmp_path / "x"],
                                                  default_target=settings.default_target))
    with pytest.raises(JobError, match="outside the checkpoint roots"):
        run_eval_job(j1)
    with pytest.raises(JobError, match="unknown job schema version"):
        run_eval_job({**j1, "schema": "dflash-eval-job/9"})
    assert evaluators.current().target_loads() == 0 and not (tmp_path / "r").exists()


def test_a_drafter_for_another_target_fails_with_the_reason(env, tmp_path):
    settings, _ = env
    wrong = publish_random(settings.roots[0], "run-f", 9, seed=9)  # shaped for a 32-wide random target
    with pytest.raises(ValueError, match="do not fit"):
        run_eval_job(make_job(wrong, suite=str(settings.roots[0] / "suite.jsonl")).to_json())
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
    assert evaluators.current().target_loads() == 0  # refused before anything was loaded
    assert Ledger(settings.results_dir).entries("run-f") == []

    # the worker's own target by its own path is always fine; a target root admits the copy
    assert run_eval_job({**j1, "target": settings.default_target})["recorded_now"]
    evaluators.current().configure(WorkerSettings(**{**settings.__dict__, "target_roots": [tmp_path / "elsewhere"]}))
    r = run_eval_job({**j1, "target": str(elsewhere), "attempt": 1})
    assert r["tau"] is not None and evaluators.current().target_loads(str(elsewhere)) == 1


# ---- results never mis-attributed, a failed write never re-evaluates ------------------------

def _count_evaluations(monkeypatch) -> list[str]:
    """Wrap the worker's Evaluator so the test sees every evaluation it runs."""
    calls: list[str] = []
    loaded = evaluators.current()
    real = loaded.get

    def counted(target):
        ev = real(target)

        class Counting:
            def evaluate(self, checkpoint, suite, **kw):
                calls.append(str(checkpoint))
                return ev.evaluate(checkpoint, suite, **kw)
        return Counting()
    monkeypatch.setattr(loaded, "get", counted)
    return calls


def test_ledger_collision_other_options_on_one_checkpoint_are_both_recorded(env):
    """Observed: the max_new_tokens=8 job reported the max_new_tokens=4 job's τ and record."""
    settings, (j1, _) = env
    r4 = run_eval_job({**j1, "options": {"max_new_tokens": 4}})
    r8 = run_eval_job({**j1, "options": {"max_new_tokens": 8}})
    assert r4["recorded_now"] and r8["recorded_now"] and r4["ledger_path"] != r8["ledger_path"]
    rec4, rec8 = (read_record(r["ledger_path"]) for r in (r4, r8))
    assert rec8["job"]["options"] == {"max_new_tokens": 8} and rec8["result"]["settings"]["max_new_tokens"] == 8
    assert rec4["result"]["settings"]["max_new_tokens"] == 4
    assert r8["tau"] == rec8["result"]["tau"]["macro"] and rec8["job_id"] == r8["job_id"] != r4["job_id"]
    assert len(Ledger(settings.results_dir).entries("run-f")) == 2


def test_ledger_collision_second_checkpoint_at_one_step_is_recorded_next_to_the_first(env, monkeypatch, tmp_path):
    """Observed: a second checkpoint at the same (run, step) was evaluated, then dropped silently."""
    settings, (j1, _) = env
    other_root = tmp_path / "other-ckpts"
    cfg, mask = tiny_target_drafter_config(settings.default_target)
    other = publish_random(other_root, "run-f", 1, target_config=cfg, mask_token_id=mask, seed=77)
    evaluators.current().configure(WorkerSettings(**{**settings.__dict__, "roots": settings.roots + [other_root]}))
    j_other = make_job(other, suite=j1["suite"]).to_json()
    assert j_other["step"] == j1["step"] and j_other["checkpoint_digest"] != j1["checkpoint_digest"]
    ra, rb = run_eval_job(j1), run_eval_job(j_other)
    assert ra["recorded_now"] and rb["recorded_now"] and ra["ledger_path"] != rb["ledger_path"]
    digests = sorted(e.read()["checkpoint_digest"] for e in Ledger(settings.results_dir).entries("run-f"))
    assert digests == sorted([j1["checkpoint_digest"], j_other["checkpoint_digest"]])


def test_failed_ledger_write_keeps_the_result_and_the_retry_only_writes_it(env, monkeypatch):
    """Observed: with an unwritable results directory every retry ran the whole evaluation again."""
    from eval_worker.service.worker.eval_job import LedgerWriteFailed

    settings, (j1, _) = env
    calls = _count_evaluations(monkeypatch)
    settings.results_dir.mkdir(parents=True)
    (settings.results_dir / "run-f").write_text("in the way")  # the run's ledger directory cannot be made
    with pytest.raises(LedgerWriteFailed, match="computed result is kept in .*a retry only writes it") as err:
        run_eval_job(j1)
    assert not isinstance(err.value, ValueError)  # retryable: RQ's back-off tries the write again
    spooled = list(settings.spool_dir.glob("*.json"))
    assert len(spooled) == 1 and oct(spooled[0].stat().st_mode & 0o777) == "0o600"
    with pytest.raises(LedgerWriteFailed):
        run_eval_job(j1)  # still broken: still no second evaluation
    assert len(calls) == 1
    (settings.results_dir / "run-f").unlink()  # the user fixes the disk
    r = run_eval_job(j1)
    assert r["recorded_now"] and r["from_spool"] and len(calls) == 1  # written, not evaluated again
    assert read_record(r["ledger_path"])["result"]["tau"]["macro"] == r["tau"]
    assert not list(settings.spool_dir.glob("*.json"))  # the spool is emptied once the record is written


def test_suite_confinement_in_the_worker(env, tmp_path):
    """Observed: a job's suite `/etc/passwd` answered "not valid JSON", a missing path "not found"."""
    settings, (j1, _) = env
    outside = tmp_path / "outside.jsonl"
    outside.write_text(settings.roots[0].joinpath("suite.jsonl").read_text())  # a valid suite, but outside
    (settings.roots[0] / "escape.jsonl").symlink_to(outside)
    messages = set()
    for suite in ("/etc/passwd", "/nonexistent/x.jsonl", str(outside), str(settings.roots[0] / "escape.jsonl"),
                  str(settings.roots[0]), str(settings.roots[0] / "missing.jsonl"), "../../etc/passwd"):
        with pytest.raises(JobError) as err:
            run_eval_job({**j1, "suite": suite})
        msg = str(err.value).replace(shorten(suite), "<suite>")
        assert "not valid JSON" not in msg and "not found" not in msg and "No such file" not in msg
        messages.add(msg)
    assert len(messages) == 1, messages  # one message whatever the path: nothing learned about the files
    assert evaluators.current().target_loads() == 0
    assert run_eval_job(j1)["recorded_now"]  # a suite file inside the roots is fine
