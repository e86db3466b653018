"""Training step time with the eval hook (publish + enqueue every N steps) vs without.

    python bench/hook_overhead.py [--steps 200] [--every 20] [--repeats 2] [--target random|DIR]

Runs the real dflash_train trainer on the same data and seed in three settings,
interleaved `--repeats` times so machine noise hits all of them alike:

- `no hook`     : no eval hook; checkpoints published only at the end (publish_every = steps);
- `publish only`: a checkpoint published every `--every` steps (CPU snapshot on the training
                  thread, write + hash in the publisher thread), no hook;
- `hook`        : the same plus `EvalOnCheckpoint` queueing each eval on a real local
                  redis-server (no worker runs, so nothing else competes for the CPU);
- `redis down`  : the same, but Redis unreachable (every job goes to the outbox).

On a shared machine, step times drift by tens of percent between runs, far more than the
effect measured here, so the headline is an in-run, paired estimate: for every checkpoint
at step k, the time of the `--window` steps after it (snapshot, enqueue, and the background
write competing for the CPU) minus the time of the `--window` steps before it; the mean
excess per checkpoint divided by `every x median step` is the overhead, and
1 + overhead is the step-time ratio with vs without (goal <= 1.02). The same estimate in the
`no hook` runs (where nothing happens at those steps) shows the estimator's noise. Also
printed: ratio of mean step times across the interleaved runs (noisy), the longest stall on
a checkpoint step (its time minus the median of the steps before it) and the longest time
spent inside the hook's callbacks. The first `--warmup` steps are excluded.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
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
        self.times: list[float] = []

    def on_step_end(self, trainer, step, metrics):
        self.times.append(time.perf_counter())


class TimedHook:
    """Wraps EvalOnCheckpoint to time its callbacks on the training thread."""

    def __init__(self, hook):
        self.hook, self.callback_s = hook, []

    def on_checkpoint_published(self, *a):
        t0 = time.perf_counter()
        self.hook.on_checkpoint_published(*a)
        self.callback_s.append(time.perf_counter() - t0)

    def protects(self, path):
        t0 = time.perf_counter()
        try:
            return self.hook.protects(path)
        finally:
            self.callback_s.append(time.perf_counter() - t0)

    def on_train_end(self, trainer):
        self.hook.on_train_end(trainer)


def setup(args):
    if args.target == "random":
        from dflash_train.training.data import Example, regenerate
        from tests.support.factories import MASK_ID, qwen3_target

        target = qwen3_target(layers=8, hidden=args.hidden)
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(1, MASK_ID, (48,), generator=g).tolist() for _ in range(64)]
        responses = regenerate(target, prompts, 96, batch_size=64)
        return target, [Example(p + r, len(p)) for p, r in zip(prompts, responses, strict=True)], MASK_ID
    from dflash_train.core.target import Target
    from dflash_train.training.trainer import resolve_target_path

    return Target.load(resolve_target_path(args.target), dtype="float32"), None, None


def run(args, mode, target, examples, mask_id, root, redis_url, suite):
    from hooks import EvalOnCheckpoint

    every = args.steps if mode == "no hook" else args.every
    cfg = TrainConfig(target="unused", max_steps=args.steps, batch_size=args.batch_size, num_anchors=args.num_anchors,
                      block_size=16, drafter_layers=1, num_features=3, mask_token_id=mask_id, max_seq_len=256,
                      checkpoint_root=str(root), run_id=f"bench-{mode.replace(' ', '-')}-{time.time_ns()}",
                      publish_every=every, keep_last=0, progress=False, resume="never", log_every=10**6,
                      data_cache_dir=str(Path(root) / "cache"), num_threads=args.threads, data=args.data)
    clock = StepClock()
    callbacks = [clock]
    timed = None
    if mode in ("hook", "redis down"):
        url = redis_url if mode == "hook" else "redis://127.0.0.1:9/0"  # port 9: nothing listens
        timed = TimedHook(EvalOnCheckpoint(every_n_steps=args.every, suite=suite, redis_url=url,
                                           train_end_timeout=2.0, connect_timeout=0.5))
        callbacks.append(timed)
    Trainer(cfg, callbacks, target=target, examples=examples).train()
    w = args.warmup
    # steps[i]: step i+2 (after i+1's end)
    steps = [b - a for a, b in zip(clock.times[:-1], clock.times[1:], strict=False)]
    W, excess, stalls = args.window, [], []
    for k in range(args.every, args.steps - W, args.every):  # checkpoints at k (or would-be, for `no hook`)
        before = steps[k - 1 - W:k - 1]                          # steps k-W+1 .. k
        after = steps[k - 1:k - 1 + W]                           # steps k+1 .. k+W
        if k - 1 - W < w:
            continue
        excess.append(sum(after) - sum(before))
        stalls.append(after[0] - statistics.median(before))
    return {"mode": mode, "steps": steps[w:], "excess": excess, "stalls": stalls,
            "callback_max_s": max(timed.callback_s) if timed and timed.callback_s else 0.0,
            "outcomes": [o.status for o in timed.hook.outcomes] if timed else [],
            "errors": len(timed.hook.errors) if timed else 0}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="random", help="random (a small random Qwen3) or a model directory")
    ap.add_argument("--data", default="builtin:stdlib-code")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--every", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--window", type=int, default=5, help="steps after/before each checkpoint compared")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--num-anchors", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    from eval_worker.service.local_redis.server import LocalRedis

    target, examples, mask_id = setup(args)
    modes = ["no hook", "publish only", "hook", "redis down"]
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory() as tmp, LocalRedis(Path(tmp) / "redis") as redis:
        suite = Path(tmp) / "suite.jsonl"
        suite.write_text('{"suite": "bench", "version": "1", "chat_template": false}\n'
                         '{"name": "a", "ids": [1, 2, 3]}\n')
        for r in range(args.repeats):
            for m in (modes if r % 2 == 0 else modes[::-1]):
                runs[m].append(run(args, m, target, examples, mask_id, Path(tmp) / "ck", redis.url, str(suite)))
                print(f"  repeat {r + 1} {m:12s}: mean {1000 * statistics.mean(runs[m][-1]['steps']):.1f} ms/step",
                      flush=True)
    summary = {}
    for m in modes:
        steps = [dt for r in runs[m] for dt in r["steps"]]
        excess = [e for r in runs[m] for e in r["excess"]]
        stalls = [x for r in runs[m] for x in r["stalls"]]
        med = statistics.median(steps)
        overhead = statistics.mean(excess) / (args.every * med) if excess else 0.0
        sem = (statistics.stdev(excess) / len(excess) ** 0.5 / (args.every * med)) if len(excess) > 1 else 0.0
        summary[m] = {"mean_ms": 1000 * statistics.mean(steps), "median_ms": 1000 * med,
                      "paired_ratio": 1 + overhead, "paired_ratio_sem": sem, "events": len(excess),
                      "longest_checkpoint_stall_ms": 1000 * max(stalls) if stalls else 0.0,
                      "callback_max_ms": 1000 * max(r["callback_max_s"] for r in runs[m]),
                      "jobs": sum(len(r["outcomes"]) for r in runs[m]),
                      "hook_errors": sum(r["errors"] for r in runs[m])}
    base = summary["no hook"]
    print(f"\n{args.steps} steps x {args.repeats} repeats, a checkpoint every {args.every} steps, "
          f"window {args.window}, warmup {args.warmup} excluded, {args.threads} thread(s)")
    for m in modes:
        s_ = summary[m]
        print(f"{m:12s}: step median {s_['median_ms']:6.1f} ms | paired ratio {s_['paired_ratio']:.3f} "
              f"(+-{s_['paired_ratio_sem']:.3f}, {s_['events']} checkpoints) | ratio of run means "
              f"{s_['mean_ms'] / base['mean_ms']:.3f} | longest checkpoint-step stall "
              f"{s_['longest_checkpoint_stall_ms']:6.1f} ms | max in hook callback {s_['callback_max_ms']:5.1f} ms"
              f" | jobs {s_['jobs']}")
    h = summary["hook"]
    print(f"step time with the eval hook (publish + enqueue every {args.every} steps) / without: "
          f"{h['paired_ratio']:.3f} +- {h['paired_ratio_sem']:.3f} (goal <= 1.02; estimator noise, no-hook "
          f"control: {base['paired_ratio']:.3f}); longest stall on a checkpoint step "
          f"{h['longest_checkpoint_stall_ms']:.0f} ms")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "summary": summary}, indent=2))


if __name__ == "__main__":
    main()
