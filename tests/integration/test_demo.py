"""`dflash-eval demo`, shortened: a couple of training steps, one evaluation, everything real.

Checks the printed τ table against the ledger, the report and W&B files, and that no
process the demo started (worker, its children, Redis) is left running — after a normal
run and after Ctrl-C.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from eval_worker.results.series import options_label, options_of
from tests.support.wandb_reader import read_run

REPO = Path(__file__).resolve().parents[2]
SHORT = ["--max-steps", "2", "--eval-every", "2", "--max-new-tokens", "24",
         "--set", "num_prompts=8", "--set", "max_new_tokens=24", "--set", "batch_size=4", "--set", "prompt_tokens=24"]
ROW = re.compile(r"^\s+(\d+) \|\s+([\d.]+) \| \[\s*([\d.]+),\s*([\d.]+)\]", re.M)


def _env(tmp_path: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO), "DFLASH_HOME": str(tmp_path / "home"), "WANDB_MODE": "offline"}
    env.pop("REDIS_URL", None)
    return env


def leftovers(marker: str) -> list[str]:
    """Processes whose command line, working directory or environment mention ``marker``."""
    found = []
    for pid_dir in Path("/proc").iterdir():
        if not pid_dir.name.isdigit() or int(pid_dir.name) == os.getpid():
            continue
        try:
            cmd = (pid_dir / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            env = (pid_dir / "environ").read_bytes().decode(errors="replace")
            cwd = os.readlink(pid_dir / "cwd")
        except (OSError, PermissionError):
            continue
        if marker in cmd or marker in env or cwd.startswith(marker):
            found.append(f"{pid_dir.name}: {cmd[:200]}")
    return found


def _wait_gone(marker: str, timeout: float = 20.0) -> list[str]:
    from tests.support import waits

    deadline = waits.deadline(timeout)
    while (left := leftovers(marker)) and time.monotonic() < deadline:
        time.sleep(0.5)
    return left


@pytest.mark.slow  # ~3.5 min on 2 cores: the whole demo (CI's slow pass; bench/newcomer.sh runs the full one)
def test_demo_runs_end_to_end_and_leaves_nothing_running_demo_pointer(tmp_path, tiny_target_path, capsys):
    """... publishing to the three sinks (`--sink wandb,tensorboard,mlflow`): the same τ in each."""
    work = tmp_path / "demo"
    proc = subprocess.run([sys.executable, "-m", "eval_worker.cli", "demo", "--workdir", str(work),
                           "--run-id", "demo-test", "--sink", "wandb,tensorboard,mlflow", *SHORT], capture_output=True,
                           text=True, env=_env(tmp_path),
                          timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = ROW.findall(proc.stdout)
    assert [int(r[0]) for r in rows] == [2], proc.stdout
    _step, tau, lo, hi = int(rows[0][0]), *map(float, rows[0][1:])
    assert 1.0 <= lo <= tau <= hi <= 16.0

    # the table is the ledger's
    (record_path,) = (work / "results" / "demo-test" / "step-00000002").glob("*/attempt-0.json")
    result = json.loads(record_path.read_text())["result"]
    assert result["tau"]["macro"] == pytest.approx(tau, abs=5e-4)

    report = work / "report" / "demo-test" / "report.html"
    assert report.is_file() and (report.parent / "tau_vs_step.png").stat().st_size > 5000
    assert f"report:      {report}" in proc.stdout

    # SHORT's max_new_tokens is not the engine's default: its numbers are their own series (docs/design.md
    # "Series"), `eval/coding.max_new_tokens-24/...` in every sink, and nothing is drawn under plain `eval/tau`
    record = json.loads(record_path.read_text())
    series = ".".join(p for p in (result["suite"]["name"], options_label(options_of(record))) if p)
    assert series == f"{result['suite']['name']}.max_new_tokens-24"
    key = f"eval/{series}/tau"
    pointer = json.loads((work / "wandb" / "demo-test-eval.json").read_text())
    log = read_run(pointer["wandb_file"])
    assert log.points(key) == {2: pytest.approx(result["tau"]["macro"])}
    assert log.points("eval/tau") == {}
    assert log.points(f"eval/{series}/prompts/nrows")[2] == len(result["prompts"])
    assert f"W&B offline: {pointer['run_dir']}" in proc.stdout

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(work / "tensorboard" / "demo-test-eval"))
    acc.Reload()
    assert {e.step: e.value for e in acc.Scalars(key)} == {2: pytest.approx(result["tau"]["macro"], rel=1e-6)}
    assert f"TensorBoard: tensorboard --logdir {work / 'tensorboard'}" in proc.stdout

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{work / 'mlflow' / 'mlflow.db'}")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()],
                                filter_string="tags.`dflash.train_run` = 'demo-test'")
    tau_history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
    assert tau_history == {2: pytest.approx(result["tau"]["macro"])}
    assert f"MLflow:      run {run.info.run_id}" in proc.stdout

    assert _wait_gone(str(work)) == [], "processes left behind"

    # demo_pointer: `results`, `report` and `status` find the demo's ledger without flags
    from dflash_train.common.settings import Settings
    from eval_worker.cli import main as cli

    settings = Settings.from_env({"DFLASH_HOME": str(tmp_path / "home")})
    assert cli(["results"], settings=settings) == 0
    listed = capsys.readouterr().out
    assert "demo-test" in listed and "latest demo" in listed
    assert cli(["results", "--run", "demo-test", "--json"], settings=settings) == 0
    shown = capsys.readouterr()
    assert json.loads(shown.out)[0]["tau"] == pytest.approx(tau, abs=5e-4) and "latest demo" in shown.err
    report.unlink()
    assert cli(["report"], settings=settings) == 0
    assert report.is_file()  # rebuilt where the demo put it
    capsys.readouterr()
    assert cli(["status"], settings=settings) == 0
    assert "latest demo (finished" in capsys.readouterr().out
    assert cli(["redis", "stop", "--force"], settings=settings) == 0  # what `status` started


def test_demo_ctrl_c_stops_everything_it_started(tmp_path, tiny_target_path):
    work = tmp_path / "demo"
    proc = subprocess.Popen([sys.executable, "-m", "eval_worker.cli", "demo", "--workdir", str(work),
                             "--run-id", "demo-int", *SHORT], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=_env(tmp_path))
    try:
        lines = []
        for line in proc.stdout:  # interrupt once the worker and Redis are up and training has begun
            lines.append(line)
            if line.startswith("[demo] training demo-int"):
                break
        assert any("[demo] redis" in ln for ln in lines), "".join(lines)
        # the demo has spawned the worker by now; on a loaded machine its exec can lag a little
        deadline = time.monotonic() + 30
        while not any("eval_worker.cli worker" in p for p in leftovers(str(work))) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert any("eval_worker.cli worker" in p for p in leftovers(str(work))), "the worker should be running"
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, "".join(lines) + out
    assert "interrupted" in out
    assert _wait_gone(str(work)) == [], "processes left behind after Ctrl-C"


def test_a_ctrl_c_swallowed_by_a_finalizer_still_stops_the_demo():
    """CI once saw the handler's KeyboardInterrupt raised inside redis' ConnectionPool.__del__, where
    Python prints and drops it: the demo trained on and exited 0. The signal is recorded, and the
    next training step (a trainer callback) or wait-loop check raises it again."""
    from eval_worker.commands.demo import Interrupts

    class Finalized:
        def __del__(self):  # what a finalizer does with an exception: print it, go on
            try:
                interrupts.handle(signal.SIGINT, None)
            except BaseException:  # noqa: BLE001 - the handler raises KeyboardInterrupt by design
                pass

    interrupts = Interrupts()
    interrupts.check()  # nothing received yet: no-op
    assert not interrupts
    obj = Finalized()
    del obj  # the signal arrives during garbage collection and is swallowed there
    assert interrupts.signals == [signal.SIGINT]
    with pytest.raises(KeyboardInterrupt):
        interrupts.on_step_end(None, 3, {})
    with pytest.raises(KeyboardInterrupt):
        interrupts.check()

    # and the trainer lets it through: its callbacks swallow Exceptions, never a KeyboardInterrupt
    from dflash_train.training.callbacks import CallbackList

    with pytest.raises(KeyboardInterrupt):
        CallbackList([interrupts]).on_step_end(None, 3, {})


def test_demo_fails_loudly_when_most_references_collapsed():
    from eval_worker.commands.demo import _collapsed
    from eval_worker.results.run_results import RunResult

    def row(step, flags):
        prompts = [{"name": f"p{i}", "degenerate": f} for i, f in enumerate(flags)]
        return RunResult(step, "k", 0, Path("x"), {"prompts": prompts})

    assert _collapsed([row(100, [None, "2 distinct line(s) in 128 tokens", None])]) is None
    msg = _collapsed([row(100, [None, None]), row(200, ["1 distinct line(s) in 128 tokens", "x", None])])
    assert msg and msg.startswith("2 of 3 references at step 200 are degenerate") and "p0, p1" in msg
