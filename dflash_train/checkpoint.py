"""Drafter directories: `config.json` + `model.safetensors`, the published DFlash layout.

Loading never unpickles (safetensors only) and checks every tensor's name, shape and
dtype against the config before building anything, so a truncated or mismatched file
gives one clear error instead of a half-loaded model.

Publication (design.md): `publish_checkpoint` / `AsyncPublisher` write
`<root>/<run_id>/step-<step:08d>/` atomically with a `COMPLETE.json` manifest written last;
`read_manifest`, `verify_checkpoint`, `list_checkpoints`, pins, retention and cleanup of
half-written directories complete the contract with the hook and the worker.
"""
from __future__ import annotations

import contextlib
import copy
import hashlib
import json
import os
import queue
import re
import shutil
import threading
from datetime import datetime, timezone
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .config import ConfigError, DrafterConfig
from .fsutil import atomic_write_json, fsync_path, pid_alive
from .model import DFlashDrafter

# Published checkpoints are read by eval workers that may run as another user: every file is
# 0644 and every directory we create 0755, whatever the umask (safetensors alone writes 0600).
FILE_MODE, DIR_MODE = 0o644, 0o755
WEIGHTS_NAME = "model.safetensors"
INDEX_NAME = "model.safetensors.index.json"


class CheckpointError(ValueError):
    """A drafter directory that cannot be loaded; the message says why."""


def drafter_state_dict(drafter: DFlashDrafter) -> dict[str, torch.Tensor]:
    """Unprefixed checkpoint tensors (buffers such as rotary tables are not saved)."""
    return {k: v.detach().contiguous() for k, v in drafter.state_dict().items() if "rotary_emb" not in k}


