"""Reliability soak: run the fault-matrix scenarios at full size and write the table into docs/reliability.md.

    python bench/soak.py                      # every scenario at full size, writes the table
    python bench/soak.py --quick              # the sizes the default test suite uses
    python bench/soak.py --only burst,kill    # some scenarios
    python bench/soak.py --out docs/reliability.md --json soak.json

The scenarios are tests/support/soak.py (the default test suite runs them at small sizes), on the
stack in tests/support/soak_stack.py.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support.soak import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
