"""Results and queue at scale: the ledger's readers with 10,000 records, the queue with 100,000 jobs.

    python bench/scale_results.py [--records 10000] [--runs 50] [--jobs 100000] [--small 10]

Two sizes side by side in one process: the full size and 1/`small` of it (same runs, fewer
records / jobs per run), so each line prints the ratio of the two — ~`small`x is linear, more is
super-linear. Real parts: the ledger on disk (`Ledger.write`, what a worker's job completion
does, with the Redis index), a real redis-server on loopback (`LocalRedis`), `job_client.enqueue`
and `queue.status`, `results` rows, `report`, and the W&B sink's offline `publish` of one run
(wandb offline; it is timed at both sizes of that one run). Peak memory: tracemalloc's peak of
Python allocations during the call, in a second pass (tracemalloc slows the call down, so the
times come from the first pass). Redis memory per queued job: `used_memory` before and after.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import tracemalloc
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def show(line: tuple) -> None:
    """Print one table row as soon as it is measured (a long run keeps what it has)."""
    name, ns, nf, ts, ms, tf, mf = line

    def f(t):
        return f"{t * 1e3:.2f} ms" if t < 0.1 else f"{t:.2f} s"

    def m(x):
        return "-" if x is None else f"{x:.1f} MB"
    print(f"| {name} | {ns:,} | {f(ts)} | {m(ms)} | {nf:,} | {f(tf)} | {m(mf)} | {tf / ts:.1f}x |", flush=True)


def measure(fn, *, peak: bool = True, repeat: int = 2):
    dt = float("inf")
    for _ in range(repeat):  # the fastest: the first call may pay imports (matplotlib, jinja2)
        t0 = time.perf_counter()
        out = fn()
        dt = min(dt, time.perf_counter() - t0)
    mb = None
    if peak:
        tracemalloc.start()
        fn()
        mb = tracemalloc.get_traced_memory()[1] / 1e6
        tracemalloc.stop()
    return dt, mb, out


def _job(run: str, step: int, digest: str) -> dict:
    return {"schema": "dflash-eval-job/1", "run_id": run, "step": step, "checkpoint": f"/ckpt/{run}/step-{step:08d}",
            "checkpoint_digest": digest, "target": None, "suite": "builtin:coding-v1", "baseline": None,
            "wandb": None, "requested_by": "hook", "priority": "default", "attempt": 0,
            "train_metrics": {"loss": 1.0}, "options": None}


def fill_ledger(results: Path, conn, runs: list[str], per_run: int, first_step: int = 0) -> list[float]:
    """Write per_run records for every run as a worker would (record + index); per-write seconds."""
    from eval_worker.results.ledger import Ledger
    from eval_worker.service.jobs.schema import validate_job
    from tests.support.eval_results import make_result

    ledger = Ledger(results, connection=conn)
    times = []
    for i in range(first_step, first_step + per_run):
        for run in runs:
            step = 100 * (i + 1)
            result = make_result(run, step, seed=i)
            job = validate_job(_job(run, step, result["checkpoint"]["digest"]))  # as the worker holds it
            t0 = time.perf_counter()
            ledger.write(job=job, job_id=f"eval-{run}-{step}", result=result)
            times.append(time.perf_counter() - t0)
    return times


def ledger_part(args, tmp: Path, conn) -> None:
    from eval_worker.commands.results import rows
    from eval_worker.results.report import build_report
    from eval_worker.service.queueing.queue import status

    runs = [f"run-{i:02d}" for i in range(args.runs)]
    per_full = args.records // args.runs
    per_small = max(1, per_full // args.small)
    results = tmp / "results"
    # the small ledger first, then grow it to the full one: the completion path timed at both
    small_w = fill_ledger(results, conn, runs, per_small)
    measured = {}

    def readers(tag):
        measured[tag] = {
            "status (ledger part, all runs)": measure(lambda: status(conn)),
            "status --run (one run)": measure(lambda: status(conn, run=runs[0])),
            "results --run (one run)": measure(lambda: rows([runs[0]], results)),
            "results, every run": measure(lambda: rows(runs, results)),
            "report (one run)": measure(lambda: build_report(runs[0], results_dir=results, out_dir=tmp / f"rep-{tag}")),
        }

    readers("small")
    full_w = fill_ledger(results, conn, runs, per_full - per_small, first_step=per_small)
    readers("full")
    n_small, n_full = per_small * len(runs), per_full * len(runs)
    tail = sorted(full_w[-len(small_w):])
    show(("job completion: ledger write + index, per record (median)", n_small, n_full,
          sorted(small_w)[len(small_w) // 2], None, tail[len(tail) // 2], None))
    for name in measured["full"]:
        (ts, ms, _), (tf, mf, _) = measured["small"][name], measured["full"][name]
        show((name, n_small, n_full, ts, ms, tf, mf))
    if not args.no_publish:
        show(publish_part(tmp, results, runs[0], per_small, per_full))


def publish_part(tmp: Path, results: Path, run: str, per_small: int, per_full: int) -> tuple:
    """`publish` (offline rebuild) of one run: at its full size, and of a run of the small size."""
    import shutil

    from dflash_train.common.settings import Settings
    from eval_worker.results.sinks import registry

    os.environ.setdefault("WANDB_SILENT", "true")
    small_results = tmp / "results-small"
    src = results / run
    dst = small_results / run
    dst.mkdir(parents=True)
    for step_dir in sorted(src.iterdir())[:per_small]:
        shutil.copytree(step_dir, dst / step_dir.name)
    settings = Settings.from_env()
    wandb = registry.get("wandb")
    out = []
    for tag, root in (("small", small_results), ("full", results)):
        target = wandb.target({"project": "bench"}, settings, mode="offline", root=tmp / f"wandb-{tag}")
        t, m, _ = measure(lambda target=target, root=root: wandb.publish_run(run, target, results_dir=root,
                                                                             force=True),
                          peak=False, repeat=1)
        out += [t, None]
    return ("publish --run (one run, offline W&B rebuild)", per_small, per_full, *out)


def queue_part(args, conn) -> float:
    from eval_worker.service.queueing.client import enqueue
    from eval_worker.service.queueing.queue import QueueConfig, status

    config = QueueConfig(retry_max=0)
    runs = [f"run-{i:02d}" for i in range(args.runs)]
    n_small = args.jobs // args.small
    conn.flushdb()
    base_mem = int(conn.info("memory")["used_memory"])
    times = []

    def add(lo, hi):
        for i in range(lo, hi):
            run, step = runs[i % len(runs)], 100 * (i // len(runs) + 1)
            job = _job(run, step, f"{i:064x}")
            t0 = time.perf_counter()
            enqueue(conn, job, check=False, config=config, suite_fp="abcd1234")
            times.append(time.perf_counter() - t0)

    calls = {"status (text: 50 queued jobs listed)": lambda: status(conn, limit=50),
             "status --run (text)": lambda: status(conn, run=runs[0], limit=50),
             "status --json (every queued job)": lambda: status(conn)}
    add(0, n_small)
    small = {k: measure(f) for k, f in calls.items()}
    add(n_small, args.jobs)
    per_job = (int(conn.info("memory")["used_memory"]) - base_mem) / args.jobs
    full = {k: measure(f) for k, f in calls.items()}
    head, tail = sorted(times[:n_small]), sorted(times[-n_small:])
    show(("enqueue, per job (median of the first / last slice)", n_small, args.jobs,
          head[len(head) // 2], None, tail[len(tail) // 2], None))
    for k in calls:
        show((k, n_small, args.jobs, small[k][0], small[k][1], full[k][0], full[k][1]))
    return per_job


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--records", type=int, default=10_000)
    ap.add_argument("--runs", type=int, default=50)
    ap.add_argument("--jobs", type=int, default=100_000)
    ap.add_argument("--small", type=int, default=10, help="the smaller size is 1/small of the full one")
    ap.add_argument("--no-publish", action="store_true", help="skip the W&B publish (slow: wandb starts a service)")
    ap.add_argument("--skip-ledger", action="store_true")
    ap.add_argument("--skip-queue", action="store_true")
    args = ap.parse_args()
    import logging

    logging.disable(logging.WARNING)  # the sink's "checkpoint is gone" notes: the bench's checkpoints are not on disk

    # every module measured, imported now: the run takes a while and must measure one version of the code
    import eval_worker.commands.results  # noqa: F401
    import eval_worker.results.report  # noqa: F401
    import eval_worker.results.sinks.registry  # noqa: F401 - and the sinks it registers
    import eval_worker.service.queueing.queue  # noqa: F401
    from eval_worker.redis_client import connect
    from eval_worker.service.local_redis.server import LocalRedis

    print("| operation | small size | time | peak | full size | time | peak | time ratio |")
    print("|---|---|---|---|---|---|---|---|", flush=True)
    with tempfile.TemporaryDirectory() as tmp_s, LocalRedis(Path(tmp_s) / "redis") as redis:
        tmp = Path(tmp_s)
        os.environ["DFLASH_HOME"] = str(tmp / "home")
        conn = connect(redis.url)
        if not args.skip_ledger:
            ledger_part(args, tmp, conn)
        if not args.skip_queue:
            per_job = queue_part(args, conn)
            print(f"\nRedis memory per queued job: {per_job:,.0f} bytes ({args.jobs:,} jobs)")


if __name__ == "__main__":
    main()
