"""Peak memory of importing a training state: memory-mapped (what `dflash-eval import` does) vs a
plain torch.load, side by side on the same file.

    python bench/import_memory.py [--hidden 1024] [--layers 4] [--optimizer-copies 3]

Writes a hand-written loop's `.pt` in a temporary directory: a drafter of `--layers` layers at
width `--hidden` (fp32) under `model_state_dict`, and `--optimizer-copies` drafter-sized fp32
tensors per parameter under `optimizer_state_dict` (Adam's two moments, a master copy, ...: the
bulk of a real 17 GB training state). Each import runs in a fresh process; its peak RSS above
the process's RSS just before the import is printed, divided by the drafter's size: near 1-2
for the memory-mapped import (the drafter is copied out, then written), near the file's size
for the plain load.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

CHILD = r"""
import json, sys, psutil
from pathlib import Path
import torch
from dflash_train.checkpoints.training_state import import_checkpoint
mode, pt, cfg, into = sys.argv[1:5]
base = psutil.Process().memory_info().rss
if mode == "mmap":
    import_checkpoint(into, "bench", 1, pt, config=cfg)
else:  # what a plain loader does: everything read into memory
    obj = torch.load(pt, map_location="cpu", weights_only=True)
# VmHWM: this process's own peak (ru_maxrss would carry the forking parent's over exec)
peak = next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith("VmHWM:"))
print(json.dumps({"base": base, "peak": peak}))
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--optimizer-copies", type=int, default=3)
    args = ap.parse_args()
    import torch

    from dflash_train.checkpoints.checkpoint import drafter_state_dict, save_drafter
    from dflash_train.core.config import DrafterConfig
    from dflash_train.core.model import DFlashDrafter

    cfg = DrafterConfig(hidden_size=args.hidden, intermediate_size=3 * args.hidden, num_hidden_layers=args.layers,
                        num_attention_heads=16, num_key_value_heads=4, head_dim=args.hidden // 16,
                        vocab_size=args.vocab, num_target_layers=36, target_layer_ids=[1, 9, 17, 25, 33],
                        mask_token_id=args.vocab - 1)
    drafter = DFlashDrafter(cfg)
    sd = drafter_state_dict(drafter)
    drafter_bytes = sum(t.numel() * t.element_size() for t in sd.values())
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        save_drafter(drafter, tmp / "cfg")
        opt = {"state": {i: {f"m{c}": torch.randn_like(t) for c in range(args.optimizer_copies)}
                         for i, t in enumerate(sd.values())}, "param_groups": [{"lr": 1e-4}]}
        pt = tmp / "checkpoint_step1.pt"
        torch.save({"model_state_dict": {f"module.{k}": v for k, v in sd.items()}, "optimizer_state_dict": opt,
                    "step": 1}, pt)
        del opt, drafter, sd
        size = pt.stat().st_size
        print(f"drafter {drafter_bytes / 2**20:.0f} MiB, training state {size / 2**20:.0f} MiB "
              f"({size / drafter_bytes:.1f}x the drafter)")
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
        for mode in ("mmap", "plain"):
            out = subprocess.run([sys.executable, "-c", CHILD, mode, str(pt), str(tmp / "cfg" / "config.json"),
                                  str(tmp / f"into-{mode}")], capture_output=True, text=True, env=env, check=True)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            extra = r["peak"] - r["base"]
            print(f"{mode:5s} import: peak RSS above start {extra / 2**20:7.0f} MiB = {extra / drafter_bytes:.2f}x "
                  f"the drafter, {extra / size:.2f}x the file")


if __name__ == "__main__":
    main()
