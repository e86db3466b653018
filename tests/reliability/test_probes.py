"""Fault matrix rows from probing the system from outside, short versions.

Each test runs one bench/soak.py scenario against real processes (a private redis-server,
`dflash-eval worker` processes from the warm zygote, the real hook, ledger and engine on the
micro target) and checks its audit: accepted = recorded + failed with a reason, nothing lost,
nothing recorded twice, and the scenario's own checks. The unit-level failing-first tests of the
same faults are next to their code (test_ledger.py, test_outbox_server_errors.py,
test_sidecar_jobfunc.py, test_redis_server.py, test_options_schema.py, test_file_modes.py,
test_sidecar_worker.py).
"""
from __future__ import annotations

import pytest

from tests.reliability.test_faults import _check
from tests.support import soak


def test_ledger_collision_scenario_records_each_evaluation_of_one_step(tmp_path, zygote, target):
    row = _check(soak.scenario_collision(tmp_path, zygote, target))
    assert row.recorded == row.accepted == 4
    assert "already has checkpoint" in row.details["messages"]["second checkpoint"]


@pytest.mark.slow  # ~10-25 s: CI's slow pass (the default suite stays under 10 min on 2 cores)
def test_outbox_server_error_scenario_keeps_jobs_and_workers_through_refused_writes(tmp_path, zygote, target):
    row = _check(soak.scenario_refusing(tmp_path, zygote, target, per_phase=1, hold_s=2.0))
    assert row.recorded == row.accepted == 3
    for kind, phase in row.details["phases"].items():
        assert phase["kept"] == 1 and phase["set_aside"] == 0 and phase["workers_alive"], (kind, phase)


def test_spool_scenario_retries_only_the_ledger_write(tmp_path, zygote, target):
    row = _check(soak.scenario_spool(tmp_path, zygote, target, jobs=2))
    assert row.recorded == row.accepted == 2 and "2 evaluations in all" in row.observed


def test_password_reuse_scenario_enforces_or_refuses(tmp_path, zygote, target):
    row = _check(soak.scenario_password(tmp_path, zygote, target))
    assert row.recorded == 1


def test_suite_confinement_scenario_answers_every_probe_alike(tmp_path, zygote, target):
    row = _check(soak.scenario_suites(tmp_path, zygote, target))
    assert row.recorded == 1 and "is not available on this worker" in row.details["message"]


def test_options_schema_scenario_refuses_bad_and_oversized_fields_briefly(tmp_path, zygote, target):
    row = _check(soak.scenario_bad_fields(tmp_path, zygote, target))
    assert row.recorded == 1


def test_file_modes_scenario_under_a_permissive_umask(tmp_path, zygote, target):
    row = _check(soak.scenario_modes(tmp_path, zygote, target))
    assert row.details["off"] == {} and row.recorded == 2


def test_orphan_scheduler_scenario(tmp_path, zygote, target):
    row = _check(soak.scenario_orphan(tmp_path, zygote, target, jobs=4, kills=2))
    assert row.details["orphans"] == [] and len(row.details["exits_s"]) == 2


def test_bundled_redis_scenario_runs_without_tls(tmp_path, zygote, target):
    row = soak.scenario_bundled_redis(tmp_path, zygote, target, jobs=2)
    if row.details.get("skipped"):
        return
    _check(row)
    assert row.recorded == 2
