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
from eval_worker.service.jobs.request import EvalRequest

from .eval_on_checkpoint import EvalOnCheckpoint

log = logging.getLogger(__name__)


def eval_hook(config: TrainConfig, settings: Settings, redis_url: str | None, **hook_options):
    """The `EvalOnCheckpoint` hook the eval flags describe; `hook_options`: further or overriding
    EvalOnCheckpoint arguments (the demo's options, W&B group, train-end timeout)."""
    for spec in config.eval_suite:  # a typo would fail every eval of the run, found hours later
        note = check_suite_spec(spec, hf_datasets_dir=settings.hf_datasets_dir)
        if note:
            log.warning("--eval-suite %s", note)
    # the request's fields among `hook_options` (the demo's options, its W&B group) override the flags'
    asked = {k: hook_options.pop(k) for k in REQUEST_ARGS if k in hook_options}
    if "suite" in asked:
        asked["suites"] = asked.pop("suite")
    request = EvalRequest.from_train_config(config, **asked)
    kwargs = dict(every_n_steps=config.eval_every, redis_url=redis_url, settings=settings, request=request)
    return EvalOnCheckpoint(**{**kwargs, **hook_options})


REQUEST_ARGS = ("suite", "target", "baseline", "options", "wandb", "sinks", "mlflow", "priority")
