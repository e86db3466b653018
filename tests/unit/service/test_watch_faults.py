"""The watcher on real training directories (issue 34 D12, D13; issue 35 items 5, 6, 9): a write that stalls
past `--settle`, a file re-saved under its name, DeepSpec's `step_latest` as a plain file, odd entries, a failed
checkpoint retried once its inputs change, and hints that name what the watcher has.

The watcher converts real checkpoints (torch.save'd training states of a real drafter) into a real checkpoint
root; `submit` records what would be queued (the CLI's Redis path is tested in tests/integration).

Select with `pytest -k "watch_stalled_write or watch_resaved_name or step_latest_file or watch_retry or watch_hints"`.
"""
from __future__ import annotations

import io
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dflash_train.checkpoints.checkpoint import save_drafter
from dflash_train.checkpoints.publication import read_manifest
from hooks.watch import Watcher
from tests.support.factories import drafter_for, qwen3_target


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


@pytest.fixture(scope="module")
def drafter_files(tmp_path_factory):
    """(config.json path, the drafter's tensors) of a small real drafter."""
    zdir = tmp_path_factory.mktemp("cfg")
    save_drafter(drafter_for(qwen3_target(layers=6, hidden=32), layers=1, features=2), zdir)
    return zdir / "config.json", load_file(str(zdir / "model.safetensors"))


def _pt_bytes(tensors: dict, step: int | None) -> bytes:
    buf = io.BytesIO()
    state = {"model_state_dict": tensors, "optimizer_state_dict": {}}
    if step is not None:
        state["step"] = step
    torch.save(state, buf)
    return buf.getvalue()


def _bump_mtime(path: Path, ns: int = 7_000_000_000) -> None:
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + ns))


class Harness:
    def __init__(self, tmp_path: Path, **kwargs):
        self.out, self.into, self.clock = tmp_path / "train" / "run-x", tmp_path / "ckpts", Clock()
        self.out.mkdir(parents=True, exist_ok=True)
        self.lines, self.submitted = [], []
        self.kwargs = kwargs

    def watcher(self, **kwargs) -> Watcher:  # a (re)started watcher: same state file
        return Watcher(self.out, self.into, submit=lambda r: self.submitted.append(r) or "ok",
                       log=self.lines.append, clock=self.clock, **{"settle": 30, **self.kwargs, **kwargs})

    def settle(self, w: Watcher) -> list[dict]:
        """First sight, then a scan past --settle."""
        first = w.scan()
        self.clock.now += 31
        return first + w.scan()


