"""bench/README.md is the map of the benchmarks: every script has a section, every section names a script."""
from __future__ import annotations

import re
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
# run by gpu_check.sh, and described in its section
PARTS_OF = {"gpu_check.py": "gpu_check.sh", "gpu_wheels.sh": "gpu_check.sh"}


def test_every_bench_script_has_a_section_and_every_section_a_script():
    text = (BENCH / "README.md").read_text()
    sections = re.findall(r"^## `([^`]+)`", text, flags=re.M)
    scripts = sorted(p.name for p in BENCH.iterdir() if p.suffix in (".py", ".sh") and p.name != "__init__.py")
    assert len(sections) == len(set(sections)), sections
    missing = [s for s in scripts if s not in sections and PARTS_OF.get(s) not in sections]
    assert not missing, f"bench scripts without a section in bench/README.md: {missing}"
    stale = [s for s in sections if not (BENCH / s).exists()]
    assert not stale, f"bench/README.md sections naming no script: {stale}"
    for part, home in PARTS_OF.items():
        body = text.split(f"## `{home}`", 1)[1].split("\n## ", 1)[0]
        assert part in body, f"{part} is described in {home}'s section"
