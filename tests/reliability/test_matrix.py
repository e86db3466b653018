"""The fault-matrix table in docs/reliability.md: written by `python bench/soak.py`, never hand-edited.

The default suite checks the published table (every row ok, no job lost or duplicated, the
counts add up) and the table writer; the slow test reruns the whole soak at full size.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.support import soak, soak_stack

DOC = Path(__file__).resolve().parents[2] / "docs" / "reliability.md"


def _rows(text: str) -> list[list[str]]:
    body = text.split(soak.BEGIN, 1)[1].split(soak.END, 1)[0]
    rows = []
    for line in body.splitlines():
        if not line.startswith("| ") or line.startswith(("| fault ", "|---", "| **total**")):
            continue
        cells = [c.strip() for c in re.split(r"(?<!\\)\|", line)[1:-1]]
        rows.append(cells)
    return rows


def test_published_matrix_has_every_fault_and_no_lost_or_duplicated_job():
    rows = _rows(DOC.read_text())
    assert len(rows) == len(soak.SCENARIOS), [r[0] for r in rows]
    for fault, _expected, _observed, accepted, recorded, failed, lost, duplicated, ok in rows:
        assert ok in ("yes", "skipped"), fault
        assert int(lost) == 0 and int(duplicated) == 0, fault
        assert int(accepted) == int(recorded) + int(failed), fault
    assert sum(int(r[3]) for r in rows) >= 500  # the full-size run, not the quick one


def test_table_writer_replaces_only_its_block(tmp_path):
    row = soak_stack.Row("a | b", "x", "y", 3, 2, 1, 0, 0, 1.0, {})
    bad = soak_stack.Row("c", "x", "y", 2, 1, 0, 1, 0, 1.0, {"problems": ["all_recorded"]})
    table = soak.render([row, bad], "header")
    assert "a \\| b" in table and "**NO**" in table and "failed checks ['all_recorded']" in table
    doc = tmp_path / "r.md"
    doc.write_text(f"# T\n\nbefore\n\n{soak.BEGIN}\nold\n{soak.END}\n\nafter\n")
    soak.write_table(doc, table)
    soak.write_table(doc, table)
    text = doc.read_text()
    assert text.count(soak.BEGIN) == 1 and "old" not in text and "before" in text and "after" in text
    assert [r[0] for r in _rows(text)] == ["a \\| b", "c"]
    fresh = tmp_path / "new.md"
    soak.write_table(fresh, table)
    assert _rows(fresh.read_text())[0][3:8] == ["3", "2", "1", "0", "0"]


def test_subset_run_replaces_its_own_rows_and_keeps_the_others(tmp_path):
    """`bench/soak.py --only X` puts X's row in place (or adds it) and sums the total again over every row."""
    a = soak_stack.Row("a", "x", "y", 3, 3, 0, 0, 0, 1.0, {})
    b_bad = soak_stack.Row("b | c", "x", "y", 5, 4, 1, 0, 0, 1.0, {"problems": ["one"]})
    doc = tmp_path / "r.md"
    soak.write_table(doc, soak.render([a, b_bad], "full run."))
    b_new = soak_stack.Row("b | c", "x", "z", 7, 7, 0, 0, 0, 1.0, {})
    d_new = soak_stack.Row("d", "x", "y", 2, 1, 1, 0, 0, 1.0, {})
    soak.write_table(doc, soak.merge_rows(doc, soak.render([b_new, d_new], "subset."), "B and d rerun."))
    text = doc.read_text()
    rows = _rows(text)
    assert [r[0] for r in rows] == ["a", "b \\| c", "d"]
    assert rows[1][2] == "z" and rows[1][8] == "yes"
    assert "| **total** | | | 12 | 11 | 1 | 0 | 0 | |" in text
    assert "full run. B and d rerun." in text and "failed checks" not in text  # the rerun row's old note went


@pytest.mark.slow
def test_full_soak_passes(tmp_path):
    """`python bench/soak.py` at full size (about 10 minutes on 2 cores)."""
    out = tmp_path / "reliability.md"
    assert soak.main(["--out", str(out), "--json", str(tmp_path / "soak.json")]) == 0
    assert len(_rows(out.read_text())) == len(soak.SCENARIOS)
