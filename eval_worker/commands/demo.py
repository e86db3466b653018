"""`dflash-eval demo`: the whole pipeline on this machine, end to end.

Starts a private Redis and an eval worker process, trains a drafter on the bundled tiny
target with the trainer's demo config and the `EvalOnCheckpoint` hook (an eval every N
steps), waits for the evaluations, publishes the W&B eval run (offline by default),
writes the HTML report, prints step -> τ (95% CI) and where everything is, and stops
everything it started, also on errors and Ctrl-C.
"""
from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from collections.abc import Callable
from datetime import UTC
from pathlib import Path
from typing import Any

HELP = "run the end-to-end demo: Redis + worker + training with evals + W&B (offline) + HTML report"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workdir", default="demo-output", help="where checkpoints, results, W&B files and the report go "
                                                            "(default: ./demo-output)")
    p.add_argument("--config", default="demo", help="trainer config: a YAML file or a bundled name (default: demo)")
    p.add_argument("--max-steps", type=int, help="override the config's training steps")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override any trainer config field, e.g. --set num_prompts=64 (repeatable)")
    p.add_argument("--eval-every", type=int, help="evaluate every N steps (default: the config's publish_every)")
    p.add_argument("--suite", default="builtin:coding-v1", help="eval suite (default: %(default)s)")
    p.add_argument("--max-new-tokens", type=int, help="eval generation length (default: the engine's)")
    p.add_argument("--run-id", help="training run id (default: demo-<UTC time>)")
    p.add_argument("--redis-url", help="use this Redis instead of starting a private one")
    p.add_argument("--wandb-mode", choices=("offline", "online", "disabled"), default=None,
                   help="W&B mode for the eval run (default: $WANDB_MODE, else offline)")
    p.add_argument("--wandb-project", default=None, help="W&B project (default: $WANDB_PROJECT, else dflash-eval)")
    p.add_argument("--sink", default="wandb", help="comma-separated result sinks: wandb, tensorboard, mlflow "
                                                "(default: wandb); TensorBoard and MLflow files go in the workdir")
    p.add_argument("--eval-timeout", type=float, default=900, help="seconds to wait for the evaluations after training")


