"""Drafter directories: `config.json` + `model.safetensors`, the published DFlash layout.

Loading never unpickles (safetensors only) and checks every tensor's name, shape and
dtype against the config before building anything, so a truncated or mismatched file
gives one clear error instead of a half-loaded model. Other trainers' key layouts are
mapped first (`map_checkpoint_keys`: wrapper prefixes, fused q/k/v and gate/up, derived
rotary buffers); whatever is still not ours is named, every key of it.

Publication: `publish_checkpoint` / `AsyncPublisher` save the drafter through the torch-free
contract in `dflash_train.checkpoints.publication` (atomic directory, `COMPLETE.json` written last),
which also holds reading, verifying, listing, pins and retention.
"""
from __future__ import annotations

import copy
import json
import logging
import os
import queue
import re
import threading
from pathlib import Path
from types import SimpleNamespace

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from dflash_train.core.config import ConfigError, DrafterConfig
from dflash_train.core.model import DFlashDrafter

from . import storage
from .publication import (
    CONFIG_NAME,
    FILE_MODE,
    INDEX_NAME,
    WEIGHTS_NAME,
    CheckpointError,
    publish_directory,
    read_manifest,
    upload_checkpoint,
)

log = logging.getLogger(__name__)

# Prefixes other trainers put before the drafter's own names: SpecForge's training wrapper
# (`draft_model.`), HF-style `*ForCausalLM` wrappers (`model.`), DDP/FSDP/accelerate
# (`module.`), torch.compile (`_orig_mod.`), a wrapper holding it as `.drafter` (ours, HF).
KNOWN_PREFIXES = ("draft_model.", "model.", "module.", "_orig_mod.", "drafter.")
_OURS = re.compile(r"^(layers\.\d+\.|fc\.weight$|hidden_norm\.weight$|norm\.weight$"
                   r"|embed_tokens\.weight$|lm_head\.weight$)")
_VOCAB = re.compile(r"^(embed_tokens|lm_head)\.weight$")  # a drafter's own copies of the target's (DeepSpec)
_DERIVED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")  # recomputed from the config, never trained
_FUSED_QKV = re.compile(r"^(layers\.\d+\.self_attn\.)qkv_proj\.weight$")      # vLLM/SGLang-style stacked q, k, v
_FUSED_GATE_UP = re.compile(r"^(layers\.\d+\.mlp\.)gate_up_proj\.weight$")    # stacked gate, up (Phi-3, vLLM)


def _strip_prefixes(key: str) -> str:
    """`key` without the wrapper prefixes before one of our names; unchanged when it is not ours."""
    k = key
    while not _OURS.match(k):
        p = next((p for p in KNOWN_PREFIXES if k.startswith(p)), None)
        if p is None:
            return key
        k = k[len(p):]
    return k


