"""Train a DFlash drafter with `transformers.Trainer`; `DFlashEvalCallback` queues an eval of each save.

The loss is the project's own: target features and greedy labels from `Target.forward`,
anchors from `sample_anchors`, block labels from `block_labels`, the weighted `block_loss`.
The target stays outside the HF model's module tree, so HF trains and saves the drafter alone.

    python examples/hf_trainer_dflash.py --target dflash_train/assets/tiny_target --out runs \\
        --max-steps 40 --save-steps 20 [--redis-url redis://...] [--report-to wandb]
    dflash-eval worker --checkpoint-root runs --target dflash_train/assets/tiny_target
"""
from __future__ import annotations

import argparse

import torch
from torch import nn
from transformers import Trainer, TrainingArguments

from dflash_train.core.config import DrafterConfig
from dflash_train.core.model import DFlashDrafter
from dflash_train.core.target import Target
from dflash_train.training.anchors import block_labels, sample_anchors
from dflash_train.training.data import stdlib_code_prompts
from dflash_train.training.loss import block_loss
from hooks import DFlashEvalCallback


class DFlashLoss(nn.Module):
    def __init__(self, target: Target, drafter: DFlashDrafter, num_anchors: int):
        super().__init__()
        self.drafter, self.num_anchors = drafter, num_anchors
        self._target = [target]  # a list: not a submodule, so neither trained nor saved

    def forward(self, input_ids, loss_mask, seed):
        target, cfg = self._target[0], self.drafter.config
        out = target.forward(input_ids, cfg.target_layer_ids)  # no grad: features and final hidden
        pred = target.greedy_tokens(out.last_hidden)  # the target's own next tokens are the labels
        anchors, valid = (t.to(input_ids.device) for t in sample_anchors(loss_mask, self.num_anchors, seed.tolist()))
        hidden = self.drafter.forward_blocks(target.parts.embed_tokens, input_ids, out.features, anchors, valid)
        labels, mask = block_labels(pred, anchors, valid, loss_mask, cfg.block_size)
        return {"loss": block_loss(hidden, target.parts.lm_head, labels, mask).loss}


def main(argv=None) -> DFlashEvalCallback:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True)
    p.add_argument("--out", required=True, help="checkpoint root of the published drafters (a worker root)")
    p.add_argument("--run-name", default="hf-dflash")
    p.add_argument("--max-steps", type=int, default=40)
    p.add_argument("--save-steps", type=int, default=20, help="HF saves; each one is published and evaluated")
    p.add_argument("--block-size", type=int, default=8)
    p.add_argument("--suite", default="builtin:coding-v1")
    p.add_argument("--redis-url", default=None)
    p.add_argument("--report-to", default="none", help="HF report_to (wandb: the evals join its run's group)")
    a = p.parse_args(argv)

    target = Target.load(a.target)
    cfg = DrafterConfig.for_target(target.model.config, mask_token_id=target.mask_token_id(),
                                   num_hidden_layers=1, num_features=2, block_size=a.block_size)
    model = DFlashLoss(target, DFlashDrafter(cfg), num_anchors=8)
    rows = [{"input_ids": torch.tensor(ex.ids), "loss_mask": torch.ones(len(ex.ids), dtype=torch.bool), "seed": i}
            for i, ex in enumerate(stdlib_code_prompts(target.tokenizer, 64, prompt_tokens=64)) if len(ex.ids) == 64]
    callback = DFlashEvalCallback(a.out, run_id=a.run_name, every_n_steps=a.save_steps, suite=a.suite,
                                  target=a.target, redis_url=a.redis_url)
    args = TrainingArguments(output_dir=f"{a.out}/.hf-{a.run_name}", run_name=a.run_name, max_steps=a.max_steps,
                             per_device_train_batch_size=4, learning_rate=3e-3, save_strategy="steps",
                             save_steps=a.save_steps, save_only_model=True, logging_steps=min(5, a.save_steps),
                             report_to=a.report_to,
                             use_cpu=not torch.cuda.is_available(), dataloader_num_workers=0)
    Trainer(model=model, args=args, train_dataset=rows, callbacks=[callback]).train()
    return callback


if __name__ == "__main__":
    main()
