"""Fault matrix rows for checkpoints in an object store, short versions (tests/support/soak_store.py;
`python bench/soak.py --only store_tamper,...` runs them at full size): real workers pulling from
a moto S3 server through the loopback fault proxy, on the micro target.

Select with `pytest -k "cache_tamper or sticky_cache or cache_enospc or missing_object or transport_error"`.
"""
from __future__ import annotations

import pytest

from tests.reliability.test_faults import _check
from tests.support import soak_store

pytestmark = pytest.mark.usefixtures("s3_libraries")


@pytest.fixture(scope="module")
def s3_libraries():
    pytest.importorskip("s3fs", reason="s3fs is in the dev extra (pip install -e '.[dev]')")
    pytest.importorskip("moto.server", reason="moto[server] is in the dev extra (pip install -e '.[dev]')")


def test_cache_tamper_scenario_records_no_wrong_weights(tmp_path, zygote, target):
    row = _check(soak_store.scenario_store_tamper(tmp_path, zygote, target, rounds=2))
    assert row.recorded == row.accepted == 4 and row.details["misattributed"] == 0


def test_sticky_cache_scenario_refetches_a_truncated_entry(tmp_path, zygote, target):
    row = _check(soak_store.scenario_store_sticky(tmp_path, zygote, target, rounds=1))
    assert row.recorded == row.accepted == 2 and row.failed == 0


def test_cache_enospc_scenario_evicts_idle_entries(tmp_path, zygote, target):
    row = soak_store.scenario_store_disk(tmp_path, zygote, target, jobs=5)
    if row.details.get("skipped"):
        pytest.skip(row.details["skipped"])
    row = _check(row)
    assert row.recorded == row.accepted == 5 and row.details["evicted"] >= 2


def test_missing_object_scenario_fails_once_naming_the_file(tmp_path, zygote, target):
    row = _check(soak_store.scenario_store_missing(tmp_path, zygote, target))
    assert (row.accepted, row.recorded, row.failed) == (3, 1, 2)


def test_transport_error_scenario_retries_fails_visibly_and_recovers(tmp_path, zygote, target):
    row = _check(soak_store.scenario_store_transport(tmp_path, zygote, target, flaky=1))
    assert row.recorded == row.accepted == 3
