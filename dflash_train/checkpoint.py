"""Drafter directories: `config.json` + `model.safetensors`, the published DFlash layout.

Loading never unpickles (safetensors only) and checks every tensor's name, shape and
dtype against the config before building anything, so a truncated or mismatched file
gives one clear error instead of a half-loaded model.

Publication: `publish_checkpoint` / `AsyncPublisher` save the drafter through the torch-free
contract in `dflash_train.publication` (atomic directory, `COMPLETE.json` written last),
which also holds reading, verifying, listing, pins and retention.
"""
from __future__ import annotations

import copy
import json
import os
import queue
import re
import threading
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from .config import ConfigError, DrafterConfig
from .model import DFlashDrafter
from .publication import CONFIG_NAME, FILE_MODE, INDEX_NAME, WEIGHTS_NAME, CheckpointError, publish_directory, read_manifest


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
    for name in (WEIGHTS_NAME, CONFIG_NAME):
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


def publish_checkpoint(drafter, checkpoint_root: str | Path, run_id: str, step: int, *,
                       state: dict[str, torch.Tensor] | None = None, train_metrics: dict | None = None,
                       dtype: torch.dtype | None = None) -> Path:
    """Atomically publish the drafter as `<root>/<run_id>/step-<step:08d>/` (see
    `publication.publish_directory`); returns its path.

    `drafter` needs only `.config` when `state` (a CPU snapshot) is given.
    """
    return publish_directory(checkpoint_root, run_id, step,
                             lambda tmp: save_drafter(drafter, tmp, dtype=dtype, state=state),
                             train_metrics=train_metrics)


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
