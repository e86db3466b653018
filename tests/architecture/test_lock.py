"""requirements.lock: every package the installs bring is pinned there, compiled from setup.cfg's ranges.

`make lock` writes the lock; every install (make demo/test, .ci/run, the Docker images) uses it as a
constraints file. These tests fail when setup.cfg changes without `make lock`, when an install brought a
package the lock does not pin, and when a package whose private API we read loses its upper bound.
"""

from __future__ import annotations

import configparser
import importlib.metadata
import os
import re
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

REPO_ROOT = Path(__file__).resolve().parents[2]
LOCK = REPO_ROOT / "requirements.lock"
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s#;]+)")
# pinned elsewhere: torch by constraints.txt (its CPU build here, PyPI's CUDA build in the CUDA images);
# the installer itself and the project
NOT_IN_LOCK = {"torch", "pip", "dflash-eval"}
# packages whose private API the project reads: an upper bound, and the test that must pass to raise it
BOUNDED = {"transformers": "tests/unit/core/test_cache_compat.py", "rq": "tests/architecture/test_rq_internals.py"}


def _lock() -> dict[str, str]:
    pins = {}
    for line in LOCK.read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = PIN.match(line)
        assert m, f"requirements.lock: not a pin: {line!r}"
        pins[canonicalize_name(m.group(1))] = m.group(2)
    return pins


def _setup_cfg_requirements() -> list[Requirement]:
    cfg = configparser.ConfigParser()
    cfg.read(REPO_ROOT / "setup.cfg")
    lines = cfg["options"]["install_requires"].splitlines()
    for extra in cfg["options.extras_require"].values():
        lines += extra.splitlines()
    return [Requirement(line.strip()) for line in lines if line.strip() and not line.strip().startswith("#")]


def test_lock_pins_every_requirement_of_setup_cfg_within_its_range():
    pins = _lock()
    for req in _setup_cfg_requirements():
        name = canonicalize_name(req.name)
        if name in NOT_IN_LOCK:
            continue
        assert name in pins, f"{req.name} is in setup.cfg but not in requirements.lock: run `make lock`"
        assert req.specifier.contains(Version(pins[name]), prereleases=True), (
            f"requirements.lock pins {req.name}=={pins[name]}, outside setup.cfg's {req}: run `make lock`")


@pytest.mark.skipif(os.environ.get("DFLASH_UNLOCKED") == "1", reason="a throwaway venv of the newest releases")
def test_every_installed_distribution_is_the_locked_version():
    """The environment the tests run in is the lock's: a package an install brought unpinned, or at
    another version, fails here (compare `pip freeze` with the lock)."""
    pins = _lock()
    off = []
    for dist in importlib.metadata.distributions():
        name = canonicalize_name(dist.metadata["Name"])
        if name in NOT_IN_LOCK:
            continue
        if pins.get(name) != dist.version:
            off.append(f"{name}=={dist.version} (lock: {pins.get(name, 'absent')})")
    assert not off, "installed but not as locked: " + ", ".join(sorted(off))


def test_packages_whose_internals_we_read_are_bounded_and_say_which_test_guards_the_bound():
    text = (REPO_ROOT / "setup.cfg").read_text()
    reqs = {canonicalize_name(r.name): r for r in _setup_cfg_requirements()}
    for name, guard in BOUNDED.items():
        assert any(s.operator == "<" for s in reqs[name].specifier), f"{name} needs an upper bound"
        line = re.search(rf"^\s*{name}\s*[<>=]", text, re.M)
        assert line, name
        comment = text[: line.start()].splitlines()[-3:]  # the comment lines just above the requirement
        assert any(Path(guard).name in c for c in comment), (name, comment)
    assert (REPO_ROOT / BOUNDED["rq"]).is_file() and (REPO_ROOT / BOUNDED["transformers"]).is_file()


def test_torch_is_pinned_by_constraints_not_by_the_lock():
    assert "torch" not in _lock()
    assert "torch==2.13.0" in (REPO_ROOT / "constraints.txt").read_text().split()
