"""What the sink modules share besides the contract (`base.py`): the eval run's name and their state files."""
from __future__ import annotations

import json
import logging
import re
from pathlib import Path

log = logging.getLogger(__name__)

_SAFE = re.compile(r"[^A-Za-z0-9_.-]+")


def eval_run_id(run_id: str) -> str:
    """The eval run of a training run, as every tracker names it (`<run_id>-eval`, safe characters only)."""
    return safe_name(run_id)[:120] + "-eval"


def safe_name(text: str) -> str:
    return _SAFE.sub("_", text)


def read_json(path: Path) -> dict | None:
    """A sink's state file (pointer, record list), None when it is missing or unreadable: the next
    publication then rebuilds from the ledger, which is always safe."""
    try:
        return json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, json.JSONDecodeError) as e:
        log.warning("ignoring unreadable %s: %s", path, e)
        return None
