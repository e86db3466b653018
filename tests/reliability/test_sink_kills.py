"""kill -9 in the sink phase, small (issue 34 D1; `python bench/soak.py --only sink_kills` runs it at full size).

Real workers with W&B (offline), TensorBoard and MLflow (sqlite) on; one kill of a worker with its sink
child, one of a sink child alone, at random points of publishing; then each sink read back with its own
reader: its `eval/tau` points must be the ledger's records, one each.
"""
from __future__ import annotations

import pytest

from tests.support import soak, soak_sinks


@pytest.mark.slow  # three tracker children per publication (~30-60 s on 2 busy cores): CI's slow pass
def test_sink_catch_up_soak_kills_in_the_sink_phase_every_sink_equals_the_ledger(tmp_path, zygote, target):
    row = soak_sinks.scenario_sink_kills(tmp_path, zygote, target, **soak.QUICK["sink_kills"])
    assert not row.details.get("problems"), f"{row.details['problems']}:\n{row.observed}\n{row.details}"
    # 3 jobs and the control one, plus any the scenario added to keep publications coming until both kills landed
    assert row.lost == 0 and row.duplicated == 0 and row.recorded == row.accepted >= 4
    kinds = [k["kind"] for k in row.details["kills"]]
    assert kinds == ["worker", "sink child"], row.details["kills"]
    for name in soak_sinks.SINKS:
        assert row.details["points"][name]["points"] == row.details["ledger_records"] == row.accepted, \
            row.details["points"]
        assert row.details["points"][name]["duplicate_steps"] == []
