"""bench/gpu_check.sh, the script a lent GPU runs unattended, run here with --dry-run (the same parts on the
CPU at tiny shapes) so that it cannot rot between lent machines."""
import json
import os
import subprocess
import sys
from pathlib import Path

from tests.support.waits import scaled

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_dry_run(tmp_path):
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable}
    env.pop("OUT", None)
    proc = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), "--dry-run", "--out", str(out)],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=scaled(300))
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    # the logs, written as it ran (the dry run's parts share one process: dry.log), and the results as JSON lines
    for name in ("device.log", "dry.log", "table.md"):
        assert (out / name).stat().st_size > 0, name
    recs = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    keys = {(r["part"], r["key"]) for r in recs}
    assert {("smoke", "losses.max_diff"), ("smoke", "queue.ratio"), ("trainer", "trainer.sdpa"),
            ("engine", "generate.b1"), ("engine", "generate.b8"), ("engine", "references.ms_per_token"),
            ("engine", "engine.cold"), ("engine", "engine.warm2"), ("engine", "engine.drafting.walk"),
            ("engine", "engine.drafting.all"), ("engine", "engine.drafting.auto")} <= keys
    # the parts ran with only the lent machine's image + bench/gpu_wheels.txt importable, and the wheels'
    # own requirements are met there
    assert "installed top-level packages hidden" in proc.stdout
    assert [r["outside"] for r in recs if r["key"] == "imports"] == [[]]
    # ONE table, last, with every part's status and a row per measurement
    table = proc.stdout[proc.stdout.rindex("| part"):]
    for line in ("| tests ", "| smoke ", "| trainer ", "| engine ", "queue on / off", "HF generate, batch 8",
                 "engine references", "drafting=walk", "drafting=all", "drafting=auto"):
        assert line in table, line
    assert "ok (" in table and "FAILED" not in table and "TIMEOUT" not in table
    assert [r for r in recs if r["key"] == "engine.drafting.walk"][0]["path"] == "walk"
    assert [r for r in recs if r["key"] == "engine.drafting.all"][0]["path"] == "all"
