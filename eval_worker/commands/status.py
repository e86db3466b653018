"""`dflash-eval status [--run RUN]`: queues, running jobs and workers, failures, latest/best τ."""
from __future__ import annotations

import argparse

from ._common import add_redis_args, connect_from_args, fail, no_redis_to_read, print_json, printable

HELP = "show queue depth, running jobs and workers, failures with reasons, latest and best τ per run"


SHOWN = 50  # job ids listed per section in text; --json lists every one


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run", default=None, help="only this training run")
    parser.add_argument("--json", action="store_true",
                        help="machine-readable output: every queued, running, waiting and failed job with its id")
    add_redis_args(parser)


def _listed(title: str, jobs: list, line, total: int | None = None) -> None:
    total = len(jobs) if total is None else total  # queued jobs: only the first SHOWN per queue are loaded
    print(f"{title} ({total}):")
    for j in jobs[:SHOWN]:
        print("  " + line(j))
    if total > SHOWN:
        print(f"  ... and {total - SHOWN} more (`dflash-eval status --json` lists them all)")


def _tau(s) -> str:
    if not s or not isinstance(s.get("tau"), (int, float)):
        return "-"
    return f"{s['tau']:.3f} @ step {s['step']}"


def _spooled(j) -> str:
    if not j.get("spooled_result"):
        return ""
    return f" [result computed and kept in {j['spooled_result']}: only the ledger write is retried]"


def _lag(lag) -> str:
    """`; eval lag N steps (S s)`: the newest queued checkpoint vs the newest evaluated one."""
    if not lag or lag.get("lag_steps") is None:
        return ""
    secs = f" ({lag['lag_s']:.0f} s)" if isinstance(lag.get("lag_s"), (int, float)) else ""
    return f"; eval lag {lag['lag_steps']} steps{secs} (newest queued step {lag['newest_published_step']})"


def _routing_lines(st: dict) -> None:
    """Targets whose queued jobs no worker takes; checkpoints a thin backlog policy skipped."""
    for t in st.get("targets_without_worker") or []:
        print(f"target {t['target'] or t['target_key']}: {t['queued']} job(s) queued and no worker serves it "
              f"(start one with `dflash-eval worker --serve-target {t['target'] or 'DIR'}`)")
    if st.get("skipped"):
        from eval_worker.service.queueing.routing import requeue_command

        _listed("skipped by the backlog policy", st["skipped"],
                lambda j: f"{j['job_id']}  run={j['run_id']} step={j['step']}"
                          + (f" target={j['target']}" if j.get("target") else "") + f": {j['reason']}")
        groups: dict[tuple, list] = {}  # one command per run and target: it evaluates only those jobs again
        for j in st["skipped"]:
            groups.setdefault((j["run_id"], j.get("target")), []).append(j["step"])
        for (run, target), steps in groups.items():
            print(f"  (`{printable(requeue_command(run, steps, target))}` evaluates "
                  + ("it)" if len(steps) == 1 else "them)"))


