"""Issue 33's location walk, re-drawn: a checkpoint location from publication to the worker's load.

Publishes a tiny checkpoint, builds its job (`make_job`, as `enqueue` and the hook do), turns it into JSON
and back (the queue), then checks and materializes it as the worker does. Every call into this project's
code is recorded (`sys.setprofile`), and the module sequence is reduced to:

- stays: runs of consecutive calls in one module;
- rooms: distinct modules;
- climbs: stays in a module already left once (re-entering it);
- the most-called functions.

    python bench/structure_walks.py                  # this checkout
    python bench/structure_walks.py --repo /old/tree # another checkout (e.g. `git worktree add /tmp/old REV`)
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
    modules = [m for m, _ in calls]
    stays = [m for i, m in enumerate(modules) if i == 0 or modules[i - 1] != m]
    seen: set[str] = set()
    climbs = 0
    for m in stays:
        climbs += m in seen
        seen.add(m)
    return {"calls": len(calls), "stays": len(stays), "rooms": len(set(stays)), "climbs": climbs,
            "top_functions": Counter(f"{Path(m).name}:{q}" for m, q in calls).most_common(5),
            "top_rooms": Counter(stays).most_common(3)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repo", type=Path, default=REPO, help="the checkout to measure (default: this one)")
    args = p.parse_args(argv)
    w = walk(args.repo.resolve())
    print(f"location walk ({args.repo}): {w['calls']} calls, {w['stays']} stays in {w['rooms']} rooms, "
          f"{w['climbs']} climbs back")
    print("  most-called: " + ", ".join(f"{f} ×{n}" for f, n in w["top_functions"]))
    print("  most-re-entered: " + ", ".join(f"{r} ×{n}" for r, n in w["top_rooms"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
