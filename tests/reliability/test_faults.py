"""Fault matrix, short versions (docs/reliability.md; `python bench/soak.py` runs them at full size).

Every test runs one scenario of tests/support/soak.py against real processes on 127.0.0.1: a private
redis-server with its AOF, `dflash-eval worker` processes (forked from a warm zygote, running the
real CLI entry point, RQ worker and Evaluator on a micro target), the trainer's real checkpoint
publication and the real EvalOnCheckpoint hook. Each scenario audits the outcome:
accepted = recorded + failed-with-a-reason, nothing lost, nothing recorded twice.
"""
from __future__ import annotations

import pytest

from tests.support import soak, soak_stack


def _check(row: soak_stack.Row) -> soak_stack.Row:
    assert row.lost == 0, f"lost {row.lost}: {row.details.get('lost_ids')}\n{row.observed}"
    assert row.duplicated == 0, f"duplicated {row.duplicated}: {row.details.get('duplicated_ids')}"
    assert not row.details.get("problems"), f"failed checks {row.details['problems']}:\n{row.observed}\n{row.details}"
    assert row.accepted == row.recorded + row.failed
    return row


def test_worker_sigkilled_at_random_points_records_every_job_once(tmp_path, zygote, target):
    row = _check(soak.scenario_kill(tmp_path, zygote, target, workers=2, jobs=12, kills=4, seed=1))
    assert row.recorded == row.accepted == 12 and row.failed == 0
    kills = row.details["kills"]
    assert sum(kills.values()) == 4
    assert kills["after the ledger write"] >= 1  # the aimed kills: recorded, then killed before RQ knew
    assert row.details["executions"] >= 12  # killed jobs ran again ...
    assert row.details["queue_state"]["finished"] == 12  # ... and each finished once


@pytest.mark.slow  # ~10-25 s: CI's slow pass (the default suite stays under 10 min on 2 cores)
def test_redis_outage_while_enqueueing_and_working(tmp_path, zygote, target):
    row = _check(soak.scenario_redis(tmp_path, zygote, target, checkpoints=8, down_s=2.0))
    assert row.recorded == row.accepted == 8
    downs = row.details["outages"]
    assert [d["kind"] for d in downs] == ["stop", "crash"]
    assert sum(d["enqueued_while_down"] for d in downs) >= 2  # the hook kept accepting while Redis was gone
    assert all(row.details["workers_alive"])  # never restarted: they reconnected by themselves


@pytest.mark.slow  # ~10-25 s: CI's slow pass (the default suite stays under 10 min on 2 cores)
def test_trainer_killed_during_checkpoint_writes(tmp_path, zygote, target):
    row = _check(soak.scenario_trainer_kill(tmp_path, zygote, target, kills=3, seed=2))
    assert row.details["leaked"] == [] and row.details["left_over"] == []
    outcomes = row.details["kill_outcomes"]
    assert outcomes["mid-write (.tmp dir left)"] >= 1  # at least one kill caught a write in progress
    assert len(row.details["cleaned"]) == row.details["partial_seen"]  # the next run removed each one


def test_broken_checkpoints_fail_only_their_own_job(tmp_path, zygote, target):
    row = _check(soak.scenario_checkpoints(tmp_path, zygote, target))
    assert row.failed == len(soak.CHECKPOINT_FAULTS) and row.recorded == 2
    for name, o in row.details["outcome"].items():
        assert o["status"] == "failed" and o["executions"] == 1 and o["retries_left"] == 0, (name, o)
        assert o["reason_ok"], (name, o["reason"])


def test_corrupted_cache_files_are_rebuilt_not_trusted(tmp_path, zygote, target):
    row = _check(soak.scenario_cache(tmp_path, zygote, target))
    assert row.recorded == 2
    assert row.details["cache"]["references"] in ("rebuilt", "built")
    assert row.details["cache"]["notes"]


def test_results_dir_full_or_read_only(tmp_path, zygote, target):
    why = soak.can_mount()
    if why:
        pytest.skip(why)
    row = _check(soak.scenario_disk(tmp_path, zygote, target, jobs=2))
    assert row.recorded == row.accepted == 4  # after the disk was fixed
    for fault, phase in row.details["phases"].items():
        assert phase["failed"] == 2 and phase["partial_files"] == [] and phase["requeued"] == 2, (fault, phase)


@pytest.mark.slow  # ~30 s (a W&B child per job); the refused-connection case runs by default
def test_wandb_server_that_hangs(tmp_path, zygote, target):
    """The refused-connection case is tests/integration/test_publish_command.py; this is a server that accepts
    and never answers, with the real engine: the publication times out, the job does not."""
    row = _check(soak.scenario_wandb(tmp_path, zygote, target, jobs=1, modes=("hung",)))
    assert row.recorded == 1
    hung = row.details["modes"]["hung"]
    assert hung["sink_errors"] == 1 and hung["worker_alive"]
    assert row.details["published_points"] == [1]
