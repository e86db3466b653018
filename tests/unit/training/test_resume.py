"""Resume from the training state continues exactly like an uninterrupted run; hooks and retention."""
from pathlib import Path

import pytest
import torch

from dflash_train.checkpoints.checkpoint import load_drafter
from dflash_train.checkpoints.publication import MARKER_NAME, list_checkpoints, pin_checkpoint, read_manifest
from dflash_train.training.train_state import TrainStateError, list_training_states, load_training_state
from dflash_train.training.trainer import Trainer
from tests.support.train_helpers import small_config, target_and_examples


class Crash(BaseException):
    """Stands in for a kill: not an Exception, so no callback guard swallows it."""


class CrashAt:
    def __init__(self, step):
        self.step = step

    def on_step_end(self, trainer, step, metrics):
        if step == self.step:
            raise Crash()


def test_resume_gives_the_same_losses_and_weights(tmp_path):
    target, examples = target_and_examples()
    full = Trainer(small_config(tmp_path / "full", max_steps=8, publish_every=4, noise_std=0.02),
                   target=target, examples=list(examples))
    full_summary = full.train()

    cfg = small_config(tmp_path / "cut", max_steps=8, publish_every=4, state_every=3, noise_std=0.02, queue_depth=2)
    first = Trainer(cfg, [CrashAt(5)], target=target, examples=list(examples))
    with pytest.raises(Crash):
        first.train()
    states = list_training_states(first.state_dir)
    assert [p.name for p in states] == ["state-00000003.pt"]  # saved at 3; crashed during step 5's hooks

    second = Trainer(cfg.replace(resume="auto"), target=target, examples=list(examples))
    assert second.step == 3 and second.data_position == 3
    resumed = second.train()
    assert resumed.start_step == 3 and resumed.step == 8
    assert resumed.losses == full_summary.losses[3:]  # bit-identical continuation
    for k, v in full.drafter.state_dict().items():
        assert torch.equal(v, second.drafter.state_dict()[k]), k
    # the step-4 checkpoint published before the crash is kept, not re-published
    steps = [int(read_manifest(p)["step"]) for p in list_checkpoints(second.run_dir)]
    assert steps == [4, 8]


def test_resume_refuses_a_different_drafter(tmp_path):
    target, examples = target_and_examples()
    cfg = small_config(tmp_path, max_steps=2, publish_every=2)
    Trainer(cfg, target=target, examples=list(examples)).train()
    with pytest.raises(ValueError, match="different drafter"):
        Trainer(cfg.replace(resume="auto", max_steps=4, block_size=4), target=target, examples=list(examples))
    with pytest.raises(ValueError, match="already has published"):
        Trainer(cfg.replace(max_steps=4), target=target, examples=list(examples))


def test_corrupt_state_is_a_clear_error(tmp_path):
    bad = tmp_path / "state-00000001.pt"
    bad.write_bytes(b"not a torch file")
    with pytest.raises(TrainStateError, match="cannot read"):
        load_training_state(bad)
    with pytest.raises(TrainStateError, match="not found"):
        load_training_state(tmp_path / "missing.pt")
    (tmp_path / "empty").mkdir()
    with pytest.raises(TrainStateError, match="no state"):
        load_training_state(tmp_path / "empty")


class Recorder:
    def __init__(self):
        self.events = []

    def on_step_end(self, trainer, step, metrics):
        self.events.append(("step", step, metrics["loss"]))

    def on_checkpoint_published(self, trainer, step, path, manifest):
        assert (Path(path) / MARKER_NAME).is_file()  # marker present when the hook runs
        load_drafter(path)  # and the checkpoint is loadable
        self.events.append(("published", step, manifest["train_metrics"]))

    def on_train_end(self, trainer):
        self.events.append(("end",))


class Protector:
    def __init__(self, keep_step):
        self.keep_step = keep_step

    def protects(self, path):
        return path.name == f"step-{self.keep_step:08d}"


class PinStep2:
    def on_checkpoint_published(self, trainer, step, path, manifest):  # as an eval hook does, before retention
        if step == 2 and (path / MARKER_NAME).exists():
            pin_checkpoint(path, "eval-job")


class Broken:
    def on_step_end(self, trainer, step, metrics):
        raise RuntimeError("hook bug")


def test_hooks_order_metrics_and_retention(tmp_path):
    target, examples = target_and_examples()
    rec = Recorder()
    cfg = small_config(tmp_path, max_steps=10, publish_every=2, keep_last=2)
    trainer = Trainer(cfg, [Broken(), rec, Protector(4), PinStep2()], target=target, examples=list(examples))
    run_dir = trainer.run_dir
    summary = trainer.train()
    steps = [e[1] for e in rec.events if e[0] == "step"]
    assert steps == list(range(1, 11))  # a broken hook does not stop training
    published = [e for e in rec.events if e[0] == "published"]
    assert [e[1] for e in published] == [2, 4, 6, 8, 10]
    assert set(published[-1][2]) >= {"loss", "accuracy", "streak"} and published[-1][2]["loss"] > 0
    assert rec.events[-1] == ("end",)
    kept = [p.name for p in list_checkpoints(run_dir)]
    assert kept == ["step-00000002", "step-00000004", "step-00000008", "step-00000010"]  # pinned, protected, last 2
    assert len(summary.checkpoints) == 5
