"""`dflash-train --config FILE [--option value ...]`: every TrainConfig field is a flag.

`--config` takes a YAML/JSON file or a bundled config name (`demo`, `long`). Flags win
over the environment (`WANDB_MODE`, `DFLASH_PUBLISH_TO`, dflash_train.common.settings), which wins over the file. Every
flag's help text is the field's own (`train_config.opt`).

Evaluation is a flag away: `--eval-every N` attaches the `EvalOnCheckpoint` hook (the `eval` plug-in the
`hooks` package registers, callbacks.load_plugin), which
queues an acceptance eval of every Nth published checkpoint for the eval worker
(`--eval-suite`, `--eval-baseline`, `--eval-target`, `--redis-url`).

Under `torchrun --nproc-per-node K -m dflash_train ...` each rank runs this; rank 0 alone
shows progress, logs and prints the closing `done:` line, whose figures are the global ones
(loss and accuracy summed over ranks before they are divided; tokens/s of all ranks).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys

from dflash_train.common.settings import Settings

from .callbacks import load_plugin
from .train_config import TrainConfig, TrainConfigError, field_types, help_of, load_config, unwrap_optional

log = logging.getLogger(__name__)


def build_parser() -> argparse.ArgumentParser:
    # No ArgumentDefaultsHelpFormatter: the config flags default to None ("not given, keep the
    # file's value"), so it would append "(default: None)" after the built-in default each help states.
    p = argparse.ArgumentParser(prog="dflash-train", description="Train a DFlash drafter against a frozen target.")
    p.add_argument("--config", help="YAML/JSON config file, or a bundled config name (demo, long); "
                                    "without one, the built-in values shown below")
    p.add_argument("--print-config", action="store_true", help="print the resolved config as JSON and exit")
    p.add_argument("--log-level", default="INFO",
                   help="logging level of rank 0 (other ranks log warnings only; default: INFO)")
    p.add_argument("--redis-url", default=None,
                   help="Redis of the eval queue, with --eval-every (default $REDIS_URL, else a local redis-server "
                        "started on demand)")
    hints = field_types(TrainConfig)
    opts = p.add_argument_group("options (override the config file; default shown is the built-in one)")
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        base = unwrap_optional(hints[f.name])
        if f.default is not dataclasses.MISSING:
            default = f.default
        else:
            assert callable(f.default_factory), f.name  # train_config.opt gives each field a default or a factory
            default = f.default_factory()
        text = help_of(f)
        if "default" not in text:  # a field whose help explains its default (None: "the target's") keeps that
            text += f" (default: {_shown(default)})"
        if base is bool:
            opts.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None,
                              help=text.replace("%", "%%"))
        else:
            # values stay strings here; TrainConfig coerces them (lists: "1,2,3" or JSON)
            opts.add_argument(flag, dest=f.name, default=None, help=text.replace("%", "%%"),
                              metavar=getattr(base, "__name__", "VALUE").upper())
    return p


def _shown(value) -> str:
    if isinstance(value, list):
        return ",".join(map(str, value))
    return "none" if value is None else str(value)


def main(argv: list[str] | None = None, settings: Settings | None = None) -> int:
    from .distributed import is_rank0

    args = build_parser().parse_args(argv)
    settings = settings or Settings.from_env()
    main_rank = is_rank0()
    logging.basicConfig(level=args.log_level.upper() if main_rank else logging.WARNING,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from dflash_train.common.progress import limit_repeated_warnings

    limit_repeated_warnings()  # the eval hook with Redis down: one line per 30 s per message
    if not main_rank:  # transformers draws its own bars (loading weights) on every rank
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    env = {"wandb_mode": settings.wandb_mode, "publish_to": settings.publish_to}
    overrides = {**{k: v for k, v in env.items() if v is not None},
                 **{k: v for k, v in vars(args).items() if k in names and v is not None}}
    for k, v in overrides.items():
        if isinstance(v, str) and v.lower() in ("none", "null"):
            overrides[k] = None
    try:
        config = load_config(args.config, {k: v for k, v in overrides.items() if v is not None})
        config = config.replace(**{k: None for k, v in overrides.items() if v is None})
    except TrainConfigError as e:
        print(f"dflash-train: {e}", file=sys.stderr)
        return 2
    if args.print_config:
        if main_rank:
            print(json.dumps(config.to_dict(), indent=2))
        return 0
    if config.publish_to and main_rank:  # before the model loads: not one publication into the run
        from dflash_train.checkpoints import storage

        try:
            storage.preflight(config.publish_to)
        except (storage.StoreError, OSError) as e:
            print(f"dflash-train: --publish-to: {e}", file=sys.stderr)
            return 2
    from .trainer import train

    callbacks = []
    if config.eval_every:
        try:
            callbacks.append(load_plugin("eval")(config, settings, args.redis_url))
        except Exception as e:  # noqa: BLE001 - a baseline that cannot be imported, a bad suite: before training
            print(f"dflash-train: eval wiring: {e}", file=sys.stderr)
            return 2
    summary = train(config, callbacks=callbacks)
    if main_rank and summary.metrics is not None:
        m = summary.metrics
        log.info("done: step %d, loss %.4f, acc %.3f, streak %.2f (last step, all %d rank(s)), %.0f tok/s, "
                 "%d checkpoints in %s", summary.step, m.get("loss", float("nan")), m.get("accuracy", float("nan")),
                 m.get("streak", float("nan")), summary.world_size, summary.tokens_per_s, len(summary.checkpoints),
                 summary.run_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
