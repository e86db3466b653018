"""Load: a burst of queued jobs on several workers, and the memory of a long-running worker.

Short versions here; the full sizes (500 jobs on 3 workers, 200+ jobs on one worker) are the
`slow` tests below and `python bench/soak.py`.
"""
from __future__ import annotations

import pytest

from tests.support import soak, soak_stack


def _check(row: soak_stack.Row) -> soak_stack.Row:
    assert row.lost == 0 and row.duplicated == 0, row.observed
    assert not row.details.get("problems"), (row.details["problems"], row.observed, row.details)
    return row


def test_burst_of_queued_jobs_each_runs_exactly_once(tmp_path, zygote, target):
    row = _check(soak.scenario_burst(tmp_path, zygote, target, jobs=40, workers=2))
    assert row.recorded == row.accepted == 40
    assert row.details["queue_state"] == {"queued": 0, "started": 0, "scheduled": 0, "finished": 40, "failed": 0}
    assert len(row.details["per_worker"]) == 2 and min(row.details["per_worker"].values()) > 0  # both served


@pytest.mark.slow  # ~10-25 s: CI's slow pass (the default suite stays under 10 min on 2 cores)
def test_long_running_worker_memory_is_flat_over_100_jobs(tmp_path, zygote, target):
    row = _check(soak.scenario_memory(tmp_path, zygote, target, jobs=100, warmup=15))
    assert row.recorded == 100 and row.details["target_loads"] == 1
    assert row.details["slope_kb_per_job"] < 100  # one leaked drafter per job would be ~700 kB/job


def test_the_memory_check_catches_a_leak(tmp_path, zygote, target):
    """The same check on a worker that leaks 2 MB per job (injected by the test evaluator) fails."""
    row = soak.scenario_memory(tmp_path, zygote, target, jobs=30, warmup=5, leak_kb=2048)
    assert row.details["problems"] == ["flat"] and row.details["slope_kb_per_job"] > 1000, row.observed


@pytest.mark.slow
def test_burst_of_500_jobs_on_3_workers(tmp_path, zygote, target):
    row = _check(soak.scenario_burst(tmp_path, zygote, target, jobs=500, workers=3))
    assert row.recorded == 500


@pytest.mark.slow
def test_long_running_worker_memory_is_flat_over_300_jobs(tmp_path, zygote, target):
    row = _check(soak.scenario_memory(tmp_path, zygote, target, jobs=300, warmup=20, max_slope_kb=50))
    assert row.recorded == 300
