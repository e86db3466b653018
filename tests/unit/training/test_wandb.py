"""Optional W&B logging from the trainer: offline, keyed by train/step."""
import time

from dflash_train.training.trainer import Trainer
from tests.support.train_helpers import small_config, target_and_examples
from tests.support.wandb_reader import find_run_files, read_run


def test_trainer_logs_train_metrics_offline(tmp_path, wandb_offline):
    target, examples = target_and_examples()
    cfg = small_config(tmp_path, max_steps=4, log_every=2, wandb=True, wandb_project="p", run_id="wb-run")
    Trainer(cfg, target=target, examples=list(examples)).train()
    deadline = time.time() + 30
    while True:  # the W&B service may still be flushing the log after finish()
        files = find_run_files(wandb_offline)
        run = read_run(files[0]) if len(files) == 1 else None
        if (run is not None and run.group and run.exit_code is not None) or time.time() > deadline:
            break
        time.sleep(0.5)
    assert len(files) == 1
    assert run.group == "wb-run" and run.job_type == "train"
    loss = run.points("train/loss")
    assert sorted(loss) == [2, 4] and all(v > 0 for v in loss.values())
    assert set(run.points("train/acc")) == {2, 4} and set(run.points("train/tokens_per_s")) == {2, 4}
    assert any(m["glob_name"] == "train/*" and m["step_metric"] == "train/step" for m in run.metrics)
