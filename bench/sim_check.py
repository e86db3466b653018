"""The simulator (bench/sim_scale.py) against the real stack: 2 runs, 2 targets, 2 workers.

    python bench/sim_check.py [--checkpoints 12] [--cadence 2.0] [--cadence-b 2.6] [--eval 1.5] [--load 3.0]

Real: a redis-server, two `dflash-eval worker` processes, `enqueue` of published checkpoints
(valid markers and digests) at a fixed cadence per run, the ledger. Stand-in: the engine, whose
target load and evaluation are sleeps of `--load` and `--eval` seconds (what the simulator models:
the queueing, not the engine). Per policy: `fifo` (plain queue, each worker loads the target a job
names, `--max-targets 1`) and `routing` (`--route-by-target`; worker 1 serves target A, worker 2
target B). Measured the same way on both sides: target loads, and the eval lag in checkpoints
(newest queued minus newest evaluated) sampled every 0.25 s while the runs publish. The real
side's lag is read from Redis (`routing.eval_lag`, as `status` shows it).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))


class SleepyEvaluator:
    """Loads in $SIM_LOAD_S seconds, evaluates in $SIM_EVAL_S (the stand-in engine's result)."""

    def __init__(self, target, cache_dir=None, device=None):
        from tests.support.fake_evaluator import FakeEvaluator

        time.sleep(float(os.environ["SIM_LOAD_S"]))
        self.inner = FakeEvaluator(target)

    def evaluate(self, checkpoint_dir, suite, **kw):
        time.sleep(float(os.environ["SIM_EVAL_S"]))
        return self.inner.evaluate(checkpoint_dir, suite, **kw)


def real(policy: str, args, tmp: Path, redis_url: str) -> dict:
    from eval_worker.redis_client import connect
    from eval_worker.results.ledger import Ledger
    from eval_worker.service.jobs.builder import make_job
    from eval_worker.service.queueing import routing
    from eval_worker.service.queueing.client import enqueue
    from eval_worker.service.queueing.queue import QueueConfig, fetch_job
    from tests.support.eval_results import fake_checkpoint
    from tests.support.sidecar_support import WorkerProcess

    conn = connect(redis_url)
    conn.flushall()
    root, targets = tmp / policy / "ck", [tmp / "targets" / "qwen-a", tmp / "targets" / "qwen-b"]
    for t in targets:
        t.mkdir(parents=True, exist_ok=True)
    env = {"SIM_LOAD_S": str(args.load), "SIM_EVAL_S": str(args.eval)}
    common = ["--evaluator-factory", "sim_check:SleepyEvaluator", "--target-root", str(tmp / "targets"),
              "--no-preload", "--no-scheduler", "--max-targets", "1"]
    wtmp = tmp / policy
    wtmp.mkdir(parents=True, exist_ok=True)
    workers = []
    for i, t in enumerate(targets):
        extra = ["--serve-target", str(t)] if policy == "routing" else []
        workers.append(WorkerProcess(wtmp, redis_url, [root], name=f"sim-{policy}-{i}", target=t,
                                     args=common + extra,
                                     env={**env, "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'bench'}"}))
    for w in workers:
        w.wait_registered(conn)
    config = QueueConfig(route_by_target=policy == "routing", retry_max=0)
    runs = {"run-a": targets[0], "run-b": targets[1]}
    samples: list[int] = []
    stop = threading.Event()

    def sample():
        c = connect(redis_url)
        while not stop.wait(0.25):
            for run in runs:
                steps = [int(s["step"]) for s in Ledger(connection=c).indexed(run)]
                lag = routing.eval_lag(c, run, max(steps) if steps else 0)
                if lag and lag["lag_steps"] is not None:
                    samples.append(lag["lag_steps"] // 100)
    t0 = time.monotonic()
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    cad = {"run-a": args.cadence, "run-b": args.cadence_b or args.cadence}
    events = sorted((cad[r] * (i + 1) + (cad[r] / 2 if r == "run-b" else 0.0), r, i + 1)
                    for r in runs for i in range(args.checkpoints))
    ids = []
    for at, run, i in events:
        time.sleep(max(0.0, at - (time.monotonic() - t0)))
        ck, _ = fake_checkpoint(root, run, 100 * i)
        ids.append(enqueue(conn, make_job(ck, suite="builtin:coding-v1", target=str(runs[run])),
                           config=config).job_id)
    stop.set()
    sampler.join()
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline and len(Ledger(connection=conn).indexed()) < 2 * args.checkpoints:
        time.sleep(0.25)
    loads = 0
    for w in workers:
        w.stop()
        loads += w.log().count("loaded target")
    # what a job costs the real worker beyond the stand-in's sleeps (dequeue, checks, ledger write, RQ)
    busy = sum((j.ended_at - j.started_at).total_seconds() for j in map(lambda i: fetch_job(conn, i), ids))
    overhead = (busy - loads * args.load) / len(ids) - args.eval
    conn.close()
    return {"overhead": overhead, "loads": loads, "lag_p50": _pct(samples, 50), "lag_p95": _pct(samples, 95),
            "lag_max": max(samples)}


def simulated(policy: str, args, overhead: float = 0.0) -> dict:
    from sim_scale import simulate

    ev = args.eval + overhead
    targets = {"qwen-a": {"eval_s": ev, "load_s": args.load}, "qwen-b": {"eval_s": ev, "load_s": args.load}}
    runs = [dict(target="qwen-a", cadence=args.cadence, start=0.0, n_ckpt=args.checkpoints),
            dict(target="qwen-b", cadence=args.cadence_b or args.cadence, start=(args.cadence_b or args.cadence) / 2,
                 n_ckpt=args.checkpoints)]
    # the workers start idle, each with its own --target loaded lazily: as the simulator's empty workers
    out = [simulate(runs, targets, 2, policy, sample_s=0.25, seed=s, jitter=0.0) for s in range(1)]
    samples = out[0]["lag_samples_ckpts"]
    return {"loads": out[0]["loads"], "lag_p50": _pct(samples, 50), "lag_p95": _pct(samples, 95),
            "lag_max": max(samples)}


def _pct(xs, q):
    from sim_scale import pct

    return pct(xs, q)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--checkpoints", type=int, default=12, help="per run")
    ap.add_argument("--cadence", type=float, default=2.0, help="seconds between a run's checkpoints")
    ap.add_argument("--cadence-b", type=float, default=2.6, help="run B's (0: as run A's)")
    ap.add_argument("--eval", type=float, default=1.5, help="seconds per evaluation")
    ap.add_argument("--load", type=float, default=3.0, help="seconds per target load")
    args = ap.parse_args()
    from eval_worker.service.local_redis.server import LocalRedis

    print(f"2 runs x {args.checkpoints} checkpoints every {args.cadence} s / {args.cadence_b or args.cadence} s, 2 "
          f"targets, 2 workers; "
          f"eval {args.eval} s, load {args.load} s")
    print("| policy | side | target loads | lag p50 (ckpts) | lag p95 (ckpts) | lag max (ckpts) |")
    print("|---|---|---|---|---|---|", flush=True)
    with tempfile.TemporaryDirectory() as tmp_s, LocalRedis(Path(tmp_s) / "redis") as redis:
        for policy in ("fifo", "routing"):
            rows = [("simulated", simulated(policy, args))]
            m = real(policy, args, Path(tmp_s), redis.url)
            rows.append((f"real stack (+{m['overhead']:.2f} s per job beyond the sleeps)", m))
            rows.append(("simulated with that overhead", simulated(policy, args, m["overhead"])))
            for side, m in rows:
                print(f"| {policy} | {side} | {m['loads']} | {m['lag_p50']:.1f} | {m['lag_p95']:.1f} | "
                      f"{m['lag_max']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
