"""Follow a training directory: each checkpoint a trainer writes there is imported and queued once.

A checkpoint counts once it is complete, by the rule of whoever wrote it:
  - ours: `COMPLETE.json` (queued as it is);
  - HF Trainer `checkpoint-N/`: `trainer_state.json` written (the Trainer writes it last);
  - DeepSpec `step_N/`: its `step_latest` link points at step N or a later one;
  - anything else (a loop's `*.pt`, SpecForge `{run}-step{N}/training_state.pt`): size and
    mtime unchanged for `settle` seconds.
Each is converted into a checkpoint under `into` (`training_state.import_checkpoint`), so the
trainer's retention may delete its own copy before the eval runs. What was done is kept in a
state file (atomic writes): a restarted watcher queues nothing twice and picks up what appeared
while it was down; the queue's job ids dedupe the window between a job queued and the state
written. A checkpoint deleted before it could be imported is a visible skip, not a crash.
"""
from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dflash_train.checkpoints import storage
from dflash_train.checkpoints.publication import (
    MARKER_NAME,
    CheckpointError,
    checkpoint_step,
    list_checkpoints,
    read_manifest,
    run_id_from,
)
from dflash_train.common.fsutil import atomic_write_json

# HF Trainer, DeepSpec, ours, SpecForge, speculators (a directory per epoch/step number)
_DIR = re.compile(r"^(checkpoint-\d+|step_\d+|step-\d+|.+-step\d+|epoch_\d+_step_\d+|\d+)$")
_FILE_SUFFIXES = (".pt", ".pth", ".ckpt")
STATE_NAME = "watch-state.json"


@dataclass
class Seen:
    signature: tuple
    since: float


