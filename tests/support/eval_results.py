"""Realistic `dflash-eval-result/1` dicts (docs/design.md "Eval result") and ledger files for sink/report tests.

Every number is derived from simulated per-prompt verify steps, so the histogram, the
per-position curves, τ, the CI and the character spans agree with each other.
"""
from __future__ import annotations

import json
import math
import random
from pathlib import Path

PROMPTS = {
    "fizzbuzz": "def fizzbuzz(n):\n    for i in range(1, n + 1):\n        if i % 15 == 0:\n            "
                "print('FizzBuzz')\n",
    "html <escape> & \"quotes\"": "<script>alert('x')</script> & <b>bold</b> should stay text, not markup.\n",
    "binary_search": "def search(xs, t):\n    lo, hi = 0, len(xs)\n    while lo < hi:\n        mid = (lo + hi) // 2\n",
    "unicode": "Résumé — naïve café, 東京, emoji 🙂 and tabs\tare fine.\n",
}


def _accept_lengths(rng: random.Random, p: float, block: int, n: int) -> list[int]:
    out = []
    for _ in range(n):
        k = 1
        while k < block and rng.random() < p:
            k += 1
        out.append(k)
    return out


def _spans(text: str, lengths: list[int]) -> list[list[int]]:
    """One char span per verify step; pretend a token is ~3 characters."""
    spans, pos = [], 0
    for n in lengths:
        if pos >= len(text):
            break
        end = min(len(text), pos + 3 * n)
        spans.append([pos, end])
        pos = end
    return spans


def make_result(run_id: str = "run-a", step: int = 100, *, p: float = 0.6, block_size: int = 16,
                baseline_tau: float | None = None, seed: int | None = None, checkpoint_root: str = "/ckpt",
                suite: str = "coding", suite_fp: str | None = None, digest: str | None = None) -> dict:
    rng = random.Random(seed if seed is not None else step)
    prompts, pooled = [], []
    hist = [0] * block_size
    reached = [0] * block_size  # reached[k]: steps whose draft got to slot k
    accepted = [0] * block_size
    for name, text in PROMPTS.items():
        lengths = _accept_lengths(rng, p, block_size, 12)
        pooled += lengths
        for n in lengths:
            hist[n - 1] += 1
            for k in range(1, min(n + 1, block_size)):
                reached[k] += 1
                accepted[k] += k < n
        tau = sum(lengths) / len(lengths)
        prompts.append({"name": name, "tau": round(tau, 4), "accept_lengths": lengths,
                        "baseline_tau": None if baseline_tau is None else round(baseline_tau + rng.uniform(-0.3, 0.3),
                                                                                4),
                        "reference_text": text, "accepted_spans": _spans(text, lengths)})
    macro = sum(q["tau"] for q in prompts) / len(prompts)
    sd = math.sqrt(sum((q["tau"] - macro) ** 2 for q in prompts) / max(1, len(prompts) - 1))
    half = 1.96 * sd / math.sqrt(len(prompts))
    cond = [accepted[k] / reached[k] if reached[k] else 0.0 for k in range(1, block_size)]
    base = None
    if baseline_tau is not None:
        d = macro - baseline_tau
        base = {"checkpoint": f"{checkpoint_root}/{run_id}/step-00000000", "tau": baseline_tau,
                "delta_tau": round(d, 4), "delta_ci95": [round(d - 0.3, 4), round(d + 0.3, 4)]}
    digest = digest or f"{step:064x}"
    return {
        "schema": "dflash-eval-result/1",
        "checkpoint": {"path": f"{checkpoint_root}/{run_id}/step-{step:08d}", "digest": digest, "run_id": run_id,
                       "step": step},
        "target": {"path": "/targets/tiny", "fingerprint": "f" * 16, "num_layers": 8, "dtype": "float32"},
        "suite": {"name": suite, "version": "1",
                  "fingerprint": suite_fp or ("abcd1234" if suite == "coding" else "ef567890"),
                  "num_prompts": len(prompts)},
        "settings": {"block_size": block_size, "max_new_tokens": 128, "mode": "online", "tree_budget": 8},
        "tau": {"macro": round(macro, 4), "pooled": round(sum(pooled) / len(pooled), 4),
                "ci95": [round(macro - half, 4), round(macro + half, 4)], "num_steps": len(pooled)},
        "acceptance_histogram": hist,
        "per_position": {"conditional_accept": [round(c, 4) for c in cond],
                         "top1_accuracy": [round(min(1.0, c * 1.05), 4) for c in cond]},
        "mean_streak_all_anchors": round(max(0.0, macro - 1.1), 4),
        "tree": {"budget": 8, "tau": round(macro + 0.4, 4)},
        "speedup": {"draft_verify_cost_ratio": 0.1, "estimated": round(macro / 1.3, 4)},
        "baseline": base,
        "prompts": prompts,
        "diagnostics": [],
        "cache": {"references": "hit", "features": "built", "notes": []},
        "provenance": {"software_version": "0.1.0", "created_at": f"2026-01-01T00:{step % 60:02d}:00+00:00",
                       "timings_s": {"load": 0.1, "draft": 1.2}},
    }


def write_ledger(results_dir: Path, result: dict, attempt: int = 0, train_metrics: dict | None = None,
                 options: dict | None = None, queue: dict | None = None) -> Path:
    """Record ``result`` through the real ledger, as the worker does (with the job's `options` and the
    queue's view, eval lag included, when given); returns the record path."""
    from eval_worker.results.ledger import Ledger
    from eval_worker.service.jobs.schema import validate_job

    ck = result["checkpoint"]
    job = {"schema": "dflash-eval-job/1", "run_id": ck["run_id"], "step": ck["step"], "checkpoint": ck["path"],
           "checkpoint_digest": ck["digest"], "suite": f"builtin:{result['suite']['name']}-v1", "attempt": attempt,
           "train_metrics": train_metrics, "options": options}
    variant = "" if not options else "-" + "-".join(f"{k}{v}" for k, v in sorted(options.items()))
    target = (result.get("target") or {}).get("fingerprint") or ""
    variant += f"-{target[:6]}" if target and target != "f" * 16 else ""  # another target: another job
    job_id = f"eval-{ck['run_id']}-{ck['step']}-{ck['digest'][:12]}-{result['suite']['fingerprint'][:8]}{variant}"
    path, _, _ = Ledger(results_dir).write(job=validate_job(job), job_id=job_id + (f"-r{attempt}" if attempt else ""),
                                           result=result, queue=queue)
    return path


def fake_checkpoint(checkpoint_root: Path, run_id: str, step: int) -> tuple[Path, str]:
    """A published checkpoint directory with a valid COMPLETE.json (the weights are a few
    bytes, the sink only references them); returns (directory, digest)."""
    import hashlib

    d = Path(checkpoint_root) / run_id / f"step-{step:08d}"
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps({"block_size": 16}))
    (d / "model.safetensors").write_bytes(f"weights of {run_id} step {step}".encode())
    sha = {n: hashlib.sha256((d / n).read_bytes()).hexdigest() for n in ("model.safetensors", "config.json")}
    (d / "COMPLETE.json").write_text(json.dumps({
        "format": "dflash-checkpoint/1", "run_id": run_id, "step": step, "digest": sha["model.safetensors"],
        "files": sha, "config": {"block_size": 16}, "created_at": "2026-01-01T00:00:00+00:00",
        "train_metrics": {"loss": 1.0}}))
    return d, sha["model.safetensors"]
