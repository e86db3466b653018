"""Fixtures shared by the reliability tests (tests/reliability/): tests/support/soak_stack.py's zygote and micro
target.

Both are built once per Python process (see `soak_stack.shared_zygote` / `soak_stack.shared_target`);
tests/conftest.py registers this module as a pytest plugin, so any test can ask for them.
"""
from __future__ import annotations

import pytest

from tests.support import soak_stack


@pytest.fixture(scope="module")
def zygote():
    return soak_stack.shared_zygote()


@pytest.fixture(scope="module")
def target():
    return soak_stack.shared_target()
