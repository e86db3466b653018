"""Discrete-event simulation of the eval service: N runs x T targets x W workers.

Pure Python, seconds to run. Each run publishes a checkpoint every `cadence` seconds until its
train end (whose checkpoint is always evaluated); each worker holds `max_targets` targets (one,
as today), pays `load_s` to load another, and evaluates a checkpoint in `eval_s` of its target.
Workers may fail (exponential time between failures): the job they held goes back to the queue
after the heartbeat grace (as RQ's abandoned-job recovery does) and the worker returns empty
after `repair_s`.

Policies (what `dflash-eval` does under each):
- `fifo`: today. One queue, first in first out; any worker takes the head job and loads its target
  if it holds another.
- `routing`: a queue per target; each worker serves the targets it declares (`--serve-target`);
  here workers are split across targets in proportion to their load (at least one each).
- `newest-first`: routing, and per run the newest checkpoint is evaluated next; older ones are
  filled in when no run has a checkpoint newer than its newest evaluated one.
- `thin:K`: routing, FIFO, and a new checkpoint marks queued ones skipped unless their index is a
  multiple of K (the train-end one is never skipped; skipped ones are re-queueable later).

Measured per run while it trains, sampled every `sample_s`: eval lag = publish time (and steps)
of the newest published checkpoint minus that of the newest evaluated one. Also: target loads,
worker utilisation (time evaluating / time up), starved runs (a stretch of 10 cadences while
training in which no newer checkpoint of the run was evaluated), and how long after train end
its last checkpoint was evaluated.

    python bench/sim_scale.py                           # the table in bench/README.md, as markdown rows
    python bench/sim_scale.py --scenario overload --seeds 10
"""
from __future__ import annotations

import argparse
import heapq
import math
import random
import statistics
from dataclasses import dataclass, field

# Costs, seconds (bench/README.md): Qwen3-8B, 23-prompt suite with references cached, one H200 ~7 s;
# a 200-prompt suite scales that to ~60 s. Qwen3.6-27B: ~3.4x the 8B's FLOPs -> ~205 s. Loads: the
# weights' bytes at ~2 GB/s plus the first fingerprint (2.5 GB/s; cached afterwards): 8B ~16.4 GB
# -> ~10 s, 27B ~54 GB -> ~30 s read; first load +22 s of hashing (ignored: after the first load).
TARGETS = {"qwen3-8b": {"eval_s": 60.0, "load_s": 10.0}, "qwen3.6-27b": {"eval_s": 205.0, "load_s": 30.0}}
# the tiny bundled target (bench/README.md job_latency: warm job 0.167 s, cold worker 8.76 s)
TINY = {"tiny-a": {"eval_s": 0.17, "load_s": 8.6}, "tiny-b": {"eval_s": 0.17, "load_s": 8.6}}


@dataclass
class Job:
    run: int
    index: int          # checkpoint number within the run (1, 2, ...)
    t_pub: float
    target: str
    final: bool
    seq: int = 0


@dataclass
class Run:
    target: str
    cadence: float
    start: float
    n_ckpt: int
    published: list = field(default_factory=list)   # t_pub of checkpoint i at [i-1]
    evaluated: list = field(default_factory=list)   # (t_done, index)
    newest_eval: int = 0
    final_done: float | None = None

    @property
    def end(self) -> float:
        return self.start + self.cadence * self.n_ckpt


@dataclass
class Worker:
    wid: int
    serves: tuple
    max_targets: int = 1
    loaded: list = field(default_factory=list)  # LRU, most recent last
    busy_until: float | None = None
    eval_start: float = 0.0
    job: Job | None = None
    up: bool = True
    loads: int = 0
    eval_time: float = 0.0
    up_time: float = 0.0
    up_since: float = 0.0
    gen: int = 0  # bumps on failure: pending finish events of a dead worker are ignored


class Scheduler:
    def __init__(self, policy: str, runs: list[Run]):
        self.policy = policy
        self.runs = runs
        self.thin_k = int(policy.split(":")[1]) if policy.startswith("thin:") else None
        self.pending: dict[str, list[Job]] = {}
        self.running: dict[int, set] = {}
        self.skipped = 0
        self.seq = 0

    def add(self, job: Job) -> None:
        self.seq += 1
        job.seq = self.seq
        q = self.pending.setdefault("*" if self.policy == "fifo" else job.target, [])
        if self.thin_k:  # the new checkpoint is the newest: older non-K-th ones of its run are skipped
            keep = [j for j in q if j.run != job.run or j.final or j.index % self.thin_k == 0]
            self.skipped += len(q) - len(keep)
            q[:] = keep
        q.append(job)

    def requeue(self, job: Job) -> None:  # an abandoned job goes back at the front (RQ retry)
        self.pending.setdefault("*" if self.policy == "fifo" else job.target, []).insert(0, job)

    def pick(self, w: Worker) -> Job | None:
        if self.policy == "fifo":
            q = self.pending.get("*") or []
            return q.pop(0) if q else None
        order = sorted(w.serves, key=lambda t: t not in w.loaded)  # the loaded target's queue first
        for t in order:
            q = self.pending.get(t) or []
            if not q:
                continue
            if self.policy != "newest-first":
                return q.pop(0)
            return self._newest_first(q)
        return None

    def _newest_first(self, q: list[Job]) -> Job:
        newest: dict[int, Job] = {}
        for j in q:
            if j.run not in newest or j.index > newest[j.run].index:
                newest[j.run] = j
        fresh = [j for r, j in newest.items()
                 if j.index > max([self.runs[r].newest_eval, *self.running.get(r, ())])]
        pick = (min(fresh, key=lambda j: j.t_pub) if fresh  # the run that has waited longest
                else max(q, key=lambda j: (j.index, -j.seq)))  # fill in, newest first
        q.remove(pick)
        return pick


