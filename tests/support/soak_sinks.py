"""Soak scenario: kill -9 in the sink phase, then count what reached each dashboard (issue 34 D1).

The ledger is not the whole promise: every accepted evaluation must reach every sink the user
configured (W&B, TensorBoard, MLflow), or show up as a visible failure. `scenario_sink_kills`
runs real workers (tests/support/soak_stack.py) with all three sinks on, W&B offline, TensorBoard
event files and a local MLflow sqlite store, and SIGKILLs at random points of publishing: either
the worker with the sink child it is waiting on (the box dies; RQ's retry of the job finds the
record and must publish it), or the sink child alone (an OOM kill of the tracker client; the job
finishes with a sink error that names it, and the run's next publication catches the sink up).
A last job of the run, never killed, is published after the loop. Then each sink is read back with
its own reader (`tests.support.wandb_reader`, TensorBoard's EventAccumulator, MlflowClient) and its
points are counted against the ledger's records: they must be equal, one point per record.

`python bench/soak.py --only sink_kills` runs it at full size; tests/reliability/test_sink_kills.py
small.
"""
from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import time
from collections import Counter
from pathlib import Path

from tests.support.soak_stack import RUN, Row, Stack, Zygote, retry_now, wait_for

SINKS = ("wandb", "tensorboard", "mlflow")
_CHILD_MODULE = "eval_worker.results.sinks.child"


