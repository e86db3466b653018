"""`dflash-train --config FILE [--option value ...]`: every TrainConfig field is a flag.

`--config` takes a YAML/JSON file or a bundled config name (`demo`, `long`). Flags win
over the environment (`WANDB_MODE`, dflash_train.settings), which wins over the file. Under `torchrun --nproc-per-node K -m dflash_train ...` each rank runs this.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys

from .settings import Settings
from .train_config import TrainConfig, TrainConfigError, field_types, load_config, unwrap_optional


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dflash-train", description="Train a DFlash drafter against a frozen target.")
    p.add_argument("--config", help="YAML/JSON config file, or a bundled config name (demo, long)")
    p.add_argument("--print-config", action="store_true", help="print the resolved config as JSON and exit")
    p.add_argument("--log-level", default="INFO")
    hints = field_types(TrainConfig)
    opts = p.add_argument_group("options (override the config file)")
    for f in dataclasses.fields(TrainConfig):
        flag = "--" + f.name.replace("_", "-")
        base = unwrap_optional(hints[f.name])
        if base is bool:
            opts.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=None)
        else:
            # values stay strings here; TrainConfig coerces them (lists: "1,2,3" or JSON)
            opts.add_argument(flag, dest=f.name, default=None, metavar=getattr(base, "__name__", "VALUE").upper())
    return p


def main(argv: list[str] | None = None, settings: Settings | None = None) -> int:
    args = build_parser().parse_args(argv)
    settings = settings or Settings.from_env()
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    names = {f.name for f in dataclasses.fields(TrainConfig)}
    env = {"wandb_mode": settings.wandb_mode}
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
        print(json.dumps(config.to_dict(), indent=2))
        return 0
    from .trainer import train

    summary = train(config)
    if summary.metrics is not None:
        logging.getLogger("dflash_train").info(
            "done: step %d, loss %.4f, acc %.3f, %.0f tok/s, %d checkpoints in %s", summary.step,
            summary.metrics.get("loss", float("nan")), summary.metrics.get("accuracy", float("nan")),
            summary.tokens_per_s, len(summary.checkpoints), summary.run_dir)
    return 0


if __name__ == "__main__":
    sys.exit(main())
