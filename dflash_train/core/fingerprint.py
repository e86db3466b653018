"""Target identity: a digest of every weight byte and every file that shapes the outputs.

Caches of references and features (worker) and regenerated responses (trainer) are keyed
by the target's fingerprint, so it must change whenever any output could: one changed
element of any weight, the config, the tokenizer, the chat template, the generation
config. A sample of the weights is not enough (one edited LM-head row that holds no
sampled element goes unnoticed and stale caches are reused silently).

- A target loaded from a directory: each top-level file is streamed through xxh3-128
  (a fast non-cryptographic hash: it guards against accidents, not adversaries; whoever
  can write the target directory owns the worker anyway). Per-file digests are kept on
  disk, keyed by (path, size, mtime, ctime, inode, device), so a worker pays the read
  once per file version (see docs/sidecar.md for the measured rate).
- A model that only lives in memory: the same hash over every tensor of its state dict,
  plus its config.
"""
from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Iterable
from pathlib import Path

import torch
import xxhash

from dflash_train.common.errors import DFlashError
from dflash_train.common.fsutil import atomic_write_json
from dflash_train.common.settings import Settings

ALGO = "xxh3_128"
CHUNK = 8 << 20
# A digest is stored only for files unchanged this long before hashing began: a rewrite
# inside one timestamp tick (coarse on some filesystems) must not keep an old digest.
RACY_S = 2.0
# Not part of what a model computes (documentation, VCS metadata).
_IGNORED_PREFIXES = ("readme", "license", "notice")
_IGNORED_SUFFIXES = (".md",)


class FingerprintError(DFlashError, RuntimeError):
    """A target whose identity cannot be established (files changing, tensors without data)."""

    retryable = True  # a file that was being written when the worker read it


def identity_files(directory: str | Path) -> list[Path]:
    """The files of a model directory that its identity covers: every regular top-level
    file (weights, config, tokenizer, chat template, generation config, remote code),
    except hidden files and documentation."""
    out = []
    for p in sorted(Path(directory).iterdir()):
        name = p.name.lower()
        if name.startswith(".") or name.startswith(_IGNORED_PREFIXES) or name.endswith(_IGNORED_SUFFIXES):
            continue
        if p.is_file():
            out.append(p)
    return out


def _stat_key(path: Path) -> dict:
    st = path.stat()
    return {"path": str(path.resolve()), "size": st.st_size, "mtime_ns": st.st_mtime_ns,
            "ctime_ns": st.st_ctime_ns, "ino": st.st_ino, "dev": st.st_dev, "algo": ALGO}


def _stream_digest(path: Path) -> str:
    h = xxhash.xxh3_128()
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buf):
            h.update(view[:n])
    return h.hexdigest()


class FileDigests:
    """Per-file digests, cached on disk by the file's stat identity."""

    def __init__(self, root: str | Path | None = None, racy_s: float | None = None):
        # default `Settings.digests_dir` ($DFLASH_HOME/file-digests): Target.load is also called
        # from Python (notebooks, the trainer), where no command line has read the settings
        self.root = Path(root) if root is not None else Settings.from_env().digests_dir
        self.racy_s = RACY_S if racy_s is None else racy_s
        self.hashed_bytes = 0  # bytes actually read by this instance (for tests and the bench)

    def _record(self, key: dict) -> Path:
        return self.root / (hashlib.sha256(key["path"].encode()).hexdigest()[:32] + ".json")

    def file_digest(self, path: str | Path) -> str:
        path = Path(path)
        key = _stat_key(path)
        rec = self._record(key)
        try:
            stored = json.loads(rec.read_text())
            if stored.get("key") == key and isinstance(stored.get("digest"), str):
                return stored["digest"]
        except (OSError, ValueError, AttributeError):
            pass  # none yet, or unreadable: hash again
        for _ in range(3):
            started = time.time()
            digest = _stream_digest(path)
            after = _stat_key(path)
            if after == key:
                break
            key = after  # the file changed while it was read: read the new version
        else:
            raise FingerprintError(f"{path} keeps changing while it is read; is something still writing it?")
        self.hashed_bytes += key["size"]
        if started - max(key["mtime_ns"], key["ctime_ns"]) / 1e9 > self.racy_s:
            try:
                rec.parent.mkdir(parents=True, exist_ok=True)
                atomic_write_json(rec, {"key": key, "digest": digest}, durable=False)
            except OSError:
                pass  # a read-only cache only costs a re-read next time
        return digest

    def directory_digest(self, directory: str | Path, files: Iterable[Path] | None = None) -> str:
        """One digest over the identity files of a model directory (names, sizes, contents)."""
        h = hashlib.sha256()
        for p in (identity_files(directory) if files is None else files):
            h.update(f"{p.name}\0{p.stat().st_size}\0{self.file_digest(p)}\n".encode())
        return h.hexdigest()


def directory_state(directory: str | Path) -> list[dict]:
    """Stat identities of a directory's identity files (to detect a change during a load)."""
    return [_stat_key(p) for p in identity_files(directory)]


def tensor_digest(named: Iterable[tuple[str, torch.Tensor]], config: dict | None = None) -> str:
    """Digest of every byte of every tensor (name, shape and dtype included), plus a config."""
    h = xxhash.xxh3_128()
    if config is not None:
        h.update(json.dumps(config, sort_keys=True, default=str).encode())
    for name, t in named:
        if t.device.type == "meta":
            raise FingerprintError(f"tensor {name} has no data (meta device); cannot fingerprint the model")
        h.update(f"\0{name}:{tuple(t.shape)}:{t.dtype}\0".encode())
        flat = t.detach().reshape(-1)
        for s in range(0, flat.numel(), CHUNK):  # bounded host copies of device tensors
            part = flat[s:s + CHUNK].contiguous().cpu()
            h.update(part.view(torch.uint8).numpy().data)
    return h.hexdigest()
