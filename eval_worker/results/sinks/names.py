"""Metric names every sink shares: our keys (`scalars`, under `suite_prefix`) and, beside them, the names
other trainers' dashboards plot (`aliases`).

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

import math
import re

_SAFE = re.compile(r"[^A-Za-z0-9_.-]+")


def suite_prefix(suite_name: str) -> str:
    """``eval/<suite>/``: where every suite's numbers go."""
    return f"eval/{_SAFE.sub('_', suite_name)}/"


def finite(x) -> float | None:
    """`x` as a float, None when it is missing or not finite (no sink logs NaN or inf)."""
    if x is None:
        return None
    x = float(x)
    return x if math.isfinite(x) else None


def scalars(result: dict, prefix: str = "eval/") -> dict[str, float]:
    """The numeric part of a result (also what the tests read back)."""
    tau = result["tau"]
    ci = tau.get("ci95") or [None, None]
    out = {
        "tau": tau.get("macro"), "tau_pooled": tau.get("pooled"), "tau_ci_low": ci[0], "tau_ci_high": ci[1],
        "num_verify_steps": tau.get("num_steps"),
        "tree_tau": (result.get("tree") or {}).get("tau"),
        "mean_streak": result.get("mean_streak_all_anchors"),
        "speedup_est": (result.get("speedup") or {}).get("estimated"),
        "diagnostic_errors": sum(1 for d in result.get("diagnostics") or [] if d.get("severity") == "error"),
    }
    base = result.get("baseline")
    if base:
        dci = base.get("delta_ci95") or [None, None]
        out.update(baseline_tau=base.get("tau"), delta_tau_vs_baseline=base.get("delta_tau"),
                   delta_tau_ci_low=dci[0], delta_tau_ci_high=dci[1])
    out.update(_per_position(result.get("per_position")))
    for tkey, entry in sampled(result):
        tau = entry.get("tau") or {}
        ci = tau.get("ci95") or [None, None]
        block = {"tau": tau.get("macro"), "tau_pooled": tau.get("pooled"), "tau_ci_low": ci[0],
                 "tau_ci_high": ci[1], "num_verify_steps": tau.get("num_steps"),
                 "mean_streak": entry.get("mean_streak_all_anchors"), "speedup_est": entry.get("speedup_estimated"),
                 **_per_position(entry.get("per_position"))}
        out.update({f"t{tkey}/{k}": v for k, v in block.items()})
    return {prefix + k: n for k, v in out.items() if (n := finite(v)) is not None}


def sampled(result: dict) -> list[tuple[str, dict]]:
    """(temperature key, block) per sampled temperature of a result, in the job's order."""
    by = ((result.get("sampling") or {}).get("by_temperature")) or {}
    return [(str(k), v) for k, v in by.items() if isinstance(v, dict)]


def _per_position(per: dict | None) -> dict:
    out = {}
    for name, key in (("conditional_accept", "pos_accept"), ("top1_accuracy", "pos_top1")):
        for k, v in enumerate((per or {}).get(name) or [], start=1):
            out[f"{key}/{k}"] = v
    return out


def aliases(result: dict, prefix: str | None = None) -> dict[str, float]:
    """The field's names for one result, under ``eval/<suite>/`` (or its series' prefix)."""
    prefix = prefix or suite_prefix(result["suite"]["name"])
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
    return {prefix + k: n for k, v in out.items() if (n := finite(v)) is not None}


def points(result: dict, primary_suite: str | None, series=None) -> dict[str, float]:
    """Every scalar of one result as the non-W&B sinks log it: the series' scalars under
    ``eval/<series>/`` (run_results.series_of; the suite's name in the common case), the primary series'
    also under plain ``eval/`` (as W&B does), and the aliases. Without `series`: the suite is the series."""
    name = series.label if series is not None else result["suite"]["name"]
    primary = series.primary if series is not None else primary_suite is None or name == primary_suite
    out = scalars(result, suite_prefix(name))
    if primary:
        out.update(scalars(result, "eval/"))
    out.update(aliases(result, suite_prefix(name)))
    return out
