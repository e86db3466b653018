"""A checkpoint location parsed once: `CheckpointRef`, the value every layer passes instead of a string.

A location arrives as text at an edge (the CLI, the hook, `watch`, `import`, a job's JSON) and is parsed
there, once, into a frozen `CheckpointRef`: its canonical form (a URL by `check_url`, a path made
absolute), its kind (`local`, `s3`, `fsspec`, `hub`), whether it can be written, and the `Store` that
serves it. Confinement (`within`: does it lie inside the roots a worker serves?) is a method of the value,
so the kind of a location is decided here and in `storage.py`, nowhere else (tests/architecture/
test_location_kind.py holds every other module to that).

Jobs stay JSON: a job carries the canonical text (`str(ref)`), and `CheckpointRef.parse(job.checkpoint)`
gives the value back (`JobPayload.checkpoint_ref`).
"""
from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from dflash_train.common.errors import StoreError
from dflash_train.common.redaction import redact
from dflash_train.common.urls import check_url, is_url, protocol, within_prefixes

from . import storage

Kind = Literal["local", "s3", "fsspec", "hub"]
# a root list as callers hold it: text, paths, or refs parsed once (`CheckpointRef.parse_all`)
Roots = Sequence["str | os.PathLike[str] | CheckpointRef"]
S3_PROTOCOLS = ("s3",)  # what W&B's reference artifacts and boto3 name; s3a:// goes through fsspec


@dataclass(frozen=True)
class CheckpointRef:
    """One checkpoint location: `text` (a checked URL in canonical form, or an absolute path exactly as given:
    `..` after a symlink is not where a lexical clean-up puts it), `kind` what serves it."""

    text: str
    kind: Kind
    # answered once, when the value is made (attributes, not properties: asked at every layer)
    on_this_machine: bool = field(init=False, repr=False, compare=False)  # a directory here: evaluated in place
    writable: bool = field(init=False, repr=False, compare=False)  # pins, uploads, retention may write (Hub: never)
    url: str | None = field(init=False, repr=False, compare=False)  # the canonical URL; None for a local path

    def __post_init__(self) -> None:
        local = self.kind == "local"
        object.__setattr__(self, "on_this_machine", local)
        object.__setattr__(self, "writable", self.kind != "hub")
        object.__setattr__(self, "url", None if local else self.text)

    @classmethod
    def parse(cls, location: str | os.PathLike[str] | CheckpointRef) -> CheckpointRef:
        """The ref of `location`; StoreError for a URL that breaks the rules (credentials, '..', no bucket, ...)."""
        if isinstance(location, CheckpointRef):
            return location
        if isinstance(location, str) and "\x00" in location:
            raise StoreError(f"invalid location {location!r}")
        if isinstance(location, Path) or not is_url(location):  # a Path is never a URL
            raw = os.fspath(location)
            return cls(raw if os.path.isabs(raw) else os.path.join(os.getcwd(), raw), "local")
        url = check_url(location)
        proto = protocol(url)
        kind: Kind = "hub" if proto in storage.READ_ONLY else "s3" if proto in S3_PROTOCOLS else "fsspec"
        return cls(url, kind)

    @classmethod
    def parse_all(cls, roots: Iterable[str | os.PathLike[str] | CheckpointRef] | None) -> list[CheckpointRef]:
        """Refs of a root list, skipping what does not parse (a root list is the settings' business to check)."""
        out = []
        for r in roots or ():
            if isinstance(r, CheckpointRef):  # parsed once by the caller: kept as is
                out.append(r)
                continue
            try:
                out.append(cls.parse(r))
            except StoreError:
                continue
        return out

    def __str__(self) -> str:
        return self.text

    @property
    def canonical(self) -> str:
        """As a job names it: the URL, or the path made absolute and cleaned (`..`, `//`, a trailing '/')."""
        return self.text if self.kind != "local" else os.path.abspath(self.text)

    @property
    def path(self) -> Path:
        """The local path (ValueError for a store URL: there is no file to point at)."""
        if self.kind != "local":
            raise ValueError(f"{self.shown} is not on this machine")
        return Path(self.text)

    def as_canonical(self) -> CheckpointRef:
        """This location as a job names it (`canonical`): itself when its text already is."""
        return self if self.text == self.canonical else CheckpointRef(self.canonical, self.kind)

    @property
    def parent(self) -> CheckpointRef:
        """The location one level up (a checkpoint's run), of the same kind."""
        return CheckpointRef(str(self.store().parent(self.text)), self.kind)

    @property
    def shown(self) -> str:
        """For messages: a URL without anything secret in it."""
        return redact(self.text)

    def store(self, *, file_mode: int | None = None, dir_mode: int | None = None) -> storage.Store:
        return storage.store_for(self.text, file_mode=file_mode, dir_mode=dir_mode)

    def same_kind(self, roots: Iterable[str | os.PathLike[str] | CheckpointRef] | None) -> list[CheckpointRef]:
        """The roots that can hold this location: URL prefixes for a store URL, directories for a path."""
        return [r for r in self.parse_all(roots) if r.on_this_machine == self.on_this_machine]

    def within(self, roots: Iterable[str | os.PathLike[str] | CheckpointRef] | None) -> CheckpointRef | None:
        """This location, confined: inside one of `roots` of its own kind (a local path by its real path,
        symlinks resolved; a URL under a prefix by whole path segments), else None."""
        mine = [r.text for r in self.same_kind(roots)]
        if self.kind != "local":
            url = within_prefixes(self.text, mine)
            return None if url is None else CheckpointRef(url, self.kind)
        real = os.path.realpath(self.text)
        return CheckpointRef(real, "local") if _inside(real, _tops(mine)) else None


def real_paths_within(paths: Iterable[str | os.PathLike[str]],
                      roots: Iterable[str | os.PathLike[str] | CheckpointRef] | None) -> list[Path | None]:
    """For each local path, its real path (symlinks resolved) if it lies inside one of the directories among
    `roots`, else None: `CheckpointRef.within` for many files at once (a checkpoint's listed files), the roots
    parsed once."""
    tops = _tops([r.text for r in CheckpointRef.parse_all(roots) if r.on_this_machine])
    out: list[Path | None] = []
    for p in paths:
        real = os.path.realpath(p)
        out.append(Path(real) if _inside(real, tops) else None)
    return out


def _tops(dirs: Iterable[str]) -> list[str]:
    """Root directories as prefixes of whole segments: '/a/b/' holds '/a/b', '/a/b' never holds '/a/bc'."""
    out = []
    for d in dirs:
        d = os.path.normpath(d)
        out.append(d if d.endswith(os.sep) else d + os.sep)
    return out


def _inside(real: str, tops: list[str]) -> bool:
    return any(real + os.sep == t or real.startswith(t) for t in tops)


def first_local_root(roots: Iterable[str | os.PathLike[str] | CheckpointRef] | None) -> Path | None:
    """The first directory among `roots` (where `import` and `watch` write converted checkpoints: a store prefix
    among the roots is read by workers, not written by a converter), None when every root is a store prefix."""
    return next((r.path for r in CheckpointRef.parse_all(roots) if r.on_this_machine), None)