def save_drafter(drafter: DFlashDrafter, directory: str | Path, *, dtype: torch.dtype | None = None,
                 state: dict[str, torch.Tensor] | None = None) -> Path:
    """Write config.json and model.safetensors into `directory` (created if needed).

    `state` lets a caller save a CPU snapshot taken earlier (the async hook does).
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = state if state is not None else drafter_state_dict(drafter)
    if dtype is not None:
        tensors = {k: v.to(dtype) for k, v in tensors.items()}
    tensors = {k: v.cpu().contiguous() for k, v in tensors.items()}
    cfg = drafter.config
    cfg.torch_dtype = str(next(iter(tensors.values())).dtype).removeprefix("torch.")
    save_file(tensors, str(directory / WEIGHTS_NAME), metadata={"format": "pt"})
    cfg.save(directory)
    for name in (WEIGHTS_NAME, "config.json"):
        os.chmod(directory / name, FILE_MODE)
    return directory


def read_drafter_tensors(directory: str | Path) -> dict[str, torch.Tensor]:
    directory = Path(directory)
    single, index = directory / WEIGHTS_NAME, directory / INDEX_NAME
    try:
        if single.is_file():
            return load_file(str(single))
        if index.is_file():
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            tensors: dict[str, torch.Tensor] = {}
            for shard in shards:
                if os.sep in shard or shard.startswith(".."):
                    raise CheckpointError(f"{index}: shard name {shard!r} escapes the directory")
                tensors.update(load_file(str(directory / shard)))
            return tensors
    except SafetensorError as e:
        raise CheckpointError(f"{directory}: weights file is corrupt or truncated ({e})") from None
    except (OSError, KeyError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{directory}: cannot read weights ({e})") from None
    raise CheckpointError(f"{directory}: no {WEIGHTS_NAME} (or {INDEX_NAME}) found")


def load_drafter(directory: str | Path, *, device: str | torch.device = "cpu",
                 dtype: torch.dtype | None = None) -> DFlashDrafter:
    """Build a drafter from a directory, checking names, shapes and dtypes first."""
    directory = Path(directory)
    if not directory.is_dir():
        raise CheckpointError(f"{directory} is not a directory")
    try:
        cfg = DrafterConfig.load(directory)
    except ConfigError as e:
        raise CheckpointError(str(e)) from None
    tensors = read_drafter_tensors(directory)
    layers = {int(m.group(1)) for k in tensors if (m := re.match(r"layers\.(\d+)\.", k))}
    if len(layers) != cfg.num_hidden_layers:  # checked first: building a huge claimed depth would take forever
        raise CheckpointError(f"{directory}: config.json says {cfg.num_hidden_layers} layers, "
                              f"the weights hold {len(layers)}")
    try:
        with torch.device("meta"):
            expected = {k: v for k, v in DFlashDrafter(cfg).state_dict().items() if "rotary_emb" not in k}
    except Exception as e:  # noqa: BLE001 - whatever the config gets wrong, one clear error
        raise CheckpointError(f"{directory}: config.json does not describe a buildable drafter "
                              f"({type(e).__name__}: {e})") from None
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    wrong = [f"{k}: file {tuple(tensors[k].shape)} vs config {tuple(v.shape)}"
             for k, v in expected.items() if k in tensors and tensors[k].shape != v.shape]
    not_float = [k for k, t in tensors.items() if not t.is_floating_point()]
    problems = []
    if missing:
        problems.append(f"missing tensors {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    if unexpected:
        problems.append(f"unexpected tensors {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''}")
    if wrong:
        problems.append("wrong shapes: " + "; ".join(wrong[:5]))
    if not_float:
        problems.append(f"non-float tensors {not_float[:5]}")
    if problems:
        raise CheckpointError(f"{directory}: weights do not match config.json: " + "; ".join(problems))
    bad = [f"{k} ({int((~torch.isfinite(t)).sum())} of {t.numel()})" for k, t in sorted(tensors.items())
           if not torch.isfinite(t).all()]
    if bad:  # a diverged run drafts garbage that would score as a plausible tau of 1
        raise CheckpointError(f"{directory}: non-finite weights (NaN/Inf) in {len(bad)} tensor(s): "
                              f"{', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''}; refusing to load this drafter")
    drafter = DFlashDrafter(cfg)
    drafter.load_state_dict(tensors, strict=True)
    target_dtype = dtype or next(iter(tensors.values())).dtype
    return drafter.to(device=device, dtype=target_dtype)


# --- publication (design.md "Published eval checkpoint") ---------------------------------
# A checkpoint is published by writing a hidden temporary directory, fsyncing it,
# renaming it into place and only then writing COMPLETE.json (itself via a fsynced
# temporary file and a rename). A directory without the marker is never a checkpoint.
MARKER_NAME = "COMPLETE.json"
MANIFEST_FORMAT = "dflash-checkpoint/1"
PINS_DIR = ".pins"
_STEP_DIR = re.compile(r"^step-(\d{8,})$")
_TMP_DIR = re.compile(r"^\.step-(\d{8,})\.tmp-(\d+)$")


def step_dir_name(step: int) -> str:
    return f"step-{int(step):08d}"


def sha256_file(path: str | Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def publish_checkpoint(drafter, checkpoint_root: str | Path, run_id: str, step: int, *,
                       state: dict[str, torch.Tensor] | None = None, train_metrics: dict | None = None,
                       dtype: torch.dtype | None = None) -> Path:
    """Atomically publish `<root>/<run_id>/step-<step:08d>/`; returns its path.

    `drafter` needs only `.config` when `state` (a CPU snapshot) is given. Publishing a
    step that is already complete is an error; a leftover without a marker is replaced.
    """
    if not run_id or "/" in run_id or run_id.startswith("."):
        raise CheckpointError(f"invalid run id {run_id!r}")
    run_dir = Path(checkpoint_root) / run_id
    if not run_dir.is_dir():
        run_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(run_dir, DIR_MODE)
    final = run_dir / step_dir_name(step)
    if (final / MARKER_NAME).exists():
        raise CheckpointError(f"{final} is already published")
    tmp = run_dir / f".{final.name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    save_drafter(drafter, tmp, dtype=dtype, state=state)
    os.chmod(tmp, DIR_MODE)
    files = {}
    for p in sorted(tmp.iterdir()):
        fsync_path(p)
        files[p.name] = sha256_file(p)
    fsync_path(tmp)
    if final.exists():  # renamed but never marked: a crashed earlier attempt
        shutil.rmtree(final)
    os.rename(tmp, final)
    fsync_path(run_dir)
    manifest = {
        "format": MANIFEST_FORMAT, "run_id": run_id, "step": int(step), "digest": files[WEIGHTS_NAME],
        "files": files, "config": json.loads((final / "config.json").read_text()),
        "created_at": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "train_metrics": dict(train_metrics or {}),
    }
    atomic_write_json(final / MARKER_NAME, manifest, mode=FILE_MODE)
    return final


def read_manifest(directory: str | Path) -> dict:
    """The manifest of a published checkpoint; CheckpointError if it is not one."""
    marker = Path(directory) / MARKER_NAME
    try:
        data = json.loads(marker.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{directory}: no {MARKER_NAME}; not a published checkpoint "
                              "(still being written, or abandoned)") from None
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{marker}: unreadable marker ({e})") from None
    problems = []
    if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT:
        raise CheckpointError(f"{marker}: format is not {MANIFEST_FORMAT!r}")
    if not isinstance(data.get("step"), int) or data["step"] < 0:
        problems.append("step must be a non-negative integer")
    if not isinstance(data.get("digest"), str) or len(data["digest"]) != 64:
        problems.append("digest must be a sha256 hex string")
    files = data.get("files")
    if not isinstance(files, dict) or WEIGHTS_NAME not in files:
        problems.append(f"files must list {WEIGHTS_NAME}")
    elif files[WEIGHTS_NAME] != data.get("digest"):
        problems.append("digest differs from files[model.safetensors]")
    if not isinstance(data.get("run_id"), str):
        problems.append("run_id missing")
    if problems:
        raise CheckpointError(f"{marker}: invalid manifest: " + "; ".join(problems))
    return data


def verify_checkpoint(directory: str | Path) -> dict:
    """read_manifest plus a sha256 check of every listed file; returns the manifest."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    for name, want in manifest["files"].items():
        path = directory / name
        if os.sep in name or name.startswith(".") or not path.is_file():
            raise CheckpointError(f"{directory}: listed file {name!r} is missing")
        got = sha256_file(path)
        if got != want:
            raise CheckpointError(f"{directory}: {name} digest {got[:12]} != manifest {want[:12]} (modified or corrupt)")
    return manifest