class Watcher:
    """`scan()` once per poll; `submit(record_path) -> str` queues a record and says how (the CLI
    enqueues on Redis). `clock` is injectable so tests step time instead of sleeping."""

    def __init__(self, directory: str | Path, into: str | Path | None, *, submit: Callable[[Path], str],
                 config: str | Path | None = None, every: int | None = None, settle: float = 30.0,
                 run_id: str | None = None, state_path: str | Path | None = None, prefix: str | None = None,
                 log: Callable[[str], None] = print, clock: Callable[[], float] = time.time):
        # an object-store run prefix (s3://...): its published checkpoints (COMPLETE.json written last) are queued
        store = storage.store_for(str(directory))
        self.url = None if store.local else storage.check_url(str(directory))
        self.directory = Path(directory).resolve() if store.local else None
        self.into = Path(into) if into is not None else None
        self.submit, self.config, self.every, self.settle, self.prefix = submit, config, every, settle, prefix
        self.run_id = run_id or run_id_from(store.name(self.url or Path(directory).resolve()), default="watch")
        if state_path is None and self.into is None:
            raise ValueError("give `into` (converted checkpoints and the state file) or `state_path`")
        if state_path:
            self.state_path = Path(state_path)
        else:
            assert self.into is not None  # checked just above
            self.state_path = self.into / self.run_id / STATE_NAME
        self.log, self.clock = log, clock
        self.state: dict[str, dict] = {}
        self._seen: dict[str, Seen] = {}  # written but not yet settled (kept across restarts: `--once` from cron)
        self.state_path.parent.mkdir(parents=True, exist_ok=True)
        if self.state_path.exists():
            import json

            saved = json.loads(self.state_path.read_text())
            self.state = saved.get("checkpoints", {})
            self._seen = {k: Seen(tuple(tuple(x) for x in v["signature"]), v["since"])
                          for k, v in saved.get("pending", {}).items()}

    # --- what is there -------------------------------------------------------------------
    def candidates(self) -> list[Path]:
        assert self.directory is not None, "a local directory is watched"
        out = []
        for p in sorted(self.directory.iterdir()) if self.directory.is_dir() else []:
            if p.name.startswith(".") or p.is_symlink():
                continue
            if p.is_dir() and (_DIR.match(p.name) or (p / MARKER_NAME).exists()):
                out.append(p)
            elif p.is_file() and p.suffix in _FILE_SUFFIXES:
                out.append(p)
        return out

    def _signature(self, p: Path) -> tuple:
        files = [p] if p.is_file() else sorted(q for q in p.rglob("*") if q.is_file())
        return tuple((str(q), q.stat().st_size, q.stat().st_mtime_ns) for q in files)

    def complete(self, p: Path) -> bool:
        """Whether the trainer has finished writing `p` (rules in the module docstring)."""
        from dflash_train.checkpoints.training_state import step_from_name

        if p.is_dir() and (p / MARKER_NAME).exists():
            return True
        if p.is_dir() and p.name.startswith("checkpoint-"):
            return (p / "trainer_state.json").is_file()
        latest = p.parent / "step_latest"
        if p.is_dir() and p.name.startswith("step_") and os.path.lexists(latest):
            pointed = step_from_name(Path(os.readlink(latest)).name)
            return pointed is not None and pointed >= (step_from_name(p.name) or 0)
        now, sig = self.clock(), self._signature(p)
        seen = self._seen.get(str(p))
        if seen is None or seen.signature != sig:
            self._seen[str(p)] = Seen(sig, now)
            self._save()
            return False
        return now - seen.since >= self.settle

    # --- one poll --------------------------------------------------------------------------
    def scan(self) -> list[dict]:
        """Handle what is complete and new; return one event per checkpoint handled now."""
        from dflash_train.checkpoints.training_state import describe, import_checkpoint

        if self.url:
            return self._scan_store()
        events = []
        present = {str(p) for p in self.candidates()}
        for key in sorted(set(self._seen) - present):  # seen while being written, then deleted
            del self._seen[key]
            if key not in self.state:
                events.append(self._record(key, {"status": "skipped", "reason": "deleted before it was complete"}))
        for p in self.candidates():
            key = str(p)
            if key in self.state:
                continue
            try:
                if not self.complete(p):
                    continue
                self._seen.pop(key, None)
                if (p / MARKER_NAME).exists() if p.is_dir() else False:
                    record, step = p, read_manifest(p)["step"]
                else:
                    step = describe(p)["step"]
                    if self.every and step is not None and step % self.every:
                        events.append(self._record(key, {"status": "skipped", "step": step,
                                                         "reason": f"not a multiple of --every {self.every}"}))
                        continue
                    # always converted (its own config.json when it has one): the trainer may delete its copy
                    own = p / "config.json" if p.is_dir() and (p / "config.json").is_file() else None
                    # a local directory watched with no `into` fails here, as it always did: kept as is
                    record, _, facts = import_checkpoint(self.into, self.run_id, None, p,  # type: ignore[arg-type]
                                                         config=self.config or own, prefix=self.prefix)
                    step = facts["step"]
                if self.every and step % self.every:
                    events.append(self._record(key, {"status": "skipped", "step": step,
                                                     "reason": f"not a multiple of --every {self.every}"}))
                    continue
                how = self.submit(Path(record))
                events.append(self._record(key, {"status": "queued", "step": step, "record": str(record),
                                                 "job": how}))
            except FileNotFoundError as e:  # the trainer's retention removed it under us
                events.append(self._record(key, {"status": "skipped", "reason": f"deleted before its import ({e})"}))
            except CheckpointError as e:
                if not os.path.lexists(p):
                    events.append(self._record(key, {"status": "skipped", "reason": "deleted before its import"}))
                else:
                    events.append(self._record(key, {"status": "failed", "reason": str(e)}))
        return events

    def _scan_store(self) -> list[dict]:
        assert self.url is not None, "a store prefix is watched"
        events = []
        for url in list_checkpoints(self.url):  # marked ones only: a store upload writes the marker last
            if url in self.state:
                continue
            step = checkpoint_step(url)
            assert step is not None, url  # list_checkpoints lists step directories only
            if self.every and step % self.every:
                events.append(self._record(url, {"status": "skipped", "step": step,
                                                 "reason": f"not a multiple of --every {self.every}"}))
                continue
            try:
                events.append(self._record(url, {"status": "queued", "step": step, "record": url,
                                                 "job": self.submit(url)}))
            except CheckpointError as e:
                events.append(self._record(url, {"status": "failed", "step": step, "reason": str(e)}))
        return events

    def _save(self) -> None:
        atomic_write_json(self.state_path, {
            "checkpoints": self.state,
            "pending": {k: {"signature": [list(x) for x in v.signature], "since": v.since} for k,
                        v in self._seen.items()}})

    def _record(self, key: str, entry: dict) -> dict:
        self.state[key] = entry
        self._seen.pop(key, None)
        self._save()
        step = f" step {entry['step']}" if entry.get("step") is not None else ""
        detail = entry.get("job") or entry.get("reason") or ""
        self.log(f"{entry['status']:8s} {key}{step}: {detail}")
        return {"checkpoint": key, **entry}

    def run(self, interval: float = 10.0, once: bool = False) -> None:
        while True:
            self.scan()
            if once:
                return
            time.sleep(interval)  # polling: a training directory may be on NFS or a FUSE mount (no inotify)
