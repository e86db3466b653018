"""Checkpoints through an S3-compatible store: transfer rates, and what pulling costs a job.

    python bench/object_store.py [--mb 256] [--jobs 3] [--json out.json]

The store is a real HTTP server (moto's server mode, started here on a free port), reached
through s3fs exactly as MinIO or S3 would be; moto keeps objects in its own Python process,
so its rates are a floor for this machine, not a figure for a real store.

Part 1, a synthetic checkpoint of `--mb` MB (config.json + random weights bytes):
- local read: `verify_checkpoint` (what a worker on a shared filesystem pays: one sha256 pass);
- upload: `upload_checkpoint` (files, then the marker);
- cold pull: `CheckpointCache.checkout` on an empty cache (download + sha256 of every file);
- warm pull: the same on the filled cache (the second job for that checkpoint).

Part 2, a job: the checkpoint phase of the worker's job (`job_checkpoints.materialize`) for a local path,
a store URL with an empty cache and one cached, fastest of interleaved rounds, for the tiny
target's drafter and the part-1 checkpoint; a whole job with the real engine on the bundled tiny
target (in-process `run_eval_job`, target resident, references cached, no speed estimate)
puts them in proportion: a pulling job = that job - local phase + pull phase.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _median_time(fn, n: int) -> float:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def transfer(tmp: Path, mb: int, repeats: int) -> dict:
    from dflash_train.checkpoints.publication import publish_directory, upload_checkpoint, verify_checkpoint
    from eval_worker.service.worker.checkpoint_cache import CheckpointCache

    def write(d: Path) -> None:
        (d / "config.json").write_text(json.dumps({"architectures": ["DFlashDraftModel"]}))
        with open(d / "model.safetensors", "wb") as f:
            for _ in range(mb):
                f.write(os.urandom(1 << 20))

    local = publish_directory(tmp / "local", "bench", 1, write)
    size = sum(p.stat().st_size for p in local.iterdir()) / 1e6
    t_local = _median_time(lambda: verify_checkpoint(local), repeats)
    uploads = []
    for i in range(repeats):
        t0 = time.perf_counter()
        url = upload_checkpoint(local, f"s3://bench-bucket/runs/bench{i}", verify=False)
        uploads.append(time.perf_counter() - t0)
    t_up = statistics.median(uploads)
    cache_dir = tmp / "cache"

    def cold():
        shutil.rmtree(cache_dir, ignore_errors=True)
        with CheckpointCache(cache_dir, max_bytes=10 * int(size * 1e6)).checkout(url):
            pass

    t_cold = _median_time(cold, repeats)
    cache = CheckpointCache(cache_dir, max_bytes=10 * int(size * 1e6))

    def warm():
        with cache.checkout(url):
            pass

    t_warm = _median_time(warm, repeats)
    return {"mb": round(size, 1), "local_verify_s": t_local, "upload_s": t_up, "upload_mb_s": size / t_up,
            "cold_pull_s": t_cold, "download_mb_s": size / t_cold, "warm_pull_s": t_warm,
            "cold_over_local": t_cold / t_local, "warm_over_local": t_warm / t_local}


def checkpoint_phase(job: dict, roots: list, cache_dir: Path, n: int) -> dict:
    """The checkpoint part of a worker's job (`job_checkpoints.materialize`: confine, read the marker, then
    verify in place, or pull into the cache and verify, or find it cached), fastest of `n`
    interleaved rounds: local path, store URL with an empty cache, store URL cached."""
    from eval_worker.service.jobs.checkpoints import check_checkpoint, materialize
    from eval_worker.service.worker.checkpoint_cache import CheckpointCache

    def phase(j: dict, clear: bool) -> float:
        if clear:
            shutil.rmtree(cache_dir, ignore_errors=True)
        t0 = time.perf_counter()
        check_checkpoint(j, roots)  # the worker's cheap check before anything is loaded
        with materialize(j, roots, CheckpointCache(cache_dir, max_bytes=1 << 40)):
            pass
        return time.perf_counter() - t0

    local_job, url_job = job["local"], job["url"]
    phase(url_job, True)
    times = {"local": [], "cold": [], "cached": []}
    for _ in range(n):
        for kind, j, clear in (("local", local_job, False), ("cold", url_job, True), ("cached", url_job, False)):
            times[kind].append(phase(j, clear))
    return {k: min(v) for k, v in times.items()}


def jobs(tmp: Path, n: int, big: Path | None) -> dict:
    from dflash_train.checkpoints.publication import upload_checkpoint
    from eval_worker.service.jobs.builder import make_job
    from eval_worker.service.worker import evaluators
    from eval_worker.service.worker.eval_job import run_eval_job
    from eval_worker.service.worker.evaluators import WorkerSettings
    from tests.support.sidecar_support import publish_random, tiny_target_drafter_config, write_suite

    target = REPO / "dflash_train" / "assets" / "tiny_target"
    cfg, mask = tiny_target_drafter_config(target)
    root = tmp / "jobs-root"
    ckpt = publish_random(root, "jobs", 1, target_config=cfg, mask_token_id=mask)
    url = upload_checkpoint(ckpt, "s3://bench-bucket/jobs/jobs")
    suite = write_suite(root / "suite.jsonl", n_prompts=2, max_new_tokens=32)
    roots = [root, tmp / "local", "s3://bench-bucket/jobs", "s3://bench-bucket/runs"]
    runs = iter(range(10_000))

    def run(checkpoint: str) -> float:
        # a fresh ledger each time: the same job recorded once is not evaluated again
        # the same target stays loaded: only the settings change
        evaluators.current().configure(WorkerSettings(results_dir=tmp / f"results-{next(runs)}", roots=roots,
                                                      cache_dir=tmp / "eval-cache", default_target=str(target),
                                                      checkpoint_cache_dir=tmp / "job-cache"))
        t0 = time.perf_counter()
        # no speed estimate: it times target and drafter rounds, noise that has nothing to do with the checkpoint
        r = run_eval_job(make_job(checkpoint, suite=str(suite), options={"measure_speed": False}).to_json())
        assert r["recorded_now"], r
        return time.perf_counter() - t0

    run(str(ckpt))  # warm-up: target loaded, references built and cached
    t_job = min(run(str(ckpt)) for _ in range(n))
    out = {"checkpoint_mb": round(sum(p.stat().st_size for p in ckpt.iterdir()) / 1e6, 2), "local_job_s": t_job}
    sizes = [("tiny", ckpt, url)]
    if big is not None:
        sizes.append(("big", big, upload_checkpoint(big, "s3://bench-bucket/runs/big", verify=False)))
    for name, local, remote in sizes:
        ph = checkpoint_phase({"local": make_job(local, suite=str(suite)), "url": make_job(remote, suite=str(suite))},
                              roots, tmp / f"phase-cache-{name}", n)
        out[name] = {"mb": round(sum(p.stat().st_size for p in local.iterdir() if p.is_file()) / 1e6, 1), **ph,
                     # the same job with its checkpoint pulled instead of read locally
                     "job_cold_over_local": (t_job - ph["local"] + ph["cold"]) / t_job,
                     "job_cached_over_local": (t_job - ph["local"] + ph["cached"]) / t_job}
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=256, help="size of the synthetic checkpoint's weights")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--jobs", type=int, default=5, help="jobs per variant in part 2 (0 skips it)")
    ap.add_argument("--no-transfer", action="store_true", help="skip part 1")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args()

    from dflash_train.checkpoints import storage
    from tests.support.s3_server import S3Server

    with tempfile.TemporaryDirectory() as tmp_s:
        tmp = Path(tmp_s)
        server = S3Server(tmp / "moto.log")
        try:
            os.environ.update(server.env())  # this process is the edge: the standard AWS variables
            storage.store_for("s3://bench-bucket").fs.mkdir("bench-bucket")
            out = {}
            if not args.no_transfer:
                out["transfer"] = t = transfer(tmp, args.mb, args.repeats)
                print(f"checkpoint {t['mb']} MB through moto (S3 API over HTTP, localhost):")
                print(f"  local read (sha256 verify) {t['local_verify_s']:.2f} s")
                print(f"  upload                     {t['upload_s']:.2f} s  ({t['upload_mb_s']:.0f} MB/s)")
                print(f"  cold pull (download+verify){t['cold_pull_s']:6.2f} s  ({t['download_mb_s']:.0f} MB/s)"
                      f"  = {t['cold_over_local']:.1f}x the local read")
                print(f"  warm pull (cache hit)      {t['warm_pull_s']:.3f} s  = {t['warm_over_local']:.3f}x the "
                      f"local read")
            if args.jobs:
                big = None if args.no_transfer else next((tmp / "local" / "bench").glob("step-*"))
                out["jobs"] = j = jobs(tmp, args.jobs, big)
                print(f"a job's checkpoint phase (confine, marker, verify or pull), fastest of {args.jobs}; "
                      f"whole job, real engine, tiny target: {j['local_job_s']:.2f} s")
                for name in ("tiny", "big"):
                    if name in j:
                        x = j[name]
                        print(f"  {x['mb']:7.1f} MB: local {x['local']:.3f} s, pulled {x['cold']:.3f} s "
                              f"({x['cold'] / x['local']:.1f}x), cached {x['cached']:.3f} s "
                              f"({x['cached'] / x['local']:.2f}x); a job pulling it takes "
                              f"{x['job_cold_over_local']:.2f}x one reading it locally "
                              f"({x['job_cached_over_local']:.2f}x once cached)")
        finally:
            server.stop()
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