def main(args: argparse.Namespace) -> int:
    from eval_worker.service.queueing.queue import status

    try:
        why = no_redis_to_read(args)
        if why is None:
            conn, url = connect_from_args(args, start=False)
    except Exception as e:  # noqa: BLE001
        return fail(str(e))
    if why is not None:  # a fresh home: start nothing to show an empty queue
        if args.json:
            from eval_worker.results import latest_demo

            print_json({"redis": None, "note": why, "latest_demo": latest_demo.read(args.settings)})
            return 0
        print(why)
        _latest_demo(args)
        return 0
    st = status(conn, args.queue, run=args.run, limit=None if args.json else SHOWN)
    if args.json:
        from eval_worker.results import latest_demo

        print_json({"redis": url, **st, "latest_demo": latest_demo.read(args.settings)})
        return 0
    print(f"redis {url}")
    print("queues: " + ", ".join(f"{name}={n}" for name, n in st["queues"].items()))
    print(f"workers ({len(st['workers'])}):")
    for w in st["workers"]:
        print(f"  {w['name']}  {w['state']}  {w['host']}:{w['pid']}  job={w['current_job'] or '-'}  "
              f"ok={w['successful']} failed={w['failed']}")
    _listed("queued", st["queued"], lambda j: f"{j['job_id']}  run={j['run_id']} step={j['step']}  on {j['origin']}  "
                                               f"since {j['enqueued_at']}", st["queued_total"])
    _listed("running", st["running"], lambda j: f"{j['job_id']}  run={j['run_id']} step={j['step']}  on {j['worker']}  "
                                                 f"since {j['started_at']}")
    if st["scheduled"]:
        _listed("waiting to retry", st["scheduled"],
                lambda j: f"{j['job_id']}  run={j['run_id']} step={j['step']}{_spooled(j)}")
    if st.get("owed"):
        _listed("owed by a trainer, not queued (its outbox could not be written)", st["owed"],
                lambda j: f"run={j['run_id']} step={j['step']}  {j['checkpoint']}: {j['why']}"
                          + ("  LOST: training ended; `dflash-eval enqueue CHECKPOINT` queues it" if j.get("lost")
                             else "  (retried by the trainer)"))
    _listed("failed", st["failed"], lambda j: f"{j['job_id']}  run={j['run_id']} step={j['step']}: {j['reason']}"
                                              f"{_spooled(j)}")
    if st["failed"]:
        print("  (`dflash-eval requeue --failed [--job ID]` runs them again; `dflash-eval dismiss ID...|--all` "
              "removes them)")
    _routing_lines(st)
    print("runs:")
    if not st["runs"]:
        print("  (no results recorded yet)")
    _latest_demo(args)
    for run, r in sorted(st["runs"].items()):
        suites = r.get("suites") or {}  # by series: suite, then options and target where they differ
        if len(suites) <= 1:
            print(f"  {printable(run)}: {r['evaluated']} evaluated; latest τ {_tau(r['latest'])}; best τ "
                  f"{_tau(r['best'])}{_lag(r.get('eval_lag'))}")
            continue
        n_suites = len({t["latest"].get("suite") for t in suites.values() if t.get("latest")})
        what = f"{len(suites)} series" if len(suites) != n_suites else f"{len(suites)} suites"
        print(f"  {printable(run)}: {r['evaluated']} evaluated on {what}{_lag(r.get('eval_lag'))}")
        for suite, t in sorted(suites.items()):
            print(f"    {printable(suite)}: {t['evaluated']} evaluated; latest τ {_tau(t['latest'])}; "
                  f"best τ {_tau(t['best'])}")
    return 0


def _latest_demo(args: argparse.Namespace) -> None:
    """The demo runs its own Redis (stopped when it ends): its results are found through its pointer.
    The pointer's state says whether it still runs (its Redis too) or ended."""
    import time

    from eval_worker.results import latest_demo
    from eval_worker.results.run_results import ResultsError, load_run

    demo = latest_demo.read(args.settings)
    if demo is None or (args.run and args.run != demo["run_id"]):
        return
    try:
        rows = load_run(demo["run_id"], demo["results"])
    except ResultsError:
        rows = []
    taus = [(r.result["tau"]["macro"], r.step) for r in rows if isinstance(r.result["tau"].get("macro"), (int, float))]
    when = time.strftime("%Y-%m-%d %H:%M", time.localtime(demo.get("at") or 0))
    line = f"latest demo ({demo.get('state')}, {when}): run {demo['run_id']}, {len(rows)} evaluated"
    if taus:
        line += f"; latest τ {taus[-1][0]:.3f} @ step {taus[-1][1]}; best τ {max(taus)[0]:.3f} @ step {max(taus)[1]}"
    print(line)
    redis = ("it runs on a Redis of its own, not this one, stopped when it ends" if demo.get("state") == "running"
             else "its Redis stopped with it")
    print(f"  ledger {demo['results']}, report {demo['report']} ({redis}; "
          "`dflash-eval results` / `report` read it without flags)")
