#!/usr/bin/env bash
# GPU smoke test for the trainer (run on a CUDA machine; ~2-4 minutes):
#   1. a few training steps with compiled flex_attention vs the dense SDPA twin, same data:
#      the losses must agree to bf16 precision;
#   2. throughput with the hidden-state queue off vs on (CUDA streams + events), compiled flex.
# Usage: bench/gpu_smoke.sh [target]   (builtin:tiny-target (default), random, or a model dir)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
TARGET=${1:-builtin:tiny-target}
export TOKENIZERS_PARALLELISM=false

"$PY" - "$TARGET" <<'PYEOF'
import sys, tempfile, time
import torch
assert torch.cuda.is_available(), "bench/gpu_smoke.sh needs a CUDA device"
print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
sys.path.insert(0, ".")
from dflash_train.training.train_config import TrainConfig
from dflash_train.training.trainer import Trainer

target_arg = sys.argv[1]
target = examples = mask_id = None
if target_arg == "random":
    from bench.train_throughput import random_setup

    class A:
        device, random_hidden = "cuda", 1024
    target, examples, mask_id = random_setup(A)
losses = {}
with tempfile.TemporaryDirectory() as root:
    for backend in ("sdpa", "flex"):
        cfg = TrainConfig(target=target_arg, device="cuda", backend=backend, max_steps=6, batch_size=4, num_anchors=16,
                          num_features=3, mask_token_id=mask_id, num_prompts=32, max_new_tokens=64,
                          data="builtin:stdlib-mix", checkpoint_root=root, run_id=f"smoke-{backend}", publish_every=3,
                          progress=False, resume="never", data_cache_dir=f"{root}/cache", queue_depth=2)
        t = time.perf_counter()
        tr = Trainer(cfg, target=target, examples=examples)
        target, examples = tr.target, tr.examples
        s = tr.train()
        torch.cuda.synchronize()
        losses[backend] = s.losses
        print(f"{backend}: {len(s.losses)} steps in {time.perf_counter() - t:.1f}s (first includes compile); "
              f"losses {[round(x, 4) for x in s.losses]}; published {len(s.checkpoints)}", flush=True)
diff = max(abs(a - b) for a, b in zip(losses["sdpa"], losses["flex"]))
print(f"max |loss(flex) - loss(sdpa)| over 6 steps: {diff:.4f}")
assert diff < 0.05 * max(losses["sdpa"]), "flex and SDPA training disagree"
PYEOF

"$PY" bench/train_throughput.py --device cuda --backend flex --target "$TARGET" --steps 40 --warmup 5 \
    --batch-size 8 --num-anchors 64 --depth 2 --threads 4 --random-hidden 1024