def map_checkpoint_keys(tensors: dict[str, torch.Tensor], cfg: DrafterConfig,
                        where: str | Path = "checkpoint") -> tuple[dict[str, torch.Tensor], list[str]]:
    """Other trainers' key layouts in ours: (the tensors by our names, what was mapped).

    Wrapper prefixes (`KNOWN_PREFIXES`, nested too: `module.draft_model.`) are stripped
    from keys that are ours underneath; fused `qkv_proj` / `gate_up_proj` weights are split
    into q/k/v (rows: heads*head_dim, kv_heads*head_dim twice) and gate/up (halves); rotary
    `inv_freq` buffers are dropped. Anything else is left alone for the caller to name.
    """
    notes: list[str] = []
    derived = [k for k in tensors if _DERIVED.search(k)]
    out: dict[str, torch.Tensor] = {}
    origin: dict[str, str] = {}
    stripped = 0
    for key, t in tensors.items():
        if key in derived:
            continue
        name = _strip_prefixes(key)
        stripped += name != key
        if name in out:
            raise CheckpointError(f"{where}: tensors {origin[name]!r} and {key!r} both map to {name!r}")
        out[name], origin[name] = t, key
    if derived:
        notes.append(f"dropped {len(derived)} rotary inv_freq buffer(s) (recomputed from config.json)")
    if stripped:
        prefixes = sorted({origin[n][: len(origin[n]) - len(n)] for n in out if origin[n] != n})
        notes.append(f"stripped prefix(es) {prefixes} from {stripped} tensor(s)")
    for label, pattern, parts in (("qkv_proj", _FUSED_QKV, ("q_proj", "k_proj", "v_proj")),
                                  ("gate_up_proj", _FUSED_GATE_UP, ("gate_proj", "up_proj"))):
        fused = [k for k in out if pattern.match(k)]
        if not fused:
            continue
        try:  # read only when needed: a config this odd is refused by the drafter build that follows
            sizes = ((cfg.num_attention_heads * cfg.head_dim,) + (cfg.num_key_value_heads * cfg.head_dim,) * 2
                     if label == "qkv_proj" else (int(cfg.intermediate_size),) * 2)
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(
                f"{where}: config.json cannot size the fused {label} ({type(e).__name__}: {e})") from None
        for key in fused:
            t = out[key]
            if t.dim() != 2 or t.shape[0] != sum(sizes) or min(sizes) <= 0:
                raise CheckpointError(f"{where}: fused {origin[key]!r} has shape {tuple(t.shape)}; config.json "
                                      f"implies {sum(sizes)} rows ({' + '.join(map(str, sizes))} for "
                                      f"{'/'.join(parts)})")
            m = pattern.match(key)
            assert m is not None, key  # the fused keys are the pattern's matches
            base = m.group(1)
            for part, piece in zip(parts, torch.split(t, list(sizes), dim=0), strict=True):
                name = f"{base}{part}.weight"
                if name in out:
                    raise CheckpointError(f"{where}: both fused {origin[key]!r} and {origin[name]!r} are present")
                out[name], origin[name] = piece.contiguous(), origin[key]
            del out[key]
        notes.append(f"split fused {label} into {'/'.join(parts)} in {len(fused)} layer(s)")
    return out, notes


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
    return write_drafter(drafter.config, state if state is not None else drafter_state_dict(drafter), directory,
                         dtype=dtype)


