"""Target fingerprint cost: streamed file digest rate, cached lookups, in-memory tensor digest.

    python bench/fingerprint_rate.py [--size-gb 2] [--target-gb 54]

Writes a file of random bytes (`--size-gb`), then measures side by side in one run:
  - the first digest of the file (xxh3-128 streamed from the page cache: the hash and the
    copy, not the disk; a cold read is bounded by the disk, see below),
  - sha256 over the same file, the cryptographic alternative, for the ratio,
  - a second lookup of the same file version (the stat-keyed on-disk record),
  - `tensor_digest` over an in-memory tensor of the same size (models with no directory).
and extrapolates the first-digest time to a `--target-gb` target (Qwen3.6-27B in bf16 is
about 54 GB). Prints rates; the ratio xxh3 / sha256 is the stable figure on a shared box.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from dflash_train.core.fingerprint import FileDigests, tensor_digest  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size-gb", type=float, default=2.0)
    ap.add_argument("--target-gb", type=float, default=54.0)
    args = ap.parse_args()
    n = int(args.size_gb * 2**30)
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "weights.bin"
        chunk = os.urandom(64 << 20)
        with open(path, "wb") as f:
            for s in range(0, n, len(chunk)):
                f.write(chunk[: min(len(chunk), n - s)])
        old = time.time() - 60
        os.utime(path, (old, old))
        with open(path, "rb") as f:  # warm the page cache so both hashes read the same way
            while f.read(64 << 20):
                pass
        digests = FileDigests(Path(tmp) / "digests", racy_s=0.0)
        t = time.perf_counter()
        digests.file_digest(path)
        first = time.perf_counter() - t
        t = time.perf_counter()
        h = hashlib.sha256()
        with open(path, "rb") as f:
            while b := f.read(8 << 20):
                h.update(b)
        sha = time.perf_counter() - t
        again = FileDigests(Path(tmp) / "digests")
        t = time.perf_counter()
        again.file_digest(path)
        cached = time.perf_counter() - t
        assert again.hashed_bytes == 0
    x = torch.empty(n // 2, dtype=torch.bfloat16).normal_()
    t = time.perf_counter()
    tensor_digest([("w", x)])
    tens = time.perf_counter() - t
    gb = n / 1e9
    print(f"file of {gb:.2f} GB (page cache), one thread:")
    print(f"  xxh3-128 streamed digest   {gb / first:6.2f} GB/s  ({first:.2f} s)")
    print(f"  sha256 (for comparison)    {gb / sha:6.2f} GB/s  ({sha:.2f} s)  -> xxh3 is {sha / first:.1f}x faster")
    print(f"  same file version again    {cached * 1e3:6.2f} ms (stat + one small JSON record)")
    print(f"  tensor_digest, in memory   {gb / tens:6.2f} GB/s  ({tens:.2f} s)")
    print(f"estimate for a {args.target_gb:.0f} GB target: first load {args.target_gb / (gb / first):.0f} s of hashing "
          f"(more if the disk is slower than {gb / first:.1f} GB/s), later loads ~0 s; "
          f"sha256 would take {args.target_gb / (gb / sha):.0f} s")


if __name__ == "__main__":
    main()
