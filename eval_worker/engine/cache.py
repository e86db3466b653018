"""On-disk caches for references (JSON) and target features (safetensors), never used silently.

Every entry lives in a *slot* (what it is for: a target, a suite prompt, layer ids) and
carries its full *key* (what it was computed from: target fingerprint, token ids digest,
dtype, settings). A lookup compares the stored key with the expected one field by field:
equal -> hit; different -> "mismatch" with the fields named (the caller rebuilds and says
so); unreadable -> "corrupt" (rebuilt, never a crash). Writes are atomic (temp + rename).
"""
from __future__ import annotations

import errno
import hashlib
import json
import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from dflash_train.common.fsutil import atomic_write_bytes

KEY_META = "dflash_cache_key"
_DISK_REFUSALS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)  # the disk's state, not the entry's fault

log = logging.getLogger(__name__)


def digest(obj: Any, n: int = 20) -> str:
    """Stable short digest of JSON-able data (token id lists, settings)."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()[:n]


@dataclass
class Lookup:
    value: Any
    status: str  # hit | miss | mismatch | corrupt | extended (a hit the caller completed: a longer reference)
    note: str = ""

    @property
    def outcome(self) -> str:
        """What the caller reports after (re)building: hit | built | extended | rebuilt."""
        return {"hit": "hit", "miss": "built", "extended": "extended"}.get(self.status, "rebuilt")


def describe_mismatch(stored: dict, expected: dict) -> str:
    fields = sorted(k for k in set(stored) | set(expected) if stored.get(k) != expected.get(k))
    parts = []
    for k in fields:
        a, b = stored.get(k), expected.get(k)
        short = lambda v: (str(v)[:24] + "...") if len(str(v)) > 27 else str(v)  # noqa: E731
        parts.append(f"{k} {short(a)} -> {short(b)}")
    return "; ".join(parts)


class DiskCache:
    """Slots under `root/<kind>/<slot>.{json,safetensors}`; `root=None` caches nothing.

    A write the disk refuses (full, over quota, read-only) stops the writing, with one warning
    naming the path: the cache only saves time, the evaluation goes on without it."""

    def __init__(self, root: str | Path | None):
        self.root = Path(root).expanduser() if root is not None else None
        self.unwritable: str | None = None  # why writes stopped (None: they did not)

    def _write(self, path: Path, data: bytes) -> None:
        if self.unwritable is not None:
            return
        try:
            _atomic_write(path, data)
        except OSError as e:
            if e.errno not in _DISK_REFUSALS:
                raise
            self.unwritable = f"{path}: {e.strerror or e}"
            log.warning("the reference/feature cache cannot be written (%s): evaluating without writing to it "
                        "(free space there, or set DFLASH_CACHE_DIR to another disk)", self.unwritable)

    def _path(self, kind: str, slot: str, ext: str) -> Path | None:
        if self.root is None:
            return None
        return self.root / kind / f"{slot}.{ext}"

    def remove(self, kind: str, slot: str) -> None:
        """Forget a slot (an entry this job wrote before it failed)."""
        for ext in ("json", "safetensors"):
            path = self._path(kind, slot, ext)
            if path is not None:
                path.unlink(missing_ok=True)

    # --- JSON ----------------------------------------------------------------
    def get_json(self, kind: str, slot: str, key: dict, ignore: tuple[str, ...] = ()) -> Lookup:
        """`ignore`: stored key fields no longer part of the key (an entry written with them still matches)."""
        path = self._path(kind, slot, "json")
        if path is None or not path.exists():
            return Lookup(None, "miss")
        try:
            data = json.loads(path.read_text())
            stored, value = data["key"], data["value"]
            if not isinstance(stored, dict):
                raise TypeError("key is not an object")
            stored = {k: v for k, v in stored.items() if k not in ignore}
        except (OSError, ValueError, KeyError, TypeError) as e:
            return Lookup(None, "corrupt", f"{path.name} unreadable ({type(e).__name__}: {e})")
        if stored != key:
            return Lookup(None, "mismatch", describe_mismatch(stored, key))
        return Lookup(value, "hit")

    def put_json(self, kind: str, slot: str, key: dict, value: Any) -> None:
        path = self._path(kind, slot, "json")
        if path is not None:
            self._write(path, json.dumps({"key": key, "value": value}).encode())

    # --- tensors -----------------------------------------------------------------
    def get_tensors(self, kind: str, slot: str, key: dict) -> Lookup:
        from safetensors import safe_open

        path = self._path(kind, slot, "safetensors")
        if path is None or not path.exists():
            return Lookup(None, "miss")
        try:
            with safe_open(str(path), framework="pt") as f:
                stored = json.loads((f.metadata() or {})[KEY_META])
                if stored != key:
                    return Lookup(None, "mismatch", describe_mismatch(stored, key))
                value = {name: f.get_tensor(name) for name in f.keys()}
        except Exception as e:  # noqa: BLE001 - safetensors raises several types on truncated/garbage files
            return Lookup(None, "corrupt", f"{path.name} unreadable ({type(e).__name__}: {e})")
        return Lookup(value, "hit")

    def put_tensors(self, kind: str, slot: str, key: dict, tensors: dict[str, torch.Tensor]) -> None:
        from safetensors.torch import save

        path = self._path(kind, slot, "safetensors")
        if path is not None:
            blob = save({k: v.detach().cpu().contiguous() for k, v in tensors.items()},
                        metadata={KEY_META: json.dumps(key, sort_keys=True)})
            self._write(path, blob)


def _atomic_write(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, data)


@dataclass
class MemoryLRU:
    """Features kept in RAM across jobs (the worker evaluates many checkpoints on one suite)."""

    max_bytes: int = 1 << 30
    _items: OrderedDict = field(default_factory=OrderedDict)
    _bytes: int = 0

    @staticmethod
    def _size(value: dict[str, torch.Tensor]) -> int:
        return sum(t.numel() * t.element_size() for t in value.values())

    def get(self, key: str):
        if key in self._items:
            self._items.move_to_end(key)
            return self._items[key]
        return None

    def put(self, key: str, value: dict[str, torch.Tensor]) -> None:
        size = self._size(value)
        if size > self.max_bytes:
            return
        if key in self._items:
            self._bytes -= self._size(self._items.pop(key))
        self._items[key] = value
        self._bytes += size
        while self._bytes > self.max_bytes:
            _, old = self._items.popitem(last=False)
            self._bytes -= self._size(old)


@dataclass
class CacheReport:
    """Per-kind outcome for the result's `cache` block."""

    outcomes: dict[str, list[str]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def record(self, kind: str, lookup: Lookup, what: str) -> None:
        self.outcomes.setdefault(kind, []).append(lookup.outcome)
        if lookup.status in ("mismatch", "corrupt"):
            reason = "key changed" if lookup.status == "mismatch" else "file corrupt"
            self.notes.append(f"{kind} cache for {what}: {reason} ({lookup.note}); rebuilt")

    def summary(self, kind: str) -> str:
        got = self.outcomes.get(kind, [])
        if "rebuilt" in got:
            return "rebuilt"
        if "built" in got:
            return "built"
        if "extended" in got:
            return "extended"
        return "hit" if got else "none"

    def to_dict(self) -> dict[str, Any]:
        return {"references": self.summary("references"), "features": self.summary("features"),
                "notes": list(self.notes)}