def checkpoint_step(directory: str | Path) -> int | None:
    m = _STEP_DIR.match(Path(directory).name)
    return int(m.group(1)) if m else None


def list_checkpoints(run_dir: str | Path) -> list[Path]:
    """Published (marked) checkpoints of a run directory, oldest step first."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    found = [p for p in run_dir.iterdir() if p.is_dir() and checkpoint_step(p) is not None
             and (p / MARKER_NAME).is_file()]
    return sorted(found, key=checkpoint_step)


def _pin_path(directory: Path, token: str) -> Path:
    if not token or "/" in token or token.startswith("."):
        raise CheckpointError(f"invalid pin token {token!r}")
    return Path(directory) / PINS_DIR / token


def pin_checkpoint(directory: str | Path, token: str) -> Path:
    """Keep `directory` through retention until `unpin_checkpoint(directory, token)`."""
    p = _pin_path(Path(directory), token)
    if not Path(directory).is_dir():
        raise CheckpointError(f"cannot pin {directory}: no such checkpoint")
    if not p.parent.is_dir():
        p.parent.mkdir(mode=DIR_MODE, exist_ok=True)
        os.chmod(p.parent, DIR_MODE)
    fd = os.open(p, os.O_WRONLY | os.O_CREAT, FILE_MODE)
    try:
        with contextlib.suppress(OSError):  # another user's pin of the same token: leave its mode
            os.fchmod(fd, FILE_MODE)
    finally:
        os.close(fd)
    return p


def unpin_checkpoint(directory: str | Path, token: str) -> None:
    try:
        _pin_path(Path(directory), token).unlink()
    except FileNotFoundError:
        pass


def is_pinned(directory: str | Path) -> bool:
    pins = Path(directory) / PINS_DIR
    return pins.is_dir() and any(pins.iterdir())


def remove_checkpoint(directory: str | Path) -> None:
    """Invalidate first (marker gone), then delete: a reader never loads a half-deleted one."""
    directory = Path(directory)
    try:
        (directory / MARKER_NAME).unlink()
    except FileNotFoundError:
        pass
    shutil.rmtree(directory, ignore_errors=True)


def apply_retention(run_dir: str | Path, keep_last: int, protect=None) -> list[Path]:
    """Delete published checkpoints beyond the newest `keep_last` (0 keeps all).

    Kept regardless: pinned ones and those for which `protect(path)` is True.
    Returns the removed paths.
    """
    if keep_last <= 0:
        return []
    removed = []
    for path in list_checkpoints(run_dir)[:-keep_last]:
        if is_pinned(path) or (protect is not None and protect(path)):
            continue
        if is_pinned(path):  # re-check just before deleting: a pin may have just landed
            continue
        remove_checkpoint(path)
        removed.append(path)
    return removed


def cleanup_incomplete(run_dir: str | Path) -> list[Path]:
    """Remove half-written publications of earlier runs (call before training starts).

    `.step-*.tmp-<pid>` directories of dead processes (or of this one: nothing is in
    flight yet) and `step-*` directories that never got their marker.
    """
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return []
    removed = []
    for p in run_dir.iterdir():
        m = _TMP_DIR.match(p.name)
        stale_tmp = m is not None and (int(m.group(2)) == os.getpid() or not pid_alive(int(m.group(2))))
        unmarked = checkpoint_step(p) is not None and p.is_dir() and not (p / MARKER_NAME).exists()
        if stale_tmp or unmarked:
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


class AsyncPublisher:
    """Publish checkpoints without stalling training.

    `submit` snapshots the drafter's weights to CPU on the caller's (training) thread, so
    later optimizer steps cannot leak into the checkpoint; a background thread writes,
    fsyncs, renames, marks and then calls `on_published(step, path, manifest)` (from that
    thread). At most `max_pending` snapshots wait; `submit` blocks beyond that. A failed
    publication is raised by the next `submit` or `wait`.
    """

    def __init__(self, checkpoint_root: str | Path, run_id: str, *, on_published=None,
                 dtype: torch.dtype | None = None, max_pending: int = 1):
        self.checkpoint_root, self.run_id = Path(checkpoint_root), run_id
        self.on_published, self.dtype = on_published, dtype
        self._jobs: queue.Queue = queue.Queue(maxsize=max(max_pending, 1))
        self._error: BaseException | None = None
        self._idle = threading.Event()
        self._idle.set()
        self._pending = 0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="checkpoint-publisher", daemon=True)
        self._thread.start()

    def _raise_error(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise CheckpointError(f"checkpoint publication failed: {err!r}") from err

    def submit(self, drafter: DFlashDrafter, step: int, train_metrics: dict | None = None) -> None:
        self._raise_error()
        snapshot = {k: v.detach().to("cpu", copy=True) for k, v in drafter_state_dict(drafter).items()}
        holder = SimpleNamespace(config=copy.deepcopy(drafter.config))
        with self._lock:
            self._pending += 1
            self._idle.clear()
        self._jobs.put((holder, snapshot, int(step), dict(train_metrics or {})))

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            holder, snapshot, step, metrics = job
            try:
                path = publish_checkpoint(holder, self.checkpoint_root, self.run_id, step, state=snapshot,
                                          train_metrics=metrics, dtype=self.dtype)
                if self.on_published is not None:
                    self.on_published(step, path, read_manifest(path))
            except BaseException as e:  # kept for the training thread
                self._error = self._error or e
            finally:
                with self._lock:
                    self._pending -= 1
                    if self._pending == 0:
                        self._idle.set()

    @property
    def pending(self) -> int:
        return self._pending

    def wait(self, timeout: float | None = None) -> None:
        """Block until every submitted checkpoint is published (or failed: raised here)."""
        if not self._idle.wait(timeout):
            raise TimeoutError(f"checkpoint publication still running after {timeout}s")
        self._raise_error()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._jobs.put(None)
            self._thread.join(timeout=60)
