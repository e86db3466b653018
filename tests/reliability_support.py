"""Fixtures shared by the reliability tests (test_reliability_*.py): bench/soak.py's zygote and micro target.

Both are built once per Python process (see `soak.shared_zygote` / `soak.shared_target`);
import the fixtures into a test module to use them.
"""
from __future__ import annotations

import pytest

from bench import soak


@pytest.fixture(scope="module")
def zygote():
    return soak.shared_zygote()


@pytest.fixture(scope="module")
def target():
    return soak.shared_target()
