"""Issue 33's two walks, re-drawn: a checkpoint location from publication to the worker's load, and a job's
payload from the training hook to the sinks.

- location: publishes a tiny checkpoint, builds its job (`make_job`, as `enqueue` and the hook do), turns it
  into JSON and back (the queue), then checks and materializes it as the worker does;
- job: the training hook (`EvalOnCheckpoint`) is told of a published checkpoint, its client delivers the job to
  a real Redis, a real RQ worker (in this process, burst) runs it on the bundled tiny target and hands the
  result to the sinks (W&B offline; the sink child is another process, not traced). Only the payload's
  handlers are walked (`PAYLOAD_HANDLERS`: the hook, the delivery, the worker reading the job, the job
  function), each handling one sequence whichever thread runs it; the worker's own polling and heartbeats are
  not the payload's path. The evaluation itself (`eval_worker/engine`, `dflash_train/core`) is one opaque
  call: the walk is the payload's, not the engine's.

Every call into this project's code is recorded (`sys.setprofile`), and each sequence of module names is
reduced to (summed over a walk's sequences):

- stays: runs of consecutive calls in one module;
- rooms: distinct modules;
- climbs: stays in a module already left once (re-entering it);
- the most-called functions.

    python bench/structure_walks.py                  # this checkout, both walks
    python bench/structure_walks.py --repo /old/tree # another checkout (e.g. `git worktree add /tmp/old REV`)
    python bench/structure_walks.py --walk location  # one walk
"""
from __future__ import annotations

import argparse
import importlib
import json
import sys
import tempfile
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("dflash_train", "eval_worker", "hooks")


def _first(*names: str):
    for name in names:
        try:
            return importlib.import_module(name)
        except ModuleNotFoundError:
            continue
    raise ModuleNotFoundError(names[0])


def walk(repo: Path) -> dict:
    sys.path.insert(0, str(repo))
    from dflash_train.checkpoints.publication import publish_directory

    builder = _first("eval_worker.service.jobs.builder", "eval_worker.service.job_builder")
    checkpoints = _first("eval_worker.service.jobs.checkpoints", "eval_worker.service.job_checkpoints")
    schema = _first("eval_worker.service.jobs.schema", "eval_worker.service.job_schema")
    roots = [str(repo / "x")]  # replaced below

    calls: list[tuple[str, str]] = []
    prefixes = tuple(str(repo / p) + "/" for p in PACKAGES)

    def profile(frame, event, _arg):
        if event == "call" and frame.f_code.co_filename.startswith(prefixes):
            rel = Path(frame.f_code.co_filename).relative_to(repo).as_posix()
            calls.append((rel, frame.f_code.co_qualname))

    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp).resolve()
        roots = [root]

        def write(d: Path) -> None:
            (d / "config.json").write_text(json.dumps({"architectures": ["DFlashDraftModel"]}))
            (d / "model.safetensors").write_bytes(b"\0" * 64)

        ck = publish_directory(root, "walk", 10, write)
        sys.setprofile(profile)
        try:
            job = builder.make_job(str(ck), suite="builtin:coding-v1", roots=roots)
            wire = json.loads(json.dumps(job.to_json()))  # the queue carries JSON
            job = schema.validate_job(wire)
            with checkpoints.materialize(job, roots) as (where, _baseline, _manifests):
                assert Path(where).is_dir()
        finally:
            sys.setprofile(None)
    return _reduce({0: calls})


def _reduce(sequences: dict[int, list[tuple[str, str]]]) -> dict:
    stays_n = climbs = 0
    rooms: set[str] = set()
    room_stays: Counter[str] = Counter()
    for calls in sequences.values():
        modules = [m for m, _ in calls]
        stays = [m for i, m in enumerate(modules) if i == 0 or modules[i - 1] != m]
        seen: set[str] = set()
        for m in stays:
            climbs += m in seen
            seen.add(m)
        stays_n += len(stays)
        rooms |= set(stays)
        room_stays.update(stays)
    every = [c for calls in sequences.values() for c in calls]
    return {"calls": len(every), "stays": stays_n, "rooms": len(rooms), "climbs": climbs,
            "sequences": len([t for t in sequences.values() if t]),
            "marker_reads": sum(q == "read_marker" for _, q in every),
            "top_functions": Counter(f"{Path(m).name}:{q}" for m, q in every).most_common(5),
            "top_rooms": room_stays.most_common(3)}


OPAQUE = ("eval_worker/engine/", "dflash_train/core/")  # the evaluation itself: one call, not walked
# where the payload is handled (the same names in every checkout since the walk was filed): the hook told of a
# checkpoint, the client delivering the job to Redis, the worker reading it off Redis, the job function
PAYLOAD_HANDLERS = frozenset({"EvalOnCheckpoint.on_checkpoint_published", "JobClient._deliver_job",
                              "EvalJob._deserialize_data", "run_eval_job"})