def simulate(  # noqa: C901 - an event loop: one branch per event kind
        runs_spec: list[dict], targets: dict, n_workers: int, policy: str, *, mtbf_s: float | None = None,
        repair_s: float = 600.0, grace_s: float = 70.0, sample_s: float = 30.0, seed: int = 0,
        serves: list[tuple] | None = None, jitter: float = 0.1) -> dict:
    rng = random.Random(seed)
    runs = [Run(**r) for r in runs_spec]
    sched = Scheduler(policy, runs)
    all_targets = tuple(sorted({r.target for r in runs}))
    if serves is None:
        serves = assign_workers(runs, targets, n_workers) if policy != "fifo" else [all_targets] * n_workers
    workers = [Worker(i, tuple(serves[i])) for i in range(n_workers)]
    events: list = []
    counter = 0

    def push(t, kind, *data):
        nonlocal counter
        counter += 1
        heapq.heappush(events, (t, counter, kind, data))

    for ri, r in enumerate(runs):
        for i in range(1, r.n_ckpt + 1):  # each interval drifts by up to +-10 % (data loading, saves)
            drift = rng.uniform(-jitter, jitter) if i < r.n_ckpt and jitter else 0.0
            push(r.start + r.cadence * (i + drift), "publish", ri, i)
    horizon_train = max(r.end for r in runs)
    for w in workers:
        if mtbf_s:
            push(rng.expovariate(1 / mtbf_s), "fail", w.wid)
    t_sample = 0.0
    samples: dict[int, list] = {i: [] for i in range(len(runs))}

    def sample_until(t):
        nonlocal t_sample
        while t_sample <= t:
            for ri, r in enumerate(runs):
                if r.start < t_sample <= r.end and r.published:
                    newest = len(r.published)
                    ev_t = r.published[r.newest_eval - 1] if r.newest_eval else r.start
                    samples[ri].append((r.published[-1] - ev_t, newest - r.newest_eval))
            t_sample += sample_s

    def dispatch(t):
        for w in workers:
            if not w.up or w.job is not None:
                continue
            job = sched.pick(w)
            if job is None:
                continue
            cost = 0.0
            if job.target in w.loaded:
                w.loaded.remove(job.target)
            else:
                cost += targets[job.target]["load_s"]
                w.loads += 1
                if len(w.loaded) >= w.max_targets:
                    w.loaded.pop(0)
            w.loaded.append(job.target)
            ev = targets[job.target]["eval_s"]
            w.job, w.busy_until, w.eval_start = job, t + cost + ev, t + cost
            sched.running.setdefault(job.run, set()).add(job.index)
            push(w.busy_until, "done", w.wid, w.gen)

    t = 0.0
    while events:
        t, _, kind, data = heapq.heappop(events)
        sample_until(t)
        if kind == "publish":
            ri, i = data
            r = runs[ri]
            r.published.append(t)
            sched.add(Job(ri, i, t, r.target, i == r.n_ckpt))
        elif kind == "done":
            w = workers[data[0]]
            if data[1] != w.gen or w.job is None:
                continue
            job, w.job = w.job, None
            w.eval_time += t - w.eval_start
            r = runs[job.run]
            sched.running[job.run].discard(job.index)
            r.evaluated.append((t, job.index))
            r.newest_eval = max(r.newest_eval, job.index)
            if job.final:
                r.final_done = t
        elif kind == "fail":
            w = workers[data[0]]
            if w.job is not None:
                lost = w.job
                w.eval_time += max(0.0, t - w.eval_start)  # evaluated, but lost with the worker
                sched.running[lost.run].discard(lost.index)
                push(t + grace_s, "requeue", lost)
            w.up_time += t - w.up_since
            w.up, w.job, w.loaded, w.gen = False, None, [], w.gen + 1
            push(t + repair_s, "repair", w.wid)
        elif kind == "repair":
            w = workers[data[0]]
            w.up, w.up_since = True, t
            if mtbf_s and t < horizon_train * 3:
                push(t + rng.expovariate(1 / mtbf_s), "fail", w.wid)
        elif kind == "requeue":
            sched.requeue(data[0])
        dispatch(t)
        if all(r.final_done is not None for r in runs) and all(w.job is None for w in workers) \
                and not any(sched.pending.values()):
            break
    end = t
    for w in workers:
        if w.up:
            w.up_time += end - w.up_since
    lag_s = [s for ri in samples for s, _ in samples[ri]]
    lag_steps = [n for ri in samples for _, n in samples[ri]]
    # starved: at some time while training, the run's dashboard was 10 or more checkpoints behind
    starved = sum(1 for ri in samples if any(n >= 10 for _, n in samples[ri]))
    up = sum(w.up_time for w in workers) or 1.0
    return {"policy": policy, "lag_p50_s": pct(lag_s, 50), "lag_p95_s": pct(lag_s, 95), "lag_max_s": max(lag_s),
            "lag_p95_ckpts": pct(lag_steps, 95),
            "lag_end_ckpts": statistics.fmean(samples[ri][-1][1] for ri in samples if samples[ri]),
            "loads": sum(w.loads for w in workers),
            "util": sum(w.eval_time for w in workers) / up, "starved": starved, "runs": len(runs),
            "final_delay_max_s": max(r.final_done - r.published[-1] for r in runs),
            "evaluated": sum(len(r.evaluated) for r in runs), "published": sum(r.n_ckpt for r in runs),
            "skipped": sched.skipped, "end_s": end, "lag_samples_ckpts": lag_steps}


