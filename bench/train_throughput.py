"""Trainer throughput with the hidden-state queue on vs off, measured side by side.

    python bench/train_throughput.py [--target builtin:tiny-target|random] [--steps 30] [--depth 2]
                                     [--device cpu|cuda] [--backend auto|flex|sdpa]

Runs the same steps (same data, same seed) at queue depth 0 (target forward and drafter
step in turn) and at --depth (target forward in a producer thread), and prints target
tokens/s for both, their ratio and the consumer's wait fraction (the share of the
training loop spent waiting for hidden states). The first --warmup steps are excluded.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

from dflash_train.training.train_config import TrainConfig  # noqa: E402
from dflash_train.training.trainer import Trainer  # noqa: E402


class StepClock:
    def __init__(self):
        self.times, self.tokens = [], []

    def on_step_end(self, trainer, step, metrics):
        self.times.append(time.perf_counter())
        self.tokens.append(metrics["tokens"])


def random_setup(args):
    from dflash_train.training.data import Example, regenerate
    from tests.support.factories import MASK_ID, qwen3_target

    target = qwen3_target(layers=8, hidden=args.random_hidden)
    if args.device == "cuda":
        target.model.to("cuda")
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(1, MASK_ID, (64,), generator=g).tolist() for _ in range(64)]
    responses = regenerate(target, prompts, 128, batch_size=64)
    return target, [Example(p + r, len(p)) for p, r in zip(prompts, responses, strict=True)], MASK_ID


def run(args, depth, target, examples, mask_id, root):
    cfg = TrainConfig(target=args.target, device=args.device, backend=args.backend, queue_depth=depth,
                      max_steps=args.steps, batch_size=args.batch_size, num_anchors=args.num_anchors,
                      block_size=16, drafter_layers=args.drafter_layers, num_features=3, mask_token_id=mask_id,
                      data=args.data, num_prompts=args.num_prompts, max_new_tokens=96, max_seq_len=256,
                      checkpoint_root=str(root), run_id=f"bench-d{depth}", publish_every=10**6,
                      progress=False, resume="never", data_cache_dir=str(Path(root) / "cache"), log_every=10**6,
                      num_threads=args.threads)
    clock = StepClock()
    trainer = Trainer(cfg, [clock], target=target, examples=examples)
    summary = trainer.train()
    w = args.warmup
    dt = clock.times[-1] - clock.times[w - 1]
    toks = sum(clock.tokens[w:])
    return {"depth": depth, "tokens_per_s": toks / dt, "step_ms": 1000 * dt / (len(clock.times) - w),
            "consumer_wait_fraction": summary.queue_health["consumer_wait_fraction"],
            "producer_wait_fraction": summary.queue_health["producer_wait_fraction"],
            "final_loss": summary.losses[-1]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--target", default="builtin:tiny-target", help="model dir, builtin:tiny-target, or random")
    ap.add_argument("--data", default="builtin:stdlib-mix")
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--depth", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--num-anchors", type=int, default=16)
    ap.add_argument("--drafter-layers", type=int, default=1)
    ap.add_argument("--random-hidden", type=int, default=256)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target, examples, mask_id = (random_setup(args) if args.target == "random" else (None, None, None))
    with tempfile.TemporaryDirectory() as root:
        if target is None:  # load once, share between both runs
            from dflash_train.core.target import Target
            from dflash_train.training.trainer import resolve_target_path
            dtype = "bfloat16" if args.device == "cuda" else "float32"
            target = Target.load(resolve_target_path(args.target), dtype=dtype, device=args.device)
        results = [run(args, d, target, examples, mask_id, root) for d in (0, args.depth)]
    off, on = results
    for r in results:
        print(f"queue depth {r['depth']}: {r['tokens_per_s']:9.0f} target tok/s  {r['step_ms']:7.1f} ms/step  "
              f"consumer wait {r['consumer_wait_fraction']:.2f}  producer wait {r['producer_wait_fraction']:.2f}")
    print(f"queue on / off throughput ratio: {on['tokens_per_s'] / off['tokens_per_s']:.2f}x "
          f"(same data; final losses {off['final_loss']:.4f} vs {on['final_loss']:.4f})")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))


if __name__ == "__main__":
    main()
