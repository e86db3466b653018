"""Metric names every sink shares: our keys and, beside them, the names other trainers' dashboards plot.

Aliases (docs/design.md, "Metric names and aliases"), per suite under ``eval/<suite>/``:

- ``accept_length``: the pooled τ (Σ accept lengths / verify steps over the suite's prompts), the
  quantity DeepSpec's ``eval/{dataset}/accept_length``, vLLM's mean acceptance length and SGLang's
  ``spec_accept_length`` report; equal to theirs under ``--counting deepspec|vllm|sglang``.
- ``accept_rate@<i>`` (i = 0..B-2, DeepSpec's 0-based names): the share of verify steps whose first
  i + 1 drafts were all accepted, from the accept-length histogram (vLLM's per-position rate).
- ``verify_rate``: pooled τ / B, DeepSpec's accepted-per-verified-token rate (theirs divides by the
  tokens actually proposed, which differs only in a round cut by a stop token).
"""
from __future__ import annotations

from eval_worker.results.sinks.wandb_payload import _num, scalars, suite_prefix

STEP_KEY = "train/step"


def aliases(result: dict) -> dict[str, float]:
    """The field's names for one result, under ``eval/<suite>/``."""
    prefix = suite_prefix(result["suite"]["name"])
    tau = result.get("tau") or {}
    hist = [int(c) for c in result.get("acceptance_histogram") or []]
    block = int((result.get("settings") or {}).get("block_size") or len(hist) or 0)
    out: dict[str, float | None] = {"accept_length": tau.get("pooled")}
    if tau.get("pooled") is not None and block:
        out["verify_rate"] = float(tau["pooled"]) / block
    steps = sum(hist)
    if steps:
        for i in range(len(hist) - 1):  # accept length L means L - 1 drafts accepted
            out[f"accept_rate@{i}"] = sum(hist[i + 1:]) / steps
    return {prefix + k: n for k, v in out.items() if (n := _num(v)) is not None}


def points(result: dict, primary_suite: str | None) -> dict[str, float]:
    """Every scalar of one result as the non-W&B sinks log it: the suite's scalars under
    ``eval/<suite>/``, the primary suite's also under plain ``eval/`` (as W&B does), and the aliases."""
    name = result["suite"]["name"]
    out = scalars(result, suite_prefix(name))
    if primary_suite is None or name == primary_suite:
        out.update(scalars(result, "eval/"))
    out.update(aliases(result))
    return out