def pct(xs, q):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def assign_workers(runs: list[Run], targets: dict, n: int) -> list[tuple]:
    """Each worker serves one target; workers split in proportion to each target's load (>= 1 each)."""
    load: dict[str, float] = {}
    for r in runs:
        load[r.target] = load.get(r.target, 0.0) + targets[r.target]["eval_s"] / r.cadence
    names = sorted(load, key=lambda t: -load[t])
    if n < len(names):  # fewer workers than targets: each serves all, its loaded one first
        return [tuple(names)] * n
    share = {t: 1 for t in names}
    for _ in range(n - len(names)):
        t = max(names, key=lambda t: load[t] / share[t])
        share[t] += 1
    return [(t,) for t in names for _ in range(share[t])]


def capacity(runs_spec, targets, n_workers) -> float:
    """Offered load / workers (> 1: evaluation cannot keep up even with no reloads)."""
    return sum(targets[r["target"]]["eval_s"] / r["cadence"] for r in runs_spec) / n_workers


def _runs(cadence: float, n_ckpt: int, n_runs: int = 8) -> list[dict]:
    # half the runs on each target, starts staggered by 37 s
    return [dict(target=t, cadence=cadence, start=37.0 * i, n_ckpt=n_ckpt)
            for i, t in enumerate(["qwen3-8b", "qwen3.6-27b"] * (n_runs // 2))]


SCENARIOS = {
    # 8 runs (4 per target), 4 H200 workers, 6 h of training
    "light": dict(runs=_runs(600.0, 36), workers=4),                  # checkpoints every 10 min
    "busy": dict(runs=_runs(300.0, 72), workers=4),                   # every 5 min: reloads decide
    "busy+failures": dict(runs=_runs(300.0, 72), workers=4, mtbf_s=7200.0),  # a failure per worker per 2 h
    "overload": dict(runs=_runs(240.0, 90), workers=4),               # every 4 min: more than 4 workers can do
    "overload, 12 h": dict(runs=_runs(240.0, 180), workers=4),        # the same, twice as long
}
POLICIES = ["fifo", "routing", "newest-first", "thin:4"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", type=int, default=5, help="seeds averaged (publication jitter, failure draws)")
    ap.add_argument("--scenario", action="append", default=None, choices=sorted(SCENARIOS))
    args = ap.parse_args()
    print("| scenario | load/worker | policy | lag p50 | lag p95 | lag p95 (ckpts) | lag at train end (ckpts) | "
          "target loads | worker util | "
          "starved runs | train-end eval after | evaluated / published (skipped) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for name in args.scenario or list(SCENARIOS):
        sc = SCENARIOS[name]
        rho = capacity(sc["runs"], TARGETS, sc["workers"])
        for policy in POLICIES:
            outs = [simulate(sc["runs"], TARGETS, sc["workers"], policy, mtbf_s=sc.get("mtbf_s"), seed=s)
                    for s in range(args.seeds)]
            m = {k: statistics.fmean(o[k] for o in outs) for k in outs[0] if k not in ("policy", "lag_samples_ckpts")}
            print(f"| {name} | {rho:.2f} | {policy} | {m['lag_p50_s'] / 60:.1f} min | {m['lag_p95_s'] / 60:.1f} min | "
                  f"{m['lag_p95_ckpts']:.1f} | {m['lag_end_ckpts']:.1f} | {m['loads']:.0f} | {m['util']:.0%} | "
                  f"{m['starved']:.1f}/{m['runs']:.0f} | "
                  f"{m['final_delay_max_s'] / 60:.1f} min | {m['evaluated']:.0f} / {m['published']:.0f} "
                  f"({m['skipped']:.0f}) |")


if __name__ == "__main__":
    main()
