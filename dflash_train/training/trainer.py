"""The drafter trainer: multi-anchor block training on the target's own greedy labels.

One step (the DFlash training recipe): the frozen target runs on a batch (in the hidden-state queue's
producer) giving context features and, from the same forward, its greedy tokens; anchors
are sampled among response positions; the drafter drafts every block at once through the
shared multi-block mask; the target's frozen LM head turns drafter states into logits;
the loss is the decay-weighted CE of slot k against the target's token at anchor + k.
Only drafter parameters train. Rank 0 publishes checkpoints and calls the callbacks.

Python API: `train(config, callbacks=[...]) -> TrainSummary`, or `Trainer(...).train()`.
"""
from __future__ import annotations

import contextlib
import functools
import logging
import math
import sys
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

import torch
from torch import nn

from dflash_train.checkpoints.checkpoint import load_drafter
from dflash_train.checkpoints.publication import list_checkpoints
from dflash_train.common.progress import Progress
from dflash_train.core.config import ConfigError, DrafterConfig
from dflash_train.core.masks import AttentionBackendError, choose_backend
from dflash_train.core.model import DFlashDrafter
from dflash_train.core.target import Target, TargetError

from . import distributed as dist_util
from .anchors import block_labels, sample_anchors
from .callbacks import CallbackList
from .checkpointer import Checkpointer
from .data import Batch, BatchPlan, Example, build_examples
from .hidden_queue import HiddenStateQueue, Slot
from .loss import block_loss, summarize_stats
from .metric_logger import MetricLogger
from .train_config import BUNDLED_TARGET, TrainConfig, TrainConfigError, load_config
from .train_state import latest_training_state, load_training_state, set_rng_state

log = logging.getLogger(__name__)
TINY_TARGET_DIR = Path(__file__).resolve().parents[1] / "assets" / "tiny_target"

__all__ = ["Trainer", "TrainConfig", "TrainSummary", "train", "load_config"]


@dataclass
class TrainSummary:
    run_id: str
    run_dir: str
    start_step: int
    step: int  # last completed step
    losses: list[float] = field(default_factory=list)  # one per step run here
    metrics: dict = field(default_factory=dict)  # last step's metrics
    checkpoints: list[str] = field(default_factory=list)  # published by this run
    state_path: str | None = None
    wall_s: float = 0.0
    cpu_s: float = 0.0  # process CPU time over the loop (all threads): ~ the wall time on an idle core
    tokens_per_s: float = 0.0  # target tokens (real, all ranks) per second of training loop
    queue_health: dict = field(default_factory=dict)
    world_size: int = 1  # ranks that trained (metrics are global: summed over them)


@dataclass
class SlotMeta:
    position: int
    length: int
    tokens: int  # real (unpadded) tokens in this rank's rows
    sample_ids: list[int]


class _BlockForward(nn.Module):
    """The drafter's multi-block forward as a `forward()`, so DDP sees it.

    The target embedding is held outside the module tree: it is frozen, shared, not a
    DDP parameter and never copied.
    """

    def __init__(self, drafter: DFlashDrafter, embed: nn.Module, backend: str):
        super().__init__()
        self.drafter = drafter
        self._embed = [embed]
        self.backend = backend

    def forward(self, ids, features, anchors, valid):
        return self.drafter.forward_blocks(self._embed[0], ids, features, anchors, valid, self.backend)


def lr_lambda(warmup: int, total: int, min_ratio: float):
    """Linear warmup to 1, then cosine down to `min_ratio`."""
    def fn(step: int) -> float:
        if warmup > 0 and step < warmup:
            return (step + 1) / warmup
        t = min(max(step - warmup, 0) / max(total - warmup, 1), 1.0)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * t))
    return fn


def _dtype(name: str | None) -> torch.dtype | None:
    if name is None:
        return None
    dt = getattr(torch, str(name).removeprefix("torch."), None)
    if not isinstance(dt, torch.dtype):
        raise TrainConfigError(f"unknown dtype {name!r}")
    return dt


def resolve_target_path(target: str) -> Path:
    if target == BUNDLED_TARGET:
        return TINY_TARGET_DIR
    return Path(target).expanduser()


