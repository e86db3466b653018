"""What every sink shares: one writer per eval run, a complete publication from the ledger, and a
child process with a hard timeout so a hanging tracker client never stalls the worker.

A sink module exposes ``publish_run(run_id, target, *, results_dir, redis_url, force)`` (the whole
publication: lock, read the ledger under the lock, bring the tracker up to date) and a target
dataclass with ``to_json`` / ``from_json``; ``python -m eval_worker.results.sinks.base`` runs one
publication for the worker's child process.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import signal
import subprocess
import sys

from dflash_train.common.errors import DFlashError

# sink name -> (module, target class); wandb keeps its own child entry point (wandb_sink._main)
MODULES = {"tensorboard": ("eval_worker.results.sinks.tensorboard_sink", "TensorBoardTarget"),
           "mlflow": ("eval_worker.results.sinks.mlflow_sink", "MlflowTarget")}


class SinkError(DFlashError, RuntimeError):
    """A publication that did not happen; the ledger still holds the result."""

    retryable = True


def run_child(cmd: list[str], *, label: str, redis_url: str | None, timeout_s: float, stdin_extra: str = "") -> dict:
    """Run one publication command in its own process group; the Redis URL goes on stdin (it may
    hold a password; `stdin_extra` follows it), the last JSON line of stdout is the outcome. Killed
    whole on timeout."""
    # A process that ran W&B itself exports WANDB_SERVICE; a child inheriting it would publish
    # through that parent's service (its settings, its run ids) and outlive its own kill.
    env = {k: v for k, v in os.environ.items() if k != "WANDB_SERVICE"}
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=env)
    try:
        out, err = proc.communicate(input=(redis_url or "") + "\n" + stdin_extra, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise SinkError(f"{label} timed out after {timeout_s:.0f}s (killed)") from None
    if proc.returncode != 0:
        lines = err.strip().splitlines()
        reason = next((ln[len("error: "):] for ln in reversed(lines) if ln.startswith("error: ")), None)
        raise SinkError(f"{label} failed (exit {proc.returncode}): "
                        + (reason or " | ".join(lines[-3:]) or "no output"))
    lines = [ln for ln in out.splitlines() if ln.startswith("{")]
    return json.loads(lines[-1]) if lines else {}


def sink_module(name: str):
    module, cls = MODULES[name]
    mod = importlib.import_module(module)
    return mod, getattr(mod, cls)


def publish_in_child(sink: str, run_id: str, target, *, results_dir, redis_url: str | None = None,
                     timeout_s: float = 300.0) -> dict:
    # the target on stdin too: a tracking URI may carry credentials, and argv is visible to every user
    cmd = [sys.executable, "-m", "eval_worker.results.sinks.base", "--sink", sink, "--run", run_id,
           "--target", "-", "--results", str(results_dir)]
    return run_child(cmd, label=f"{sink} publication for {run_id!r}", redis_url=redis_url, timeout_s=timeout_s,
                     stdin_extra=json.dumps(target.to_json()) + "\n")


def _main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="internal: one publication to a sink (used by the worker)")
    p.add_argument("--sink", required=True, choices=sorted(MODULES))
    p.add_argument("--run", required=True)
    p.add_argument("--target", required=True, help="the sink's target as JSON ('-': the line after the Redis URL)")
    p.add_argument("--results", required=True)
    args = p.parse_args(argv)
    redis_url = sys.stdin.readline().strip() or None  # from the worker (not argv: it may hold a password)
    raw_target = sys.stdin.readline() if args.target == "-" else args.target
    try:
        mod, cls = sink_module(args.sink)
        info = mod.publish_run(args.run, cls.from_json(json.loads(raw_target)), results_dir=args.results,
                               redis_url=redis_url)
    except Exception as e:  # one line for the parent's log
        from dflash_train.common.redaction import redact_url

        print("error: " + redact_url(f"{type(e).__name__}: {e}").replace("\n", " "), file=sys.stderr)
        return 1
    print(json.dumps(info, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