def _threads() -> tuple[int, int]:
    """(trainer, worker) CPU threads: split the cores so training and evaluation run side by side."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 2)
    trainer = max(1, cores // 2)
    return trainer, max(1, cores - trainer)


def _wait_for_jobs(conn, job_ids: list[str], stack, timeout_s: float,
                   check: Callable[[], None] = lambda: None) -> dict[str, str]:
    from eval_worker.service.queueing.queue import fetch_job

    deadline = time.monotonic() + timeout_s
    status: dict[str, str] = {}
    while True:
        for jid in job_ids:
            if status.get(jid) not in ("finished", "failed", "stopped", "canceled"):
                status[jid] = str(fetch_job(conn, jid).get_status(refresh=True).value)
        if all(s in ("finished", "failed", "stopped", "canceled") for s in status.values()):
            return status
        stack.check_workers()
        check()
        if time.monotonic() > deadline:
            waiting = [j for j, s in status.items() if s not in ("finished", "failed")]
            raise TimeoutError(f"{len(waiting)} evaluation(s) still not done after {timeout_s:.0f}s: {waiting}")
        time.sleep(1.0)


def _print_table(rows) -> None:
    print("\n  step |   τ (macro) | 95% CI           | τ pooled | tree τ | est. speedup")
    print("  -----+-------------+------------------+----------+--------+-------------")
    for r in rows:
        t = r.result["tau"]
        ci = t.get("ci95") or [float("nan")] * 2
        tree = (r.result.get("tree") or {}).get("tau")
        sp = (r.result.get("speedup") or {}).get("estimated")
        print(f"  {r.step:>4} | {t['macro']:>11.3f} | [{ci[0]:6.3f}, {ci[1]:6.3f}] | "
              f"{t.get('pooled', float('nan')):>8.3f}"
              f" | {tree if tree is None else f'{tree:6.3f}':>6} | {'' if sp is None else f'{sp:.2f}x':>11}")
    budget = next(((r.result.get("tree") or {}).get("budget") for r in rows if r.result.get("tree")), None)
    if budget:  # a tree of N nodes accepts at most N + 1 tokens a step, a chain up to the block size
        print(f"  (tree τ: best-first tree of {budget} drafted nodes, so at most {budget + 1} tokens per step)")


class Interrupts:
    """Ctrl-C and SIGTERM: unwind and clean up.

    The handler raises KeyboardInterrupt wherever the main thread is, which can be inside a
    finalizer (`__del__` during garbage collection) where Python prints and swallows it. So the
    signal is also recorded, and `check()` re-raises it at every step of training (as a trainer
    callback) and of the wait for evaluations: a swallowed Ctrl-C still stops the demo.
    """

    def __init__(self) -> None:
        self.signals: list[int] = []

    def __bool__(self) -> bool:
        return bool(self.signals)

    def handle(self, signum, frame) -> None:
        self.signals.append(signum)
        raise KeyboardInterrupt

    def install(self) -> None:
        signal.signal(signal.SIGINT, self.handle)
        signal.signal(signal.SIGTERM, self.handle)

    def check(self) -> None:
        if self.signals:
            raise KeyboardInterrupt

    def on_step_end(self, trainer, step: int, metrics: dict) -> None:  # a trainer callback (BaseException passes)
        self.check()


def main(args: argparse.Namespace) -> int:
    interrupted = Interrupts()
    interrupted.install()
    t0 = time.monotonic()
    import logging

    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(name)s %(levelname)s %(message)s",
                        datefmt="%H:%M:%S")
    from dflash_train.common.progress import limit_repeated_warnings

    limit_repeated_warnings()
    for name in ("dflash_train", "hooks.eval_on_checkpoint"):  # training progress and the hook's enqueue lines
        logging.getLogger(name).setLevel(logging.INFO)
    # the progress module's lines stay at WARNING, as before it was named under dflash_train
    logging.getLogger("dflash_train.common.progress").setLevel(logging.WARNING)
    from eval_worker.service.local_redis.demo_stack import DemoStack, tail

    work = Path(args.workdir).resolve()
    paths = {k: work / k for k in ("runs", "results", "wandb", "tensorboard", "mlflow", "report", "cache", "logs")}
    for p in paths.values():
        p.mkdir(parents=True, exist_ok=True)
    mode = args.wandb_mode or args.settings.wandb_mode or "offline"  # passed to the trainer, the worker, the sink
    stack = DemoStack(work, redis_url=args.redis_url)
    try:
        code = _run(args, stack, paths, mode, t0, interrupted)
        interrupted.check()  # a Ctrl-C swallowed after the last check still counts
        return code
    except KeyboardInterrupt:
        print("\ninterrupted: stopping the worker and Redis the demo started", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - one clear line, then cleanup
        if interrupted:  # library code turned our KeyboardInterrupt into another error
            print("\ninterrupted: stopping the worker and Redis the demo started", file=sys.stderr)
            return 130
        print(f"dflash-eval demo: {type(e).__name__}: {e}", file=sys.stderr)
        for w in stack.workers:
            print(f"--- {w.log_path} (last lines) ---\n{tail(w.log_path)}", file=sys.stderr)  # type: ignore[attr-defined]
        return 1
    finally:
        # Cleanup is bounded (worker grace, then SIGKILL); a second Ctrl-C must not cut it short.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        stack.close()


def _run(args, stack, paths: dict[str, Path], mode: str, t0: float, interrupted: Interrupts) -> int:
    from datetime import datetime

    from dflash_train.common.redaction import redact_url
    from dflash_train.common.settings import KNOWN_SINKS, parse_sinks
    from dflash_train.training.train_config import load_config
    from dflash_train.training.trainer import resolve_target_path, train
    from eval_worker.redis_client import connect
    from eval_worker.results import latest_demo
    from eval_worker.results.report import build_report
    from eval_worker.results.run_results import load_run
    from eval_worker.results.sinks import registry
    from hooks.eval_flags import eval_hook  # commands are the top layer: the demo composes trainer, hook, worker

    sinks, unknown = parse_sinks(args.sink)
    if unknown:
        raise ValueError(f"--sink: unknown sink(s) {list(unknown)}; known: {', '.join(KNOWN_SINKS)}")
    mlflow_uri = f"sqlite:///{paths['mlflow'] / 'mlflow.db'}"
    run_id = args.run_id or datetime.now(UTC).strftime("demo-%Y%m%d-%H%M%S")
    # `results`, `report` and `status` find this demo's ledger and report without flags
    pointer: dict[str, Any] = dict(run_id=run_id, workdir=paths["runs"].parent, results=paths["results"],
                   report=paths["report"] / run_id / "report.html")
    latest_demo.record(args.settings, **pointer, state="running")
    trainer_threads, worker_threads = _threads()
    overrides = {}
    for item in args.set:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"--set expects KEY=VALUE, got {item!r}")
        overrides[key.strip()] = value.strip()
    config = load_config(args.config,
                         {**overrides, "checkpoint_root": str(paths["runs"]), "run_id": run_id, "resume": "never",
                                       "max_steps": args.max_steps, "num_threads": trainer_threads,
                                       "data_cache_dir": str(paths["cache"] / "train-data"), "wandb_mode": mode})
    every = args.eval_every or config.publish_every
    if every % config.publish_every:
        config = config.replace(publish_every=every)  # an eval needs a checkpoint published at that step
    target_dir = resolve_target_path(config.target).resolve()
    if not (target_dir / "config.json").is_file():
        raise FileNotFoundError(f"target {target_dir} not found (the bundled tiny target is built by "
                                f"`python -m tools.build_tiny_target` in a checkout)")

    url = stack.start_redis()
    print(f"[demo] redis {redact_url(url)}; workdir {paths['runs'].parent}", flush=True)
    worker_env = {"OMP_NUM_THREADS": str(worker_threads), "MKL_NUM_THREADS": str(worker_threads),
                  "DFLASH_WANDB_DIR": str(paths["wandb"]), "WANDB_MODE": mode, "TOKENIZERS_PARALLELISM": "false",
                  "DFLASH_SINKS": ",".join(sinks) or "none", "DFLASH_TENSORBOARD_DIR": str(paths["tensorboard"]),
                  "DFLASH_MLFLOW_TRACKING_URI": mlflow_uri}
    stack.start_worker("demo-worker", target=target_dir, checkpoint_root=paths["runs"], results=paths["results"],
                       cache=worker_cache_dir(args.settings), env=worker_env)
    settings = args.settings
    wandb_cfg = {"project": args.wandb_project or settings.wandb_project or "dflash-eval", "group": run_id,
                 "entity": settings.wandb_entity, "mode": mode}
    options = {"max_new_tokens": args.max_new_tokens} if args.max_new_tokens else None
    config = config.replace(eval_every=every, eval_suite=[args.suite], eval_target=str(target_dir))
    hook = eval_hook(config, settings, url, wandb=wandb_cfg, options=options, train_end_timeout=60)
    print(f"[demo] training {run_id}: {config.max_steps} steps on {config.target}, eval every {every} steps "
          f"(trainer {trainer_threads} thread(s), worker {worker_threads})", flush=True)
    t_train = time.monotonic()
    train(config, callbacks=[hook, interrupted])
    interrupted.check()
    print(f"[demo] training done in {time.monotonic() - t_train:.0f}s; waiting for the evaluations", flush=True)
    stack.check_workers()
    job_ids = [o.job_id for o in hook.outcomes]
    if hook.errors:
        print("[demo] hook: " + "; ".join(hook.errors), file=sys.stderr)
    if not job_ids:
        raise RuntimeError("no evaluation was enqueued: " + ("; ".join(hook.errors) or "no checkpoint published"))
    conn = connect(url)
    try:
        status = _wait_for_jobs(conn, job_ids, stack, args.eval_timeout, interrupted.check)
    finally:
        conn.close()
    stack.stop_workers()  # the worker's sink has published after each result; stop before the final pass

    info = {}
    if "wandb" in sinks:
        wb = registry.get("wandb")
        info = wb.publish_run(run_id, wb.target(wandb_cfg, settings, mode=mode, root=paths["wandb"]),
                              results_dir=paths["results"], redis_url=url)
    extra = _publish_others(run_id, sinks, paths, mlflow_uri, settings, url)
    report = build_report(run_id, results_dir=paths["results"], out_dir=paths["report"] / run_id)
    rows = [r for r in load_run(run_id, paths["results"])]
    _print_table(rows)
    failed = [j for j, s in status.items() if s != "finished"]
    collapsed = _collapsed(rows)
    if collapsed:
        print(f"\n  ERROR: {collapsed}", file=sys.stderr)
    print(f"\n  evaluations: {len(job_ids) - len(failed)} finished, {len(failed)} failed"
          + (f" ({', '.join(failed)}; see `dflash-eval status`)" if failed else ""))
    print(f"  report:      {report}")
    if info.get("mode") == "offline":
        print(f"  W&B offline: {info['run_dir']}")
        print(f"  to upload:   {info['sync']}")
    elif info.get("mode") == "online":
        print(f"  W&B online:  project {wandb_cfg['project']}, run {info['eval_run_id']}")
    for line in extra:
        print(line)
    print(f"  ledger:      {paths['results'] / run_id}")
    print(f"  total time:  {time.monotonic() - t0:.0f}s")
    ok = not failed and not collapsed
    latest_demo.record(args.settings, **pointer, state="finished" if ok else "failed")
    print("  (`dflash-eval results`, `dflash-eval report` and `dflash-eval status` find this demo without flags)")
    return 0 if ok else 1


def _publish_others(run_id: str, sinks, paths: dict[str, Path], mlflow_uri: str, settings, url: str) -> list[str]:
    """The final pass for TensorBoard and MLflow (the worker published after each result; this
    makes sure every ledger record is there) and where to look."""
    from eval_worker.results.sinks import registry

    lines = []
    if "tensorboard" in sinks:
        tb_sink = registry.get("tensorboard")
        tb = tb_sink.publish_run(run_id, tb_sink.target(None, settings, root=paths["tensorboard"]),
                                 results_dir=paths["results"], redis_url=url)
        lines.append(f"  TensorBoard: {tb['view']}")
    if "mlflow" in sinks:
        ml_sink = registry.get("mlflow")
        ml = ml_sink.publish_run(run_id, ml_sink.target(None, settings, tracking_uri=mlflow_uri),
                                 results_dir=paths["results"], redis_url=url)
        lines.append(f"  MLflow:      run {ml['mlflow_run_id']}; mlflow ui --backend-store-uri {mlflow_uri}")
    return lines


def _collapsed(rows) -> str | None:
    """A loud line when most references of an evaluation are degenerate: τ would then say that a
    drafter learns to repeat the target's collapse, not how well it drafts."""
    from eval_worker.engine.diagnostics import mostly_degenerate

    for r in rows:
        prompts = r.result.get("prompts") or []
        bad = mostly_degenerate(prompts)
        if bad:
            return (f"{len(bad)} of {len(prompts)} references at step {r.step} are degenerate (the target repeats "
                    f"a line or a few tokens: {', '.join(bad[:5])}); τ measures repetition, not drafting. "
                    "Check the target and the prompt format (see DEGENERATE_REFERENCE in the report)")
    return None


def worker_cache_dir(settings) -> Path:
    """The demo worker's reference/feature cache: the one of this DFLASH_HOME (`settings.cache_dir`), which
    `run` and every worker read by default, so references the demo computed serve them, and theirs the demo."""
    return Path(settings.cache_dir)
