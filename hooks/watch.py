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

An entry of the state is (path, signature, step): a file re-saved under its name (`last.pt` at
step 400, then 500) has a new signature (size, mtime) and is handled again once it settles; a
failed entry is retried when its files' signature changes (a write that stalled past `settle`
and was read half-written) or the inputs it failed with change (`--config` and the file it
names, `--prefix`, `--every`), else said once per start, with `--retry-failed` to force it.
One odd entry of the directory (an unreadable file, a DeepSpec `step_latest` of either form,
something that vanishes mid-scan) is reported and passed over, never the end of the watcher.
"""
from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from dflash_train.checkpoints.location import CheckpointRef
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


def _pointed_step(latest: Path) -> int | None:
    """The step DeepSpec's `step_latest` names: a symlink to `step_N`, or a plain file holding `step_N`
    (a path or a name); None when it names none or cannot be read."""
    from dflash_train.checkpoints.training_state import step_from_name

    try:
        if latest.is_symlink():
            text = os.readlink(latest)
        else:
            with open(latest, "rb") as f:
                text = f.read(4096).decode("utf-8", "replace").strip().splitlines()[0] if latest.is_file() else ""
    except (OSError, IndexError):
        return None
    return step_from_name(Path(text.strip().rstrip("/")).name) if text.strip() else None


class Watcher:
    """`scan()` once per poll; `submit(record_path) -> str` queues a record and says how (the CLI
    submits through the `JobClient`, outbox first). `clock` is injectable so tests step time instead of sleeping."""

    def __init__(self, directory: str | Path, into: str | Path | None, *, submit: Callable[[Path], str],
                 config: str | Path | None = None, every: int | None = None, settle: float = 30.0,
                 run_id: str | None = None, state_path: str | Path | None = None, prefix: str | None = None,
                 retry_failed: bool = False, log: Callable[[str], None] = print,
                 clock: Callable[[], float] = time.time):
        # an object-store run prefix (s3://...): its published checkpoints (COMPLETE.json written last) are queued
        ref = CheckpointRef.parse(directory)
        self.url = ref.url
        self.directory = Path(directory).resolve() if ref.on_this_machine else None
        self.into = Path(into) if into is not None else None
        self.submit, self.config, self.every, self.settle, self.prefix = submit, config, every, settle, prefix
        self.run_id = run_id or run_id_from(ref.store().name(self.url or Path(directory).resolve()), default="watch")
        if state_path is None and self.into is None:
            raise ValueError("give `into` (converted checkpoints and the state file) or `state_path`")
        if state_path:
            self.state_path = Path(state_path)
        else:
            assert self.into is not None  # checked just above
            self.state_path = self.into / self.run_id / STATE_NAME
        self.log, self.clock, self.retry_failed = log, clock, retry_failed
        self._retried: set[str] = set()  # entries recorded in this process: --retry-failed retries each once
        self._told: set[str] = set()  # failed entries whose "not retried" was said in this process
        self._odd: dict[str, str] = {}  # odd entries and what was said about them (said again only if it changes)
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
        try:
            entries = sorted(self.directory.iterdir()) if self.directory.is_dir() else []
        except OSError as e:  # the directory itself is unreadable this time: said, tried again next scan
            self._odd_entry(str(self.directory), f"cannot list it ({e})")
            return []
        for p in entries:
            try:
                if p.name.startswith(".") or p.is_symlink():
                    continue
                if p.is_dir() and (_DIR.match(p.name) or (p / MARKER_NAME).exists()):
                    out.append(p)
                elif p.is_file() and p.suffix in _FILE_SUFFIXES:
                    out.append(p)
            except OSError as e:  # an entry we may not even stat: not ours, passed over
                self._odd_entry(str(p), f"passed over ({e})")
        return out

    def _odd_entry(self, key: str, what: str) -> None:
        if self._odd.get(key) != what:
            self._odd[key] = what
            self.log(f"{'odd':8s} {key}: {what}")

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
            pointed = _pointed_step(latest)
            return pointed is not None and pointed >= (step_from_name(p.name) or 0)
        now, sig = self.clock(), self._signature(p)
        seen = self._seen.get(str(p))
        if seen is None or seen.signature != sig:
            self._seen[str(p)] = Seen(sig, now)
            self._save()
            return self.settle <= 0  # no settling asked for: what is seen counts (`--settle 0 --once`)
        return now - seen.since >= self.settle

    # --- what a state entry stands for -----------------------------------------------------
    def _inputs(self) -> dict:
        """What a conversion depends on besides the checkpoint: the config given (and its file's signature),
        the prefix, `every`. A failed entry is retried when these change."""
        config = None
        if self.config is not None:
            path = Path(self.config).resolve()
            try:
                st = path.stat()
                config = [str(path), st.st_size, st.st_mtime_ns]
            except OSError:
                config = [str(path), None, None]
        return {"config": config, "prefix": self.prefix, "every": self.every}

    def _again(self, p: Path, key: str, entry: dict) -> bool:
        """Whether a checkpoint handled before is handled again now (rules in the module docstring)."""
        if entry.get("status") == "failed":
            if self.retry_failed and key not in self._retried:
                return True  # until its retry is recorded (`_record`)
            if entry.get("signature") is not None and self._signature_now(p) != _as_signature(entry["signature"]):
                return True  # rewritten since (a stalled write that went on, a fixed file)
            if entry.get("inputs") is not None and entry["inputs"] != self._inputs():
                return True  # the config or flags it failed with were changed
            if key not in self._told:
                self._told.add(key)
                self.log(f"{'failed':8s} {key}: not retried: neither it nor the inputs it failed with (--config and "
                         f"its file, --prefix, --every) changed since it failed ({_first_line(entry.get('reason'))}); "
                         "`dflash-eval watch ... --retry-failed` tries it again")
            return False
        # a file re-saved under its name is a new checkpoint (directories keep their name per step)
        return (entry.get("signature") is not None and p.is_file()
                and self._signature_now(p) != _as_signature(entry["signature"]))

    def _signature_now(self, p: Path) -> tuple | None:
        try:
            return self._signature(p)
        except OSError:
            return None

    # --- one poll --------------------------------------------------------------------------
    def scan(self) -> list[dict]:  # noqa: C901 - one poll's cases in the order they are met
        """Handle what is complete and new; return one event per checkpoint handled now."""
        from dflash_train.checkpoints.training_state import StepUnknown, describe, import_checkpoint

        if self.url:
            return self._scan_store()
        events = []
        present = {str(p) for p in self.candidates()}
        for key in sorted(set(self._seen) - present):  # seen while being written, then deleted
            del self._seen[key]
            if key not in self.state:
                events.append(self._record(key, {"status": "skipped", "reason": "deleted before it was complete"}))
        for p in self.candidates():
            key, signature = str(p), None
            try:
                if key in self.state and not self._again(p, key, self.state[key]):
                    continue
                if not self.complete(p):
                    continue
                self._seen.pop(key, None)
                signature = self._signature_now(p)  # what is handled now: a later change is another checkpoint
                if (p / MARKER_NAME).exists() if p.is_dir() else False:
                    record, step = p, read_manifest(p)["step"]
                else:
                    step = describe(p)["step"]
                    if self.every and step is not None and step % self.every:
                        events.append(self._record(key, {"status": "skipped", "step": step, "signature": signature,
                                                         "reason": f"not a multiple of --every {self.every}"}))
                        continue
                    # always converted (its own config.json when it has one): the trainer may delete its copy
                    own = p / "config.json" if p.is_dir() and (p / "config.json").is_file() else None
                    # a local directory watched with no `into` fails here, as it always did: kept as is
                    try:
                        record, _, facts = import_checkpoint(self.into, self.run_id, None,  # type: ignore[arg-type]
                                                             p, config=self.config or own, prefix=self.prefix)
                    except StepUnknown as e:
                        raise CheckpointError(f"{e}: name the file after its step (e.g. checkpoint_step500.pt), "
                                              "save a `step` entry in it, or import it with `dflash-eval import "
                                              f"{p} --step N`") from None
                    step = facts["step"]
                if self.every and step % self.every:
                    events.append(self._record(key, {"status": "skipped", "step": step, "signature": signature,
                                                     "reason": f"not a multiple of --every {self.every}"}))
                    continue
                how = self.submit(Path(record))
                events.append(self._record(key, {"status": "queued", "step": step, "record": str(record),
                                                 "job": how, "signature": signature}))
            except FileNotFoundError as e:  # the trainer's retention removed it under us
                events.append(self._record(key, {"status": "skipped", "reason": f"deleted before its import ({e})"}))
            except CheckpointError as e:
                if not os.path.lexists(p):
                    events.append(self._record(key, {"status": "skipped", "reason": "deleted before its import"}))
                elif signature is not None and self._signature_now(p) != signature:  # written to while read: unsettled
                    self._seen[key] = Seen(self._signature_now(p) or (), self.clock())
                    self._save()
                    self._odd_entry(key, "changed while it was read: handled once it settles again")
                else:
                    events.append(self._record(key, {"status": "failed", "reason": str(e), "signature": signature,
                                                     "inputs": self._inputs()}))
            except OSError as e:  # an entry we cannot read (permissions, a vanishing mount): said, not fatal
                self._odd_entry(key, f"cannot be read now ({type(e).__name__}: {e}); tried again next scan")
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
            except OSError as e:  # not queued nor kept (the outbox's disk full, the queue away): next scan
                self._odd_entry(url, f"not queued now ({type(e).__name__}: {e}); tried again next scan")
        return events

    def _save(self) -> None:
        atomic_write_json(self.state_path, {
            "checkpoints": self.state,
            "pending": {k: {"signature": [list(x) for x in v.signature], "since": v.since} for k,
                        v in self._seen.items()}})

    def _record(self, key: str, entry: dict) -> dict:
        if entry.get("signature") is not None:
            entry["signature"] = [list(x) for x in entry["signature"]]  # JSON's shape, compared via _as_signature
        self.state[key] = entry
        self._retried.add(key)
        self._seen.pop(key, None)
        self._odd.pop(key, None)
        self._save()
        step = f" step {entry['step']}" if entry.get("step") is not None else ""
        detail = entry.get("job") or entry.get("reason") or ""
        self.log(f"{entry['status']:8s} {key}{step}: {detail}")
        return {"checkpoint": key, **{k: v for k, v in entry.items() if k not in ("signature", "inputs")}}

    def run(self, interval: float = 10.0, once: bool = False,
            before_scan: Callable[[], object] | None = None) -> None:
        """Scan every `interval` s; `before_scan`: the caller's housekeeping (the CLI: deliver what waits
        in the run's outbox)."""
        while True:
            if before_scan is not None:
                before_scan()
            self.scan()
            if once:
                return
            time.sleep(interval)  # polling: a training directory may be on NFS or a FUSE mount (no inotify)


def _as_signature(saved) -> tuple:
    return tuple(tuple(x) for x in saved)


def _first_line(text) -> str:
    line = str(text or "").strip().splitlines()[0] if str(text or "").strip() else ""
    return line if len(line) <= 200 else line[:200] + " ..."
