"""The eval hook that `dflash-train`'s `--eval-*` flags describe.

Registered as the `eval` plug-in of the trainer (entry point group `dflash_train.callbacks`, setup.cfg):
`dflash-train --eval-every N` loads it by name, so the trainer never imports `hooks` or `eval_worker`.
The demo builds its hook here too: one place turns a TrainConfig into an `EvalOnCheckpoint`.
"""
from __future__ import annotations

import logging

from dflash_train.common.settings import Settings
from dflash_train.training.train_config import TrainConfig
from eval_worker.engine.suite import check_suite_spec

from .eval_on_checkpoint import EvalOnCheckpoint

log = logging.getLogger(__name__)


def eval_hook(config: TrainConfig, settings: Settings, redis_url: str | None, **hook_options):
    """The `EvalOnCheckpoint` hook the eval flags describe; `hook_options`: further or overriding
    EvalOnCheckpoint arguments (the demo's options, W&B group, train-end timeout)."""
    for spec in config.eval_suite:  # a typo would fail every eval of the run, found hours later
        note = check_suite_spec(spec, hf_datasets_dir=settings.hf_datasets_dir)
        if note:
            log.warning("--eval-suite %s", note)
    options = {k: v for k, v in (("num_prompts", config.eval_num_prompts),
                                 ("max_new_tokens", config.eval_max_new_tokens)) if v is not None}
    if options or "options" in hook_options:
        hook_options = {**hook_options, "options": {**options, **(hook_options.get("options") or {})}}
    wandb = None
    if config.wandb:  # the eval run lands next to the training run: same project and entity
        wandb = {"project": config.wandb_project, "entity": config.wandb_entity, "mode": config.wandb_mode}
    kwargs = dict(every_n_steps=config.eval_every, suite=list(config.eval_suite), target=config.eval_target,
                  baseline=config.eval_baseline, wandb=wandb, redis_url=redis_url, settings=settings)
    return EvalOnCheckpoint(**{**kwargs, **hook_options})
