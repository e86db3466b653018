"""JSON read from files that users or other programs wrote (config.json, COMPLETE.json, suite lines).

`loads` is `json.loads` whose every failure is a `json.JSONDecodeError`: Python's parser recurses
once per nesting level, so a 100k-deep `[[[[...` raised a bare RecursionError that escaped every
`except ValueError` and reached the user as a traceback. Callers name the file in their own error.
"""
from __future__ import annotations

import json
from typing import Any


class JSONTooDeep(json.JSONDecodeError):
    """The text nests deeper than the parser can follow (far deeper than any real file)."""


def loads(text: str | bytes | bytearray) -> Any:
    """`json.loads(text)`; nesting too deep to parse raises `JSONTooDeep` (a `json.JSONDecodeError`)."""
    try:
        return json.loads(text)
    except RecursionError:
        doc = text if isinstance(text, str) else ""
        raise JSONTooDeep("nested too deeply to parse (no real file nests this deep)", doc, 0) from None
