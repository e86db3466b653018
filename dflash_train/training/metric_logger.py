"""The trainer's metric logger: it owns what a step reports and when.

Told about every step (`step(n, metrics, tokens, queue_health)`, on every rank), it keeps
the losses and the recent window (whose averages go into each published manifest), and
every `log_every` steps, and at the last one, adds throughput (target tokens per second,
summed over ranks: a collective, so every rank takes part) and the hidden-state queue's
health to the step's metrics, then logs them on rank 0: the log line, W&B (`train/*`
against `train/step`); progress (a bar, or lines with the ETA off a terminal) on rank 0 only.
"""
from __future__ import annotations

import collections
import logging
import math
import time

import torch

from dflash_train.common.progress import Progress

from . import distributed as dist_util

log = logging.getLogger(__name__)


class MetricLogger:
    def __init__(self, config, run_id: str, dist: dist_util.DistInfo, start_step: int):
        self.config, self.run_id, self.dist = config, run_id, dist
        self.log_every = max(config.log_every, 1)
        self.losses: list[float] = []  # one per step run here
        self.recent: collections.deque = collections.deque(maxlen=self.log_every)
        self.tokens = 0  # this rank's real target tokens so far
        self._t_log, self._tokens_log = time.perf_counter(), 0
        main = dist.is_main
        self.wandb_run = self._init_wandb() if main and config.wandb else None
        # rank 0 alone: a bar on a terminal, lines with the ETA in a log (dflash_train.common.progress)
        self.bar = Progress(f"train {run_id}", config.max_steps, unit="steps", initial=start_step,
                            enabled=main and config.progress, every_s=config.progress_every_s, logger=log)

    def step(self, step: int, metrics: dict, tokens: int, queue_health) -> None:
        metrics["tokens"] = tokens  # this rank's real target tokens in the step
        self.tokens += tokens
        self.losses.append(metrics["loss"])
        self.recent.append(metrics)
        if step % self.log_every == 0 or step == self.config.max_steps:
            tok = dist_util.all_reduce_sum(torch.tensor([float(self.tokens - self._tokens_log)]), self.dist).item()
            now = time.perf_counter()
            metrics["tokens_per_s"] = tok / max(now - self._t_log, 1e-9)
            self._t_log, self._tokens_log = now, self.tokens
            metrics.update({f"queue/{k}": v for k, v in queue_health.as_dict().items()})
            if self.dist.is_main:
                self._log(step, metrics)
        # the metrics are the global ones: block_loss sums its stats over ranks before dividing
        self.bar.update(1, loss=f"{metrics['loss']:.3f}", acc=f"{metrics['accuracy']:.3f}",
                        streak=f"{metrics['streak']:.2f}")

    def window_means(self) -> dict:
        """Recent averages for a published manifest (the eval worker compares them with τ)."""
        def mean(key):
            vals = [m[key] for m in self.recent if not math.isnan(m[key])]
            return sum(vals) / len(vals) if vals else None
        return {"loss": mean("loss"), "accuracy": mean("accuracy"), "streak": mean("streak"),
                "window_steps": len(self.recent)}

    def total_tokens(self) -> float:
        """Real target tokens of all ranks (a collective)."""
        return dist_util.all_reduce_sum(torch.tensor([float(self.tokens)]), self.dist).item()

    def close(self, failing: bool) -> None:
        self.bar.close()
        if self.wandb_run is not None:
            self.wandb_run.finish(exit_code=1 if failing else 0)

    def _init_wandb(self):
        import wandb

        c = self.config
        run = wandb.init(project=c.wandb_project, entity=c.wandb_entity, group=self.run_id, name=self.run_id,
                         job_type="train", config=c.to_dict(), mode=c.wandb_mode)
        run.define_metric("train/step")
        run.define_metric("train/*", step_metric="train/step")
        return run

    def _log(self, step: int, metrics: dict) -> None:
        q = {k: v for k, v in metrics.items() if k.startswith("queue/")}
        slots = " ".join(f"{a:.2f}" for a in metrics["per_slot_accuracy"][:4])
        log.info("step %d loss %.4f acc %.3f (slots 1-4: %s) streak %.2f lr %.2e tok/s %.0f consumer_wait %.2f "
                 "producer_wait %.2f", step, metrics["loss"], metrics["accuracy"], slots, metrics["streak"],
                 metrics["lr"], metrics.get("tokens_per_s", 0.0), q.get("queue/consumer_wait_fraction", 0.0),
                 q.get("queue/producer_wait_fraction", 0.0))
        if self.wandb_run is not None:
            data = {"train/step": step, "train/loss": metrics["loss"], "train/acc": metrics["accuracy"],
                    "train/streak": metrics["streak"], "train/lr": metrics["lr"],
                    "train/grad_norm": metrics["grad_norm"],
                    "train/tokens_per_s": metrics.get("tokens_per_s", 0.0)}
            data.update({f"train/{k}": v for k, v in q.items()})
            data.update({f"train/slot_acc/{k}": a for k, a in enumerate(metrics["per_slot_accuracy"], 1)})
            self.wandb_run.log(data)
