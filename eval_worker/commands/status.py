"""`dflash-eval status [--run RUN]`: queues, running jobs and workers, failures, latest/best τ."""
from __future__ import annotations

import argparse

from ._common import add_redis_args, connect_from_args, fail, print_json

HELP = "show queue depth, running jobs and workers, failures with reasons, latest and best τ per run"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run", default=None, help="only this training run")
    parser.add_argument("--json", action="store_true", help="machine-readable output")
    add_redis_args(parser)


def _tau(s) -> str:
    if not s or not isinstance(s.get("tau"), (int, float)):
        return "-"
    return f"{s['tau']:.3f} @ step {s['step']}"


def _spooled(j) -> str:
    if not j.get("spooled_result"):
        return ""
    return f" [result computed and kept in {j['spooled_result']}: only the ledger write is retried]"


def main(args: argparse.Namespace) -> int:
    from eval_worker.queue import status

    try:
        conn, url = connect_from_args(args)
    except Exception as e:  # noqa: BLE001
        return fail(str(e))
    st = status(conn, args.queue, run=args.run)
    if args.json:
        print_json({"redis": url, **st})
        return 0
    print(f"redis {url}")
    print("queues: " + ", ".join(f"{name}={n}" for name, n in st["queues"].items()))
    print(f"workers ({len(st['workers'])}):")
    for w in st["workers"]:
        print(f"  {w['name']}  {w['state']}  {w['host']}:{w['pid']}  job={w['current_job'] or '-'}  "
              f"ok={w['successful']} failed={w['failed']}")
    print(f"running ({len(st['running'])}):")
    for j in st["running"]:
        print(f"  {j['job_id']}  run={j['run_id']} step={j['step']}  on {j['worker']}  since {j['started_at']}")
    if st["scheduled"]:
        print(f"waiting to retry ({len(st['scheduled'])}):")
        for j in st["scheduled"]:
            print(f"  {j['job_id']}  run={j['run_id']} step={j['step']}{_spooled(j)}")
    print(f"failed ({len(st['failed'])}):")
    for j in st["failed"]:
        print(f"  {j['job_id']}  run={j['run_id']} step={j['step']}: {j['reason']}{_spooled(j)}")
    print("runs:")
    if not st["runs"]:
        print("  (no results recorded yet)")
    for run, r in sorted(st["runs"].items()):
        print(f"  {run}: {r['evaluated']} evaluated; latest τ {_tau(r['latest'])}; best τ {_tau(r['best'])}")
    return 0
