"""One publication in a child process with a hard timeout, for every sink.

A tracker client may hang or leave its own service process behind (W&B); a child killed on timeout with
its whole process group can neither stall nor leak into the worker. The parent runs
``python -m eval_worker.results.sinks.child --sink NAME --run RUN --results DIR`` and writes two lines
on its stdin, never on argv (visible to every user of the box): the Redis URL of the writer lock (it may
hold a password; empty: the file lock alone) and the sink's target as JSON (a tracking URI may carry
credentials). The child prints the publication's outcome as its last JSON line, or one ``error: ...``
line on stderr.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys

from eval_worker.results.sinks.base import Sink, SinkError


def publish_in_child(sink: Sink, run_id: str, target, *, results_dir, redis_url: str | None,
                     timeout_s: float) -> dict:
    cmd = [sys.executable, "-m", "eval_worker.results.sinks.child", "--sink", sink.name, "--run", run_id,
           "--results", str(results_dir)]
    return run_child(cmd, label=f"{sink.label} publication for {run_id!r}", timeout_s=timeout_s,
                     stdin=(redis_url or "") + "\n" + json.dumps(target.to_json()) + "\n")


def run_child(cmd: list[str], *, label: str, timeout_s: float, stdin: str) -> dict:
    """Run `cmd` in its own process group with `stdin`; the last JSON line of stdout is the outcome.
    Killed whole on timeout."""
    # A process that ran W&B itself exports WANDB_SERVICE; a child inheriting it would publish
    # through that parent's service (its settings, its run ids) and outlive its own kill.
    env = {k: v for k, v in os.environ.items() if k != "WANDB_SERVICE"}
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=env)
    try:
        out, err = proc.communicate(input=stdin, timeout=timeout_s)
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


def _main(argv: list[str] | None = None) -> int:
    from eval_worker.results.sinks.registry import get, names

    p = argparse.ArgumentParser(description="internal: one publication to a sink (used by the worker)")
    p.add_argument("--sink", required=True, choices=names())
    p.add_argument("--run", required=True)
    p.add_argument("--results", required=True)
    args = p.parse_args(argv)
    redis_url = sys.stdin.readline().strip() or None
    raw_target = sys.stdin.readline()
    try:
        sink = get(args.sink)
        info = sink.publish_run(args.run, sink.target_from_json(json.loads(raw_target)), results_dir=args.results,
                                redis_url=redis_url)
    except Exception as e:  # noqa: BLE001 - one line for the parent's log; the details stay in the tracker's logs
        from dflash_train.common.redaction import redact_url

        print("error: " + redact_url(f"{type(e).__name__}: {e}").replace("\n", " "), file=sys.stderr)
        return 1
    print(json.dumps(info, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