def test_watch_stalled_write_is_retried_once_the_write_goes_on(tmp_path, drafter_files):
    config, tensors = drafter_files
    h = Harness(tmp_path, config=config)
    w = h.watcher()
    whole = _pt_bytes(tensors, 40)
    pt = h.out / "loop_step40.pt"
    pt.write_bytes(whole[: len(whole) // 2])  # the trainer's write stalls longer than --settle
    events = h.settle(w)
    assert [e["status"] for e in events] == ["failed"]
    reason = events[0]["reason"]
    assert "legacy" not in reason and "incomplete or damaged (truncated, or still being written" in reason, reason
    pt.write_bytes(whole)  # the write goes on: a new size and mtime
    _bump_mtime(pt)
    assert w.scan() == []  # settling again
    h.clock.now += 31
    assert [(e["status"], e["step"]) for e in w.scan()] == [("queued", 40)]
    assert [p.name for p in h.submitted] == ["step-00000040"]
    assert h.watcher().scan() == [] and len(h.submitted) == 1  # a restart queues nothing twice


def test_watch_resaved_name_later_step_is_queued(tmp_path, drafter_files):
    config, tensors = drafter_files
    h = Harness(tmp_path, config=config)
    w = h.watcher()
    last = h.out / "last.pt"
    last.write_bytes(_pt_bytes(tensors, 400))
    assert [(e["status"], e["step"]) for e in h.settle(w)] == [("queued", 400)]
    last.write_bytes(_pt_bytes({k: v + 1 for k, v in tensors.items()}, 500))  # re-saved under its name
    _bump_mtime(last)
    assert [(e["status"], e["step"]) for e in h.settle(w)] == [("queued", 500)]
    assert [p.name for p in h.submitted] == ["step-00000400", "step-00000500"]
    assert read_manifest(h.into / "run-x" / "step-00000500")["imported_from"]["path"] == str(last.resolve())
    w2 = h.watcher()  # restarted: the state has (path, signature, step): nothing again
    assert h.settle(w2) == [] and len(h.submitted) == 2
    last.write_bytes(_pt_bytes(tensors, 600))  # re-saved while the watcher was down
    _bump_mtime(last, 14_000_000_000)
    assert [(e["status"], e["step"]) for e in h.settle(h.watcher())] == [("queued", 600)]


def _deepspec_step(exp: Path, step: int, config: Path, tensors: dict) -> Path:
    from safetensors.torch import save_file

    d = exp / f"step_{step}"
    d.mkdir(parents=True)
    (d / "config.json").write_bytes(config.read_bytes())
    save_file(tensors, str(d / "model.safetensors"))
    return d


def test_step_latest_file_and_odd_entries_never_stop_the_watcher(tmp_path, drafter_files):
    config, tensors = drafter_files
    exp = tmp_path / "exp"
    for step in (150, 300):
        _deepspec_step(exp, step, config, tensors)
    (exp / "step_latest").write_text("step_150\n")  # DeepSpec's plain-file form
    lines, submitted = [], []
    w = Watcher(exp, tmp_path / "ckpts", submit=lambda r: submitted.append(r) or "ok", log=lines.append)
    assert w.complete(exp / "step_150") and not w.complete(exp / "step_300")
    events = w.scan()
    assert [(e["status"], e["step"]) for e in events] == [("queued", 150)]
    (exp / "step_latest").write_text(str(exp / "step_300"))  # a path in it
    assert [(e["status"], e["step"]) for e in w.scan()] == [("queued", 300)]
    # odd entries of a directory the watcher does not own: passed over, never fatal
    _deepspec_step(exp, 450, config, tensors)
    (exp / "step_latest").unlink()
    (exp / "step_latest").mkdir()  # neither a link nor a file
    (exp / "weird.pt").mkdir()  # a directory named like a file
    assert w.scan() == [] and not w.complete(exp / "step_450")
    (exp / "step_latest").rmdir()
    (exp / "step_latest").write_bytes(b"\xff\xfe garbage \x00")
    assert w.scan() == []
    os.symlink("step_450", exp / "step_latest.tmp")
    os.replace(exp / "step_latest.tmp", exp / "step_latest")  # and the symlink form, as before
    assert [(e["status"], e["step"]) for e in w.scan()] == [("queued", 450)]


def test_watch_retry_when_the_inputs_that_failed_change(tmp_path, drafter_files):
    config, tensors = drafter_files
    h = Harness(tmp_path)
    pt = h.out / "loop_step40.pt"
    pt.write_bytes(_pt_bytes(tensors, 40))
    events = h.settle(h.watcher())  # no --config: fails, saying to give it
    assert [e["status"] for e in events] == ["failed"] and "--config" in events[0]["reason"]
    h.lines.clear()
    assert h.settle(h.watcher()) == []  # the same inputs again: not retried, and said so once
    told = [ln for ln in h.lines if "not retried" in ln]
    assert len(told) == 1 and "--retry-failed" in told[0] and str(pt) in told[0]
    # run again with the missing --config: retried at once, queued
    events = h.settle(h.watcher(config=config))
    assert [(e["status"], e["step"]) for e in events] == [("queued", 40)] and len(h.submitted) == 1


def test_watch_retry_failed_flag_and_a_changed_config_file(tmp_path, drafter_files):
    config, tensors = drafter_files
    h = Harness(tmp_path)
    bad = tmp_path / "bad-config.json"
    bad.write_text("{\"not\": \"a drafter\"}")
    pt = h.out / "loop_step40.pt"
    pt.write_bytes(_pt_bytes(tensors, 40))
    assert [e["status"] for e in h.settle(h.watcher(config=bad))] == ["failed"]
    assert h.settle(h.watcher(config=bad)) == []  # unchanged: not retried
    events = h.settle(h.watcher(config=bad, retry_failed=True))  # forced: tried once more, fails the same
    assert [e["status"] for e in events] == ["failed"]
    bad.write_text(config.read_text())  # the config file itself fixed in place
    _bump_mtime(bad)
    assert [(e["status"], e["step"]) for e in h.settle(h.watcher(config=bad))] == [("queued", 40)]


def test_watch_hints_name_what_watch_has_and_settle_zero_acts_at_once(tmp_path, drafter_files):
    config, tensors = drafter_files
    h = Harness(tmp_path, config=config)
    (h.out / "weights.pt").write_bytes(_pt_bytes(tensors, None))  # no step in it nor in its name
    (h.out / "loop_step40.pt").write_bytes(_pt_bytes(tensors, 40))
    w = h.watcher(settle=0)
    events = {Path(e["checkpoint"]).name: e for e in w.scan()}  # --settle 0: the first scan acts
    assert events["loop_step40.pt"]["status"] == "queued"
    reason = events["weights.pt"]["reason"]
    assert events["weights.pt"]["status"] == "failed" and "give --step" not in reason
    assert "dflash-eval import" in reason and "--step N" in reason and "checkpoint_step500.pt" in reason
