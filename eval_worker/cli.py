"""`dflash-eval`: one entry point, one small module per subcommand (eval_worker/commands/).

Each command module defines `HELP` (one line), `add_arguments(parser)` and
`main(args) -> int`, and imports heavy dependencies inside `main` so that `--help`
stays fast. The environment is read here, once (`args.settings`, dflash_train.common.settings),
and every command takes its defaults from it.
"""
from __future__ import annotations

import argparse
import importlib
import sys

from dflash_train.common.redaction import install_log_redaction, redacted_output
from dflash_train.common.settings import Settings

COMMANDS = {
    "run": "eval_worker.commands.run",  # evaluate one checkpoint, no queue
    "worker": "eval_worker.commands.worker",  # serve the queue
    "enqueue": "eval_worker.commands.enqueue",
    "import": "eval_worker.commands.import_drafter",  # record a drafter trained elsewhere
    "watch": "eval_worker.commands.watch",  # follow a training directory: import and queue each checkpoint
    "requeue": "eval_worker.commands.requeue",
    "status": "eval_worker.commands.status",
    "cancel": "eval_worker.commands.cancel",
    "dismiss": "eval_worker.commands.dismiss",  # remove failed jobs
    "publish": "eval_worker.commands.publish",  # rebuild the W&B eval run from the ledger
    "report": "eval_worker.commands.report",  # local HTML report
    "results": "eval_worker.commands.results",  # the ledger of runs as a table
    "suites": "eval_worker.commands.suites",  # list suites; load hf: benchmarks (fills the datasets cache)
    "demo": "eval_worker.commands.demo",  # the main job, end to end
    "redis": "eval_worker.commands.redis_cmd",  # the embedded redis-server: status, stop
    "dashboard": "eval_worker.commands.dashboard",  # rq-dashboard set up for our JSON jobs
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dflash-eval", description="Acceptance-length evaluation of DFlash drafters.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, module_name in COMMANDS.items():
        module = importlib.import_module(module_name)
        p = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(p)
        p.set_defaults(_main=module.main)
    return parser


def main(argv: list[str] | None = None, settings: Settings | None = None) -> int:
    # no secret of a URL (a store's `key:secret@`, a Redis password) in any output or log line
    install_log_redaction()
    with redacted_output():
        return _main(argv, settings)


def _main(argv: list[str] | None, settings: Settings | None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.settings = settings or Settings.from_env()
    except ValueError as e:  # a malformed variable (a bad store URL in DFLASH_CHECKPOINT_ROOTS, a non-number)
        print(f"error: environment: {e}", file=sys.stderr)
        return 2
    try:
        return int(args._main(args) or 0)
    except KeyboardInterrupt:
        return 130
    except Exception as e:
        if not type(e).__module__.startswith("redis."):
            raise
        # a server refusing writes (out of memory, MISCONF, ...) or gone: a sentence, not a traceback
        from eval_worker.redis_client import refusal_message, server_unavailable

        if not server_unavailable(e):
            raise
        print(f"error: {refusal_message(e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