def write_drafter(cfg: DrafterConfig, tensors: dict[str, torch.Tensor], directory: str | Path, *,
                  dtype: torch.dtype | None = None) -> Path:
    """Write config.json (`cfg`, its torch_dtype set to the tensors') and model.safetensors (`tensors`, in
    `dtype` if given) into `directory` (created if needed): `save_drafter` without the module."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if dtype is not None:
        tensors = {k: v.to(dtype) for k, v in tensors.items()}
    tensors = {k: v.cpu().contiguous() for k, v in tensors.items()}
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
            return _read_shards(directory, index)
    except SafetensorError as e:
        raise CheckpointError(f"{directory}: weights file is corrupt or truncated ({e})") from None
    except (OSError, KeyError, TypeError, AttributeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{directory}: cannot read weights ({e})") from None
    raise CheckpointError(f"{directory}: no {WEIGHTS_NAME} (or {INDEX_NAME}) found")


def _read_shards(directory: Path, index: Path) -> dict[str, torch.Tensor]:
    """The tensors of a sharded drafter, each from the shard its index names. A shard that lacks a
    tensor the index places in it, or holds one the index places elsewhere (or not at all), is
    refused: a tensor in two shards would otherwise be taken from whichever was read last."""
    weight_map = json.loads(index.read_text())["weight_map"]
    if not isinstance(weight_map, dict) or not all(isinstance(s, str) for s in weight_map.values()):
        raise CheckpointError(f"{index}: weight_map is not a mapping of tensor names to shard files")
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(set(weight_map.values())):
        if os.sep in shard or shard.startswith(".."):
            raise CheckpointError(f"{index}: shard name {shard!r} escapes the directory")
        held = load_file(str(directory / shard))
        named = {k for k, s in weight_map.items() if s == shard}
        absent, stray = sorted(named - set(held)), sorted(set(held) - named)
        if absent:
            raise CheckpointError(f"{directory}: {INDEX_NAME} places {len(absent)} tensor(s) in {shard} that it "
                                  f"does not hold: {absent[:5]}{' ...' if len(absent) > 5 else ''}")
        if stray:
            raise CheckpointError(f"{directory}: {shard} holds {len(stray)} tensor(s) that {INDEX_NAME} does not "
                                  f"place in it: {stray[:5]}{' ...' if len(stray) > 5 else ''} (a tensor saved in two "
                                  "shards, or an index from another save); refusing to guess which copy is meant")
        tensors.update(held)
    return tensors


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
    return drafter_from_tensors(read_drafter_tensors(directory), cfg, directory, device=device, dtype=dtype)


def drafter_from_module(module: torch.nn.Module, config: DrafterConfig | dict | None = None, *,
                        device: str | torch.device = "cpu") -> DFlashDrafter:
    """Our `DFlashDrafter` with the weights (copied) of another trainer's drafter module, e.g.
    SpecForge's `DFlashDraftModel`: its `config` (a transformers config or a dict in the
    published `config.json` layout, unless `config` is given) read like a published one, its
    state dict mapped and checked as a checkpoint's would be. For publishing from a foreign
    training loop (the HF callback's `drafter_getter`)."""
    config = getattr(module, "config", None) if config is None else config
    if not isinstance(config, DrafterConfig):
        # a transformers config: what save_pretrained writes (config.json), not every default
        to_dict = getattr(config, "to_diff_dict", None) or getattr(config, "to_dict", None)
        raw = to_dict() if to_dict is not None else config
        if not isinstance(raw, dict):
            raise CheckpointError(f"{type(module).__name__} has no config to read the drafter's shape from; "
                                  "pass config= (a DrafterConfig, or a dict in the published config.json layout)")
        try:
            config = DrafterConfig.from_dict(json.loads(json.dumps(raw, default=str)))
        except ConfigError as e:
            raise CheckpointError(f"{type(module).__name__}.config: {e}") from None
    tensors = {k: v.detach() for k, v in module.state_dict().items()}
    return drafter_from_tensors(tensors, config, type(module).__name__, device=device)


def drafter_from_tensors(tensors: dict[str, torch.Tensor], cfg: DrafterConfig, where: str | Path = "checkpoint", *,
                         device: str | torch.device = "cpu", dtype: torch.dtype | None = None) -> DFlashDrafter:
    """A drafter built from `cfg` holding `tensors` (other layouts mapped), names, shapes and
    values checked first; `where` names the source in errors."""
    tensors, own_vocab = checked_tensors(tensors, cfg, where)
    drafter = DFlashDrafter(cfg)
    drafter.load_state_dict(tensors, strict=True)  # copies: the source's tensors stay its own
    stored = sorted({str(t.dtype).removeprefix("torch.") for t in tensors.values()})
    target_dtype = dtype or next(iter(tensors.values())).dtype
    drafter = drafter.to(device=device, dtype=target_dtype)
    drafter.stored_dtype = "+".join(stored)  # what the file holds, whatever it is computed in
    drafter.own_vocab = own_vocab  # checked against the target's by `check_own_vocab`, then dropped
    return drafter


def checked_tensors(tensors: dict[str, torch.Tensor], cfg: DrafterConfig, where: str | Path = "checkpoint"
                    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the drafter's tensors by our names, its own embedding / LM head copies): other layouts
    mapped, then names, shapes and values checked against `cfg` (no drafter is built: importing a
    training state writes these out without a second copy in memory)."""
    directory = where
    tensors, notes = map_checkpoint_keys(tensors, cfg, directory)
    tensors, own_vocab = split_own_vocab(tensors, cfg)
    if own_vocab:
        notes.append(f"kept {sorted(own_vocab)} aside: the target's own are used, checked equal before drafting")
    if notes:
        log.info("%s: other key layout mapped: %s", directory, "; ".join(notes))
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
        problems.append(f"{len(missing)} missing tensor(s) {missing[:5]}{' ...' if len(missing) > 5 else ''} "
                        "(never initialised at random)")
    if unexpected:  # named in full: the user has to map each of them (or learn the format is another)
        shown = unexpected[:40]
        problems.append(f"{len(unexpected)} unknown tensor(s) (not this drafter's layout once the prefixes "
                        f"{list(KNOWN_PREFIXES)} and fused qkv_proj/gate_up_proj are mapped): {shown}"
                        f"{f' and {len(unexpected) - 40} more' if len(unexpected) > 40 else ''}")
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
    return tensors, own_vocab


def split_own_vocab(tensors: dict[str, torch.Tensor], cfg: DrafterConfig
                    ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(the drafter's tensors, its own copies of the target's embedding / LM head).

    DeepSpec (and speculators) checkpoints ship frozen copies of the target's `embed_tokens`
    and `lm_head`. The drafter here always drafts with the target's own (as the engines do
    with a drafter that shares them); a copy is checked equal to the target's before drafting
    (`check_own_vocab`). Only a [vocab, hidden] tensor counts: anything else stays unknown."""
    shape = (cfg.vocab_size, cfg.hidden_size)
    vocab = {k: t for k, t in tensors.items() if _VOCAB.match(k) and tuple(t.shape) == shape}
    return {k: t for k, t in tensors.items() if k not in vocab}, vocab


def check_own_vocab(drafter: DFlashDrafter, target, where: str | Path = "checkpoint") -> list[str]:
    """Compare a drafter's own embedding / LM head copies with the target's; raise when they differ
    (the drafter was trained against another target), return what was checked. Drops the copies."""
    own, drafter.own_vocab = getattr(drafter, "own_vocab", None) or {}, {}
    checked = []
    for name, t in sorted(own.items()):
        theirs = (target.parts.embed_tokens if name.startswith("embed") else target.parts.lm_head).weight
        if tuple(theirs.shape) != tuple(t.shape) or not torch.equal(t.to(theirs.device, theirs.dtype), theirs):
            diff = ("shape " + str(tuple(theirs.shape))) if tuple(theirs.shape) != tuple(t.shape) else (
                f"max |difference| {float((t.to(theirs.device, torch.float32) - theirs.float()).abs().max()):.3g}")
            raise CheckpointError(f"{where}: the drafter's own {name} differs from the target's ({diff}): it was "
                                  "trained against another target (or another precision of it); the drafter "
                                  "drafts with the target's embedding and LM head, so its τ here would not be its own")
        checked.append(name)
    return checked


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
    thread). With `publish_to` (an object-store prefix), the same thread then uploads the
    checkpoint (`publication.upload_checkpoint`: files, then the marker) and `path` is its URL.
    At most `max_pending` snapshots wait; `submit` blocks beyond that. A failed
    publication is raised by the next `submit` or `wait`.
    """

    def __init__(self, checkpoint_root: str | Path, run_id: str, *, on_published=None,
                 dtype: torch.dtype | None = None, max_pending: int = 1, publish_to: str | None = None):
        self.checkpoint_root, self.run_id = Path(checkpoint_root), run_id
        # an object-store prefix: each checkpoint is uploaded there on this thread too, and announced by its URL
        self.store_run = storage.join(storage.check_url(publish_to), run_id) if publish_to else None
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

    def submit_upload(self, path: str | Path, step: int) -> None:
        """Upload (and then announce) a checkpoint published locally whose upload did not happen
        (a run resumed after a crash between the two)."""
        self._raise_error()
        with self._lock:
            self._pending += 1
            self._idle.clear()
        self._jobs.put((None, Path(path), int(step), {}))

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            holder, snapshot, step, metrics = job
            try:
                if holder is None:  # published locally before, its upload still owed
                    path = snapshot
                else:
                    path = publish_checkpoint(holder, self.checkpoint_root, self.run_id, step, state=snapshot,
                                              train_metrics=metrics, dtype=self.dtype)
                if self.store_run is not None:
                    path = upload_checkpoint(path, self.store_run)
                if self.on_published is not None:
                    self.on_published(step, path, read_manifest(path))
            except BaseException as e:  # noqa: BLE001 - kept for the training thread, raised there
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
