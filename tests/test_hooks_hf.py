"""The Hugging Face `TrainerCallback` adapter inside a real `transformers.Trainer` run."""
from __future__ import annotations

import torch
from torch import nn

from dflash_train.checkpoint import load_drafter
from dflash_train.publication import list_checkpoints, read_manifest, verify_checkpoint
from eval_worker.service.queue import get_queue
from eval_worker.service.redis_local import connect
from hooks import DFlashEvalCallback
from tests.factories import drafter_for, qwen3_target


class DrafterWrapper(nn.Module):
    """Stands for a user's HF training model that holds the drafter as `.drafter`."""

    def __init__(self, drafter):
        super().__init__()
        self.drafter = drafter

    def forward(self, x=None, labels=None):
        w = self.drafter.fc.weight
        loss = ((w.sum(dim=1)[: x.shape[1]] * x).mean() - 1.0) ** 2
        return {"loss": loss}


class Rows(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return {"x": torch.randn(8, generator=g)}


def test_on_save_publishes_the_drafter_and_queues_its_eval(tmp_path, redis_url):
    from transformers import Trainer, TrainingArguments

    drafter = drafter_for(qwen3_target(layers=6, hidden=32), layers=1, features=2)
    model = DrafterWrapper(drafter)
    cb = DFlashEvalCallback(tmp_path / "ckpts", run_id="hf-run", every_n_steps=2, suite="builtin:coding-v1",
                            redis_url=redis_url)
    args = TrainingArguments(output_dir=str(tmp_path / "hf"), max_steps=5, save_strategy="steps", save_steps=2,
                             per_device_train_batch_size=2, learning_rate=1e-2, report_to=[], use_cpu=True,
                             logging_steps=1, disable_tqdm=True, dataloader_num_workers=0)
    Trainer(model=model, args=args, train_dataset=Rows(), callbacks=[cb]).train()

    published = list_checkpoints(tmp_path / "ckpts" / "hf-run")
    assert [read_manifest(p)["step"] for p in published] == [2, 4]
    for p in published:
        verify_checkpoint(p)  # complete, digests match
    assert "loss" in read_manifest(published[-1])["train_metrics"]
    # the step-4 checkpoint is the drafter as it was at step 4 (the snapshot, not later weights)
    saved = load_drafter(published[-1])
    assert saved.config.to_dict() == drafter.config.to_dict()
    assert not torch.equal(saved.fc.weight, drafter.fc.weight)  # training went on to step 5 afterwards
    conn = connect(redis_url)
    jobs = get_queue(conn, "dflash-eval").jobs
    assert sorted(j.args[0]["step"] for j in jobs) == [2, 4]
    assert {j.args[0]["requested_by"] for j in jobs} == {"hook"} and not cb.errors and not cb.hook.errors
    conn.close()
