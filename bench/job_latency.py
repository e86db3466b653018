"""Eval job latency, enqueue -> result recorded, on a warm worker vs a cold one.

    python bench/job_latency.py [--target DIR] [--jobs 3] [--prompts 2] [--max-new-tokens 32]

- cold: the job is enqueued, then a fresh `dflash-eval worker --burst` process starts with
  an empty cache directory (imports, target load, references built, evaluation);
- warm: a worker that is already running, its target preloaded and its reference cache
  built by an earlier job, takes a job for a checkpoint it has not seen;
- warm, new suite: the same worker, but each job's suite is new to it (references and target
  features built in the job), isolating what the resident target alone saves.

Every job evaluates a different (random) drafter checkpoint on the same tiny target and
suite. Prints the latencies, their medians and the cold / warm ratio. Needs a local
redis-server (started here, in a temporary directory).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _wait(job, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = job.get_status(refresh=True).value
        if state in ("finished", "failed"):
            return state
        time.sleep(0.02)
    raise TimeoutError(f"job {job.id} not done after {timeout}s")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default=str(REPO / "dflash_train" / "assets" / "tiny_target"))
    ap.add_argument("--jobs", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()

    from eval_worker.redis_client import connect
    from eval_worker.service.jobs.builder import make_job
    from eval_worker.service.local_redis.server import LocalRedis
    from eval_worker.service.queueing.client import enqueue
    from eval_worker.service.queueing.queue import fetch_job
    from tests.support.sidecar_support import (
        WorkerProcess,
        publish_random,
        tiny_target_drafter_config,
        worker_env,
        write_suite,
    )

    target = Path(args.target)
    cfg, mask = tiny_target_drafter_config(target)
    with tempfile.TemporaryDirectory() as tmp_s, LocalRedis(Path(tmp_s) / "redis") as redis:
        tmp = Path(tmp_s)
        conn = connect(redis.url)
        root = tmp / "ckpts"
        root.mkdir()
        suite = write_suite(root / "suite.jsonl", n_prompts=args.prompts, max_new_tokens=args.max_new_tokens)
        seeds = iter(range(1, 10_000))

        def new_job(suite_path=None):
            ck = publish_random(root, "bench", next(seeds), target_config=cfg, mask_token_id=mask,
                                seed=next(seeds), block_size=16)
            return make_job(ck, suite=str(suite_path or suite), target=str(target))

        cold = []
        for i in range(args.jobs):
            env = worker_env(tmp / f"cold{i}", [root])
            out = enqueue(conn, new_job())
            t0 = time.perf_counter()
            proc = subprocess.run([sys.executable, "-m", "eval_worker", "worker", "--burst", "--redis-url", redis.url,
                                   "--target", str(target), "--no-scheduler", "--log-level", "WARNING"],
                                  cwd=REPO, env=env, capture_output=True, text=True, timeout=args.timeout)
            state = _wait(fetch_job(conn, out.job_id), 30)
            cold.append(time.perf_counter() - t0)
            assert state == "finished" and proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
            print(f"cold job {i + 1}: {cold[-1]:.2f} s", flush=True)

        worker = WorkerProcess(tmp, redis.url, [root], name="bench-warm", target=target)
        try:
            worker.wait_registered(conn, timeout=args.timeout)
            _wait(fetch_job(conn, enqueue(conn, new_job()).job_id), args.timeout)  # builds its reference cache
            warm = []
            for i in range(args.jobs):
                out = enqueue(conn, new_job())
                t0 = time.perf_counter()
                state = _wait(fetch_job(conn, out.job_id), args.timeout)
                warm.append(time.perf_counter() - t0)
                assert state == "finished"
                print(f"warm job {i + 1}: {warm[-1]:.2f} s", flush=True)
            fresh = []
            for i in range(args.jobs):
                other = write_suite(root / f"suite{i}.jsonl", n_prompts=args.prompts,
                                    max_new_tokens=args.max_new_tokens + 1 + i)  # a suite it has not seen
                out = enqueue(conn, new_job(other))
                t0 = time.perf_counter()
                state = _wait(fetch_job(conn, out.job_id), args.timeout)
                fresh.append(time.perf_counter() - t0)
                assert state == "finished"
                print(f"warm job, new suite {i + 1}: {fresh[-1]:.2f} s", flush=True)
        finally:
            worker.stop()
        conn.close()
    mc, mw, mf = statistics.median(cold), statistics.median(warm), statistics.median(fresh)
    print(f"\nenqueue -> result, median of {args.jobs} (target {target.name}, {args.prompts} prompts x "
          f"{args.max_new_tokens} tokens): cold worker {mc:.2f} s, warm worker {mw:.3f} s, "
          f"warm worker + new suite {mf:.2f} s; cold / warm = {mc / mw:.1f}x, cold / warm-new-suite = {mc / mf:.1f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "cold_s": cold, "warm_s": warm,
                                               "warm_new_suite_s": fresh, "ratio": mc / mw,
                                               "ratio_new_suite": mc / mf}, indent=2))


if __name__ == "__main__":
    main()