def sink_children(pid: int) -> list[tuple[int, str]]:
    """(pid, sink) of the sink publications `pid` is running (sinks/child.py, one per publication)."""
    from tests.support.soak import _children  # soak.py imports this module

    out = []
    for child in _children(pid):
        try:
            args = Path(f"/proc/{child}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if _CHILD_MODULE in args and "--sink" in args[:-1]:
            out.append((child, args[args.index("--sink") + 1]))
    return out


def _killpg(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def sink_env(base: Path) -> dict[str, str]:
    """Worker environment: every sink on, all of them local (W&B offline)."""
    w = base / "wandb"
    return {"DFLASH_SINKS": ",".join(SINKS), "WANDB_MODE": "offline", "DFLASH_WANDB_DIR": str(w), "WANDB_DIR": str(w),
            "WANDB_SILENT": "true", "WANDB_CONFIG_DIR": str(base / "wandb-config"),
            "WANDB_CACHE_DIR": str(base / "wandb-cache"), "WANDB_DATA_DIR": str(base / "wandb-data"),
            "DFLASH_TENSORBOARD_DIR": str(base / "tensorboard"),
            "DFLASH_MLFLOW_TRACKING_URI": f"sqlite:///{base / 'mlflow' / 'mlflow.db'}",
            "DFLASH_WANDB_TIMEOUT_S": "240", "DFLASH_SINK_TIMEOUT_S": "240"}


_TAU = re.compile(r"^eval/(?:[^/]+/)?tau$")  # `eval/tau` (the primary series) or `eval/<series>/tau`


def _steps(values) -> dict[str, object]:
    steps = [int(v) for v in values]
    dupes = sorted(s for s, n in Counter(steps).items() if n > 1)
    return {"points": len(steps), "steps": sorted(set(steps)), "duplicate_steps": dupes}


def tau_key(keys) -> str:
    """The one τ key of the run (the soak's options are not the defaults: `eval/<suite>.<options>/tau`)."""
    found = sorted({k for k in keys if _TAU.match(k)})
    if len(found) != 1:
        raise AssertionError(f"expected one τ key, found {found}")
    return found[0]


def read_back(base: Path, run: str = RUN) -> dict[str, dict]:
    """Points of the run's τ in each sink, read with that sink's own reader: {sink: {key, points, steps,
    duplicate_steps}} (or {error} when the sink has nothing readable)."""
    out: dict[str, dict] = {}
    try:
        from tests.support.wandb_reader import read_run

        pointer = json.loads((base / "wandb" / f"{run}-eval.json").read_text())
        history = read_run(pointer["wandb_file"]).history
        key = tau_key(k for row in history for k in row)
        out["wandb"] = {"key": key, **_steps(row["train/step"] for row in history if key in row)}
    except Exception as e:  # noqa: BLE001 - a sink with nothing readable is a finding, not a crash
        out["wandb"] = {"error": f"{type(e).__name__}: {e}"}
    try:
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        acc = EventAccumulator(str(base / "tensorboard" / f"{run}-eval"), size_guidance={"scalars": 0})
        acc.Reload()
        key = tau_key(acc.Tags()["scalars"])
        out["tensorboard"] = {"key": key, **_steps(e.step for e in acc.Scalars(key))}
    except Exception as e:  # noqa: BLE001
        out["tensorboard"] = {"error": f"{type(e).__name__}: {e}"}
    try:
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=f"sqlite:///{base / 'mlflow' / 'mlflow.db'}")
        exps = [e.experiment_id for e in client.search_experiments()]
        runs = client.search_runs(exps, filter_string=f"tags.`dflash.train_run` = '{run}'")
        if len(runs) != 1:
            raise AssertionError(f"{len(runs)} MLflow runs for {run} (one expected)")
        key = tau_key(runs[0].data.metrics)
        out["mlflow"] = {"key": key, **_steps(m.step for m in client.get_metric_history(runs[0].info.run_id, key))}
    except Exception as e:  # noqa: BLE001
        out["mlflow"] = {"error": f"{type(e).__name__}: {e}"}
    return out


def scenario_sink_kills(base: Path, zygote: Zygote, target: Path, *, jobs: int = 3, kills: int = 2, workers: int = 2,
                        seed: int = 0, timeout: float = 300) -> Row:
    """SIGKILL at random points of publishing (kills alternate: the worker with its sink child, the
    sink child alone), then a job of the run never killed; each sink's points must equal the ledger's records."""
    from eval_worker.results.ledger import Ledger
    from eval_worker.service.queueing.queue import fetch_job

    t0, rng = time.monotonic(), random.Random(seed)
    env = sink_env(base)
    wandb_block = {"project": "soak", "group": RUN, "entity": None, "mode": "offline"}
    with Stack(base, zygote=zygote, target=target) as s:
        for _ in range(workers):
            s.start_worker(env=env)
        ids = [s.enqueue(s.publish(i), config=retry_now(kills + 1), wandb=wandb_block) for i in range(1, jobs + 1)]
        landed: list[dict] = []
        missed = 0
        deadline = time.monotonic() + timeout
        # the kills planned: both kinds in every sink, in turn; the point inside the child is random
        plan = [("worker" if k % 2 == 0 else "sink child", SINKS[k % len(SINKS)]) for k in range(kills)]
        window = dict.fromkeys(SINKS, 1.5)  # seconds into a child to draw the kill point from (shrinks on a miss)

        def publication(sink: str):
            for w in s.live_workers():
                for child, name in sink_children(w.pid):
                    if name == sink:
                        return w, child
            return None

        for kind, sink in plan:
            while time.monotonic() < deadline:
                open_ = [j for j, v in s.statuses(ids).items() if v not in ("finished", "failed")]
                if len(open_) < workers:  # keep publications coming until every planned kill has landed
                    ids.append(s.enqueue(s.publish(len(ids) + 1), config=retry_now(kills + 1), wandb=wandb_block))
                try:
                    w, child = wait_for(lambda sink=sink: publication(sink), 60, f"a {sink} publication",
                                        interval=0.02)
                except TimeoutError:
                    continue
                seen_at = time.monotonic()
                job = _current_job(s, w.name)
                time.sleep(rng.uniform(0, window[sink]))
                if not (w.alive() and (child, sink) in sink_children(w.pid)):
                    missed += 1  # the child ended first: draw from a shorter window next time
                    window[sink] *= 0.7
                    continue
                at = round(time.monotonic() - seen_at, 2)
                if kind == "worker":  # the box dies: the worker and the tracker client it waits on
                    _killpg(w.pid)
                    _killpg(child)  # its own session (sinks/child.py run_child)
                    w.wait(30)
                    s.start_worker(env=env, register=False)
                else:  # the tracker client alone (the OOM killer): the worker carries on
                    _killpg(child)
                landed.append({"kind": kind, "sink": sink, "job": job, "at_s": at, "worker": w.name})
                break
        s.wait_settled(ids, timeout)
        # a later publication of the run, never killed: catches up what a killed sink child left out
        control = s.enqueue(s.publish(len(ids) + 1), wandb=wandb_block)
        s.wait_settled([control], timeout)
        c = s.audit([*ids, control])
        results = {j: (fetch_job(s.conn, j).return_value() or {}) for j in [*ids, control]}
        ledger_steps = sorted({e.step for e in Ledger(s.results).entries(RUN)})
        points = read_back(base)
        by_phase = Counter(f"{k['kind']} during {k['sink']}" for k in landed)
        child_kills = [k for k in landed if k["kind"] == "sink child"]
        # a killed sink child is a visible sink error on its job, unless a worker kill later made the job run again
        retried = {k["job"] for k in landed if k["kind"] == "worker"}
        unreported = [k for k in child_kills if k["job"] not in retried
                      and f"{k['sink']}: " not in str(results.get(k["job"], {}).get("sink_error") or "")]
        sink_errors = sum(1 for r in results.values() if r.get("sink_error"))
        equal = {name: p.get("steps") == ledger_steps and p.get("points") == len(ledger_steps)
                 for name, p in points.items()}
        problems = _problems(all_recorded=c.recorded == c.accepted, kills_landed=len(landed) == kills,
                             control_published=results[control].get("sink_error") is None,
                             sink_child_kills_reported=not unreported,
                             **{f"{name}_equals_ledger": ok for name, ok in equal.items()})
        figures = ", ".join(f"{name} {p.get('points', p.get('error'))}" for name, p in points.items())
        observed = (f"{len(landed)} kills landed ({missed} drawn points fell after the child had ended) "
                    f"({', '.join(f'{n} {what}' for what, n in sorted(by_phase.items()))}); "
                    f"{c.executions} evaluations for {c.accepted} jobs, {sink_errors} finished with a sink error; "
                    f"ledger {len(ledger_steps)} records, points read back: {figures}")
        return Row.of("kill -9 in the sink phase (the worker with its sink child, or the sink child alone)",
                      "every ledger record reaches W&B, TensorBoard and MLflow once (points = records), "
                      "a killed sink is a visible sink error until the run's next publication", observed, c, t0,
                      kills=landed, missed=missed, jobs=len(ids) + 1, by_phase=dict(by_phase),
                      ledger_records=len(ledger_steps), points=points,
                      sink_errors=sink_errors, unreported=unreported, problems=problems,
                      lost_ids=c.lost_ids, duplicated_ids=c.duplicated_ids)


def _current_job(s: Stack, name: str) -> str | None:
    from rq.worker import Worker as RQWorker

    for w in RQWorker.all(connection=s.conn):
        if w.name == name:
            return w.get_current_job_id()
    return None


def _problems(**checks: bool) -> list[str]:
    return [name for name, ok in checks.items() if not ok]