class Trainer:
    def __init__(self, config: TrainConfig, callbacks=(), *, target: Target | None = None,
                 examples: list[Example] | None = None, dist_info: dist_util.DistInfo | None = None,
                 strict_callbacks: bool = False):
        """`target`/`examples` skip loading the target / building the data (tests, notebooks)."""
        self.config = c = config
        self.callbacks = CallbackList(callbacks, strict=strict_callbacks)
        self.dist = dist_info or dist_util.init_distributed(c.device)
        if c.num_threads:
            torch.set_num_threads(c.num_threads)
        self.device = self.dist.device
        self.run_id = c.run_id or datetime.now(UTC).strftime("train-%Y%m%d-%H%M%S")
        self.run_id = dist_util.broadcast_object(self.run_id, self.dist)  # ranks may start a second apart
        self.run_dir = Path(c.checkpoint_root) / self.run_id
        self.state_dir = Path(c.state_dir) if c.state_dir else self.run_dir / "train_state"
        self.step = 0

        self.target = target or self._load_target()
        self.drafter = self._build_drafter().to(self.device)
        self.target.check_drafter(self.drafter.config)
        self.backend = self._attention_backend()
        self.block_size = self.drafter.config.block_size
        layer_ids = self.drafter.config.layer_ids  # for_target names them
        self.layer_ids = list(layer_ids)

        self.examples = examples if examples is not None else self._examples()
        pad = self.target.tokenizer.pad_token_id if self.target.tokenizer is not None else None
        self.plan = BatchPlan(self.examples, c.batch_size, seed=c.seed, rank=self.dist.rank,
                              world_size=self.dist.world_size, max_seq_len=c.max_seq_len,
                              pad_id=pad if pad is not None else 0, seq_multiple=c.seq_multiple)
        self.model: nn.Module = _BlockForward(self.drafter, self.target.parts.embed_tokens, self.backend)
        if self.dist.enabled:
            from torch.nn.parallel import DistributedDataParallel as DDP
            ids = [self.device.index] if self.device.type == "cuda" else None
            self.model = DDP(self.model, device_ids=ids)
        beta1, beta2 = c.adam_betas  # AdamW's two
        self.optimizer = torch.optim.AdamW(self.drafter.parameters(), lr=c.lr, weight_decay=c.weight_decay,
                                           betas=(beta1, beta2))
        warmup = int(round(c.warmup_ratio * c.max_steps))
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer,
                                                           lr_lambda(warmup, c.max_steps, c.min_lr_ratio))
        self.data_position = 0
        self.resumed_from: str | None = None
        self._maybe_resume()

    # --- setup ---------------------------------------------------------------------------
    def _load_target(self) -> Target:
        c = self.config
        path = resolve_target_path(c.target)
        dtype = c.target_dtype
        if dtype == "auto":
            dtype = "bfloat16" if self.device.type == "cuda" else "float32"
        return Target.load(path, dtype=dtype, device=str(self.device))

    def _build_drafter(self) -> DFlashDrafter:
        c = self.config
        if c.init_from:
            return load_drafter(c.init_from, dtype=torch.float32)
        mask_id = c.mask_token_id if c.mask_token_id is not None else self.target.mask_token_id()
        if mask_id is None:
            raise TargetError("the target's tokenizer has no <|MASK|> token; set mask_token_id")
        cfg = DrafterConfig.for_target(self.target.model.config, mask_token_id=mask_id,
                                       num_hidden_layers=c.drafter_layers, num_features=c.num_features,
                                       target_layer_ids=c.target_layer_ids, block_size=c.block_size,
                                       intermediate_size=c.drafter_intermediate_size)
        torch.manual_seed(c.seed)  # same initial weights on every rank (DDP also broadcasts)
        return DFlashDrafter(cfg).float()

    def _attention_backend(self) -> str:
        """flex or sdpa, decided once before any data or step (`masks.choose_backend`): an explicit flex
        that cannot run is a config error here, not a compile error at the first step."""
        try:
            backend, why = choose_backend(self.config.backend, self.drafter.config, self.device, backward=True,
                                          announce=False)
        except AttentionBackendError as e:
            raise TrainConfigError(str(e)) from e
        if why and self.dist.is_main:
            log.warning("attention: training with SDPA instead of flex_attention (%s)", why)
        return backend

    def _examples(self):
        c = self.config
        cache = Path(c.data_cache_dir) if c.data_cache_dir else self.run_dir / "cache"

        def build(progress=None):
            return build_examples(self.target, c.data, num_prompts=c.num_prompts, prompt_tokens=c.prompt_tokens,
                                  chat_template=c.chat_template, regenerate_responses=c.regenerate,
                                  max_new_tokens=c.max_new_tokens, cache_dir=cache,
                                  regen_batch_size=c.regen_batch_size, progress=progress)
        if self.dist.is_main:  # rank 0 regenerates (and shows how far it is); the others then read its cache
            with Progress("regenerating responses", unit="prompts", enabled=c.progress,
                          every_s=c.progress_every_s, logger=log) as bar:
                examples = build(bar.count_to)
        dist_util.barrier(self.dist)
        if not self.dist.is_main:
            examples = build()
        return examples

    def _maybe_resume(self) -> None:
        c = self.config
        path = None
        if c.resume not in ("auto", "never"):
            path = c.resume
        elif c.resume == "auto":
            found = latest_training_state(self.state_dir)
            path = str(found) if found else None
        path = dist_util.broadcast_object(path, self.dist)
        if path is None:
            if c.resume == "never" and list_checkpoints(self.run_dir):
                raise TrainConfigError(f"{self.run_dir} already has published checkpoints; "
                                       "use another run_id or resume=auto")
            return
        st = load_training_state(path)
        saved_cfg = (st.get("extra") or {}).get("drafter_config")
        try:  # compared as configs: the written layout may have gained fields since
            same = saved_cfg is None or DrafterConfig.from_dict(saved_cfg) == self.drafter.config
        except ConfigError:
            same = False
        if not same:
            raise TrainConfigError(f"{path}: saved for a different drafter config; cannot resume")
        self.drafter.load_state_dict({**self.drafter.state_dict(), **st["model"]})
        self.optimizer.load_state_dict(st["optimizer"])
        self.scheduler.load_state_dict(st["scheduler"])
        self.step, self.data_position = int(st["step"]), int(st["data_position"])
        set_rng_state(st["rng"])
        self.resumed_from = st["path"]
        if self.dist.is_main:
            log.info("resumed from %s at step %d", st["path"], self.step)

    # --- the hidden-state queue ---------------------------------------------------------------
    def _make_buffers(self) -> dict[str, torch.Tensor]:
        b, S, N = self.plan.local_batch, self.config.max_seq_len, self.config.num_anchors
        F = len(self.layer_ids) * self.target.hidden_size
        dev = self.device
        bufs = {
            "ids": torch.zeros(b, S, dtype=torch.long, device=dev),
            "loss_mask": torch.zeros(b, S, dtype=torch.bool, device=dev),
            "features": torch.zeros(b, S, F, dtype=self.target.dtype, device=dev),
            "pred": torch.zeros(b, S, dtype=torch.long, device=dev),
            "anchors": torch.zeros(b, N, dtype=torch.long, device=dev),
            "valid": torch.zeros(b, N, dtype=torch.bool, device=dev),
        }
        if dev.type == "cuda":  # pinned staging for non-blocking host->device copies
            for name in ("ids", "loss_mask", "anchors", "valid"):
                bufs[name + "_host"] = torch.zeros_like(bufs[name], device="cpu").pin_memory()
        return bufs

    def _fill(self, slot: Slot, batch: Batch) -> None:
        """Producer: target forward -> features (+noise) and greedy labels, into the slot."""
        c, buf = self.config, slot.buffers
        L = batch.ids.shape[1]
        anchors, valid = sample_anchors(batch.loss_mask, c.num_anchors, batch.row_seeds)
        sources = {"ids": (buf["ids"][:, :L], batch.ids), "loss_mask": (buf["loss_mask"][:, :L], batch.loss_mask),
                   "anchors": (buf["anchors"], anchors), "valid": (buf["valid"], valid)}
        for name, (dst, src) in sources.items():
            if name + "_host" in buf:
                stage = buf[name + "_host"][:, : src.shape[1]]
                stage.copy_(src)
                dst.copy_(stage, non_blocking=True)
            else:
                dst.copy_(src)
        ids = buf["ids"][:, :L]
        out = self.target.forward(ids, self.layer_ids)
        buf["pred"][:, :L].copy_(self.target.greedy_tokens(out.last_hidden))
        feats = out.features
        if c.noise_std > 0:  # context features only; last_hidden (labels) stays clean
            noise = torch.stack([torch.randn(feats.shape[1:],
                                             generator=torch.Generator(feats.device).manual_seed(s ^ 0x5EED),
                                             device=feats.device, dtype=torch.float32) for s in batch.row_seeds])
            feats = feats + (c.noise_std * noise).to(feats.dtype)
        buf["features"][:, :L].copy_(feats)
        slot.meta = SlotMeta(batch.position, L, int(batch.lengths.sum()), batch.sample_ids)

    # --- training ----------------------------------------------------------------------------
    def _autocast(self):
        mode = self.config.autocast
        if mode == "bf16" or (mode == "auto" and self.device.type == "cuda"):
            return torch.autocast(device_type=self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def train_step(self, slot: Slot, release) -> dict:
        c = self.config
        m: SlotMeta = slot.meta
        L = m.length
        ids, feats = slot["ids"][:, :L], slot["features"][:, :L]
        pred, lmask = slot["pred"][:, :L], slot["loss_mask"][:, :L]
        anchors, valid = slot["anchors"], slot["valid"]
        self.model.train()
        with self._autocast():
            hidden = self.model(ids, feats, anchors, valid)
            labels, label_mask = block_labels(pred, anchors, valid, lmask, self.block_size)
            out = block_loss(hidden, self.target.parts.lm_head, labels, label_mask, gamma=c.gamma,
                             loss_type=c.loss_type, dpace_alpha=c.dpace_alpha, chunk_size=c.ce_chunk,
                             reduce_stats=lambda t: dist_util.all_reduce_sum(t, self.dist),
                             loss_scale=float(self.dist.world_size))
        out.loss.backward()
        release()  # backward done: nothing reads the slot any more
        grad_norm = torch.nn.utils.clip_grad_norm_(self.drafter.parameters(),
                                                   c.grad_clip if c.grad_clip > 0 else float("inf"))
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        metrics = summarize_stats(out.stats, self.block_size)
        metrics.update(grad_norm=float(grad_norm), lr=self.scheduler.get_last_lr()[0])
        return metrics

    def close(self) -> None:
        """Drop the DDP wrapper before the process group goes. Its reducer holds the gloo group;
        freed last, it would destroy the group holding the GIL while gloo's worker thread waits
        for the GIL to free a finished work's tensors: a deadlock (or SIGABRT at exit) seen on a
        busy 2-core box. Call before `distributed.shutdown`; the trainer cannot train after."""
        if isinstance(self.model, torch.nn.parallel.DistributedDataParallel):
            self.model = self.model.module

    def train(self) -> TrainSummary:
        """The loop: take a prepared batch, step, then let the logger and the checkpointer act on
        their own cadences (rank 0 publishes and calls the callbacks)."""
        c, main = self.config, self.dist.is_main
        start_step = self.step
        checkpointer = Checkpointer(
            c, self.run_id, run_dir=self.run_dir, state_dir=self.state_dir, drafter=self.drafter,
            optimizer=self.optimizer, scheduler=self.scheduler, protects=self.callbacks.protects,
            on_published=functools.partial(self.callbacks.on_checkpoint_published, self),
            dtype=_dtype(c.checkpoint_dtype)) if main else None
        logger = MetricLogger(c, self.run_id, self.dist, start_step)
        todo = c.max_steps - self.step
        batches = self.plan.iterate(self.data_position, self.data_position + max(todo, 0))
        q = HiddenStateQueue(batches, self._make_buffers, self._fill, depth=c.queue_depth, device=self.device)
        metrics: dict = {}
        t_start, cpu_start = time.perf_counter(), time.process_time()
        try:
            while self.step < c.max_steps:
                slot = q.take()
                meta: SlotMeta = slot.meta
                metrics = self.train_step(slot, lambda slot=slot: q.release(slot))
                self.step += 1
                self.data_position = meta.position + 1
                logger.step(self.step, metrics, meta.tokens, q.health)
                if main:
                    self.callbacks.on_step_end(self, self.step, metrics)
                if checkpointer is not None:  # rank 0's
                    checkpointer.step(self.step, logger.window_means, self.data_position)
        finally:  # on errors too: the producer thread stops, the last publication is waited for
            failing = sys.exc_info()[0] is not None
            q.close()
            if failing:
                logger.close(failing=True)
            if checkpointer is not None:
                checkpointer.close(failing)  # raises if the last publication failed (and nothing else did)
        wall, cpu = time.perf_counter() - t_start, time.process_time() - cpu_start
        if checkpointer is not None:  # rank 0's
            checkpointer.announce()
            self.callbacks.on_train_end(self)
        logger.close(failing=False)
        return TrainSummary(self.run_id, str(self.run_dir), start_step, self.step, losses=logger.losses,
                            metrics=metrics, checkpoints=checkpointer.published if checkpointer is not None else [],
                            state_path=checkpointer.state_path if checkpointer is not None else None,
                            wall_s=wall, cpu_s=cpu,
                            tokens_per_s=logger.total_tokens() / max(wall, 1e-9), queue_health=q.health.as_dict(),
                            world_size=self.dist.world_size)


def train(config: TrainConfig, callbacks=(), **kwargs) -> TrainSummary:
    """Train a drafter per `config`; see `Trainer` for keyword arguments."""
    trainer = Trainer(config, callbacks, **kwargs)
    try:
        return trainer.train()
    finally:
        trainer.close()
        if kwargs.get("dist_info") is None:
            dist_util.shutdown(trainer.dist)