def walk_job(repo: Path) -> dict:
    """The job walk (module docstring): hook -> client -> Redis -> RQ worker -> job -> ledger -> sinks."""
    import os
    import threading

    sys.path.insert(0, str(repo))
    tmp_dir = tempfile.TemporaryDirectory()
    tmp = Path(tmp_dir.name).resolve()
    os.environ.update({"DFLASH_HOME": str(tmp / "home"), "DFLASH_SINKS": "wandb", "WANDB_MODE": "offline",
                       "DFLASH_WANDB_DIR": str(tmp / "wandb"), "DFLASH_RESULTS_DIR": str(tmp / "results"),
                       "DFLASH_CACHE_DIR": str(tmp / "cache"), "DFLASH_CHECKPOINT_ROOTS": str(tmp / "ckpts"),
                       "WANDB_SILENT": "true"})
    from eval_worker.redis_client import connect
    from hooks.eval_on_checkpoint import EvalOnCheckpoint
    from tests.support.sidecar_support import publish_random, tiny_target_drafter_config, write_suite

    server = _first("eval_worker.service.local_redis.server", "eval_worker.service.redis_server")
    worker = _first("eval_worker.service.worker.worker", "eval_worker.service.worker")
    evaluators = _first("eval_worker.service.worker.evaluators", "eval_worker.service.evaluators")
    target = repo / "dflash_train" / "assets" / "tiny_target"
    cfg, mask = tiny_target_drafter_config(target)
    root = tmp / "ckpts"
    root.mkdir()
    suite = write_suite(root / "suite.jsonl", n_prompts=2, max_new_tokens=12)
    ck = publish_random(root, "walk", 10, target_config=cfg, mask_token_id=mask, seed=3, block_size=16)

    prefixes = tuple(str(repo / p) + "/" for p in PACKAGES)
    opaque = tuple(str(repo / p) for p in OPAQUE)
    extents: list[list[tuple[str, str]]] = []  # one call sequence per handling of the payload
    state: dict[int, dict] = {}  # thread -> {"depth": frames open in its extent, "calls": its list, "opaque": depth}

    def profile(frame, event, _arg):
        if event not in ("call", "return"):
            return
        t = threading.get_ident()
        code = frame.f_code
        here = state.get(t)
        if here is None:  # outside the payload's path: only an entry point opens an extent
            if event == "call" and code.co_qualname in PAYLOAD_HANDLERS and code.co_filename.startswith(prefixes):
                here = state[t] = {"depth": 0, "calls": [], "opaque": 0}
                extents.append(here["calls"])
            else:
                return
        here["depth"] += 1 if event == "call" else -1
        if here["opaque"]:  # below an opaque call: counted only to find its return
            here["opaque"] += 1 if event == "call" else -1
        elif event == "call" and code.co_filename.startswith(prefixes):
            here["calls"].append((Path(code.co_filename).relative_to(repo).as_posix(), code.co_qualname))
            if code.co_filename.startswith(opaque):
                here["opaque"] = 1
        if here["depth"] == 0:
            del state[t]

    with server.LocalRedis(tmp / "redis") as redis:
        settings = evaluators.WorkerSettings(results_dir=tmp / "results", roots=[root], default_target=str(target),
                                             cache_dir=tmp / "cache")
        threading.setprofile(profile)
        sys.setprofile(profile)
        try:
            hook = EvalOnCheckpoint(every_n_steps=1, suite=str(suite), target=str(target), redis_url=redis.url,
                                    min_backoff=0.05, max_backoff=0.2)
            hook.on_checkpoint_published(None, 10, ck, None)
            assert hook.flush(60), hook.errors
            hook.close()
            conn = connect(redis.url)
            worker.serve(conn, ["dflash-eval"], settings, burst=True, preload=False, with_scheduler=False,
                         name="walk")
        finally:
            sys.setprofile(None)
            threading.setprofile(None)  # type: ignore[arg-type]
        records = list((tmp / "results").rglob("*.json"))
        assert records, "the job recorded no result"
    tmp_dir.cleanup()
    return _reduce(dict(enumerate(extents)))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repo", type=Path, default=REPO, help="the checkout to measure (default: this one)")
    p.add_argument("--walk", choices=("location", "job", "both"), default="both")
    args = p.parse_args(argv)
    repo = args.repo.resolve()
    walks = {"location": walk, "job": walk_job}
    for name in ("location", "job") if args.walk == "both" else (args.walk,):
        w = walks[name](repo)
        parts = f"{w['sequences']} sequence" + "s" * (w["sequences"] != 1)
        print(f"{name} walk ({args.repo}): {w['calls']} calls, {w['stays']} stays in {w['rooms']} rooms, "
              f"{w['climbs']} climbs back, {w['marker_reads']} marker reads ({parts})")
        print("  most-called: " + ", ".join(f"{f} ×{n}" for f, n in w["top_functions"]))
        print("  most-re-entered: " + ", ".join(f"{r} ×{n}" for r, n in w["top_rooms"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
