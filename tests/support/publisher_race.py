"""Two publishers of one (run, step), raced for real (issue 34 D6): used by
tests/reliability/test_two_publishers.py and the soak's `publishers` row (tests/support/soak.py).

Each round forks two processes that write their own weights for the same step and are released
together by a barrier into the placing; each reports "ok" (told published), "refused" (a
CheckpointError) or "crashed" (anything else: the defect).
"""
from __future__ import annotations

import json
import multiprocessing
import os
from dataclasses import dataclass, field
from pathlib import Path

from dflash_train.checkpoints.publication import CheckpointError, publish_directory, verify_checkpoint
from tests.support import waits

RUN = "race"


def _publisher(root: str, step: int, tag: str, barrier, results) -> None:
    def write(tmp: Path) -> None:
        (tmp / "config.json").write_text(json.dumps({"publisher": tag}))
        (tmp / "model.safetensors").write_bytes(os.urandom(64 << 10) + tag.encode())
        barrier.wait(timeout=30)

    try:
        path = publish_directory(root, RUN, step, write)
        results.put((tag, "ok", str(path), os.getpid()))
    except CheckpointError as e:
        results.put((tag, "refused", str(e), os.getpid()))
    except BaseException as e:  # noqa: BLE001 - anything else is the defect: reported, not raised in the child
        results.put((tag, "crashed", f"{type(e).__name__}: {e}", os.getpid()))


@dataclass
class RaceRound:
    step: int
    outcomes: list[tuple]  # (tag, "ok" | "refused" | "crashed", path or message, pid)
    problems: list[str] = field(default_factory=list)

    @property
    def winners(self) -> list[tuple]:
        return [o for o in self.outcomes if o[1] == "ok"]


def race_round(root: Path, step: int) -> RaceRound:
    """One round: two forked publishers of (RUN, step); its outcome checked (`problems` empty when right)."""
    ctx = multiprocessing.get_context("fork")  # the parent's imports, no re-import per child: cheap rounds
    barrier, results = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_publisher, args=(str(root), step, tag, barrier, results)) for tag in "AB"]
    for p in procs:
        p.start()
    got = [results.get(timeout=waits.scaled(60)) for _ in procs]
    for p in procs:
        p.join(waits.scaled(30))
    r = RaceRound(step, got)
    won, lost = r.winners, [g for g in got if g[1] != "ok"]
    if len(won) != 1:
        r.problems.append(f"{len(won)} told published")
    if any(g[1] == "crashed" for g in got):
        r.problems.append("a publisher crashed: " + "; ".join(g[2] for g in got if g[1] == "crashed"))
    if len(won) == 1 and lost and lost[0][1] == "refused":
        if "already published by" not in lost[0][2] or f"pid {won[0][3]}" not in lost[0][2]:
            r.problems.append(f"the loser was not told who won: {lost[0][2]}")
    for g in won:
        final = Path(g[2])
        try:
            manifest = verify_checkpoint(final)
            if json.loads((final / "config.json").read_text()) != {"publisher": g[0]}:
                r.problems.append("the files are not the winner's")
            if not str(manifest.get("published_by", "")).endswith(f"pid {g[3]}"):
                r.problems.append("published_by does not name the winner")
        except (CheckpointError, OSError, ValueError) as e:
            r.problems.append(f"marker without its files: {e}")
    return r
