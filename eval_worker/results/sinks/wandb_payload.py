"""One eval result -> the dict passed to one ``run.log()`` call.

Everything for a checkpoint goes into a single dict together with ``train/step`` (and
``train/global_step``, the same number under the HF Trainer's name), so
every W&B point (scalars, histogram, tables, plots) carries its x value and lands at the
right place however late it is logged. Keys:

- scalars ``eval/tau`` (macro), ``eval/tau_pooled``, ``eval/tau_ci_low``, ``eval/tau_ci_high``,
  ``eval/tree_tau``, ``eval/mean_streak``, ``eval/speedup_est``, ``eval/num_verify_steps``,
  ``eval/diagnostic_errors``; with a baseline ``eval/baseline_tau``,
  ``eval/delta_tau_vs_baseline``, ``eval/delta_tau_ci_low/high``;
- per-position scalars ``eval/pos_accept/<k>`` and ``eval/pos_top1/<k>`` for slots k = 1..B-1;
- ``eval/accept_hist`` (``wandb.Histogram`` over accept length 1..B),
  ``eval/accept_len_bar`` (``wandb.plot.bar``), ``eval/pos_curve`` (``wandb.plot.line_series``);
- ``eval/prompts`` (``wandb.Table``: step, prompt, τ, baseline τ, verify steps,
  reference with ``⟦…⟧`` around each verify step's committed span, and the same as HTML);
- under sampling (result ``sampling``), per temperature T (``options.temperature_key``: ``t0.7``):
  ``eval/t<T>/tau``, ``tau_pooled``, ``tau_ci_low``, ``tau_ci_high``, ``num_verify_steps``,
  ``mean_streak``, ``speedup_est``, ``pos_accept/<k>``, ``pos_top1/<k>`` and ``eval/t<T>/accept_hist``.

Every suite's result is logged under ``eval/<suite>/...`` (``eval/gsm8k/tau``, ``eval/coding/tau``:
the suites side by side, as the published tables show them, and two suites never share a curve);
the run's primary suite (``$DFLASH_WANDB_PRIMARY_SUITE``, else the first evaluated) is logged
under plain ``eval/...`` too (its scalars also under its own prefix), which keeps the single-suite
keys of earlier versions. Beside them the field's names (``eval/<suite>/accept_length``,
``accept_rate@<i>``, ``verify_rate``: ``sinks/names.py``).
"""
from __future__ import annotations

import html
import math
import re

STEP_KEY = "train/step"
# HF Trainer's x-axis: the same number (its state.global_step is the step the callback
# publishes), logged too so a panel of an HF run's group plots both runs on one axis.
HF_STEP_KEY = "train/global_step"
MARK_OPEN, MARK_CLOSE = "\u27e6", "\u27e7"  # ⟦ ⟧: rare in code, unlike brackets
_SAFE = re.compile(r"[^A-Za-z0-9_.-]+")


def suite_prefix(suite_name: str) -> str:
    """``eval/<suite>/``: where every suite's numbers go."""
    return f"eval/{_SAFE.sub('_', suite_name)}/"


def prefix_for(suite_name: str, primary_suite: str | None) -> str:
    """Where a result's full payload goes: plain ``eval/`` for the primary suite, else its own prefix."""
    if primary_suite is None or suite_name == primary_suite:
        return "eval/"
    return suite_prefix(suite_name)


def run_log(result: dict, primary_suite: str | None, *, html_column: bool = True) -> dict:
    """The ``run.log()`` payload of one result in a run of several suites: the full payload
    under ``prefix_for``, and the suite's scalars under ``eval/<suite>/`` when that is not the same."""
    name = result["suite"]["name"]
    payload = log_dict(result, prefix_for(name, primary_suite), html_column=html_column)
    if prefix_for(name, primary_suite) != suite_prefix(name):
        payload.update(scalars(result, suite_prefix(name)))
    from eval_worker.results.sinks.names import aliases  # the field's names beside ours

    payload.update(aliases(result))
    return payload


def _num(x) -> float | None:
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
    return {prefix + k: n for k, v in out.items() if (n := _num(v)) is not None}


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


def marked_text(text: str, spans: list) -> str:
    """Reference text with each verify step's span wrapped in ⟦…⟧."""
    out, pos = [], 0
    for start, end in _clean_spans(text, spans):
        out.append(text[pos:start])
        out.append(MARK_OPEN + text[start:end] + MARK_CLOSE)
        pos = end
    out.append(text[pos:])
    return "".join(out)


def marked_html(text: str, spans: list) -> str:
    """The same as HTML: alternating highlight per verify step, everything escaped."""
    out, pos = [], 0
    colors = ("#c6efce", "#9fdfb0")
    for i, (start, end) in enumerate(_clean_spans(text, spans)):
        out.append(html.escape(text[pos:start]))
        out.append(f'<span style="background:{colors[i % 2]}">{html.escape(text[start:end])}</span>')
        pos = end
    out.append(html.escape(text[pos:]))
    return '<pre style="white-space:pre-wrap;font-family:monospace">' + "".join(out) + "</pre>"


def _clean_spans(text: str, spans: list) -> list[tuple[int, int]]:
    """Spans clipped to the text, in order, non-overlapping (bad spans are dropped, not fatal)."""
    out, last = [], 0
    for span in spans or []:
        try:
            start, end = int(span[0]), int(span[1])
        except (TypeError, ValueError, IndexError):
            continue
        start, end = max(start, last), min(end, len(text))
        if end > start:
            out.append((start, end))
            last = end
    return out


def log_dict(result: dict, prefix: str = "eval/", *, html_column: bool = True) -> dict:
    """The complete ``run.log()`` payload for one result (needs wandb)."""
    import wandb

    step = int(result["checkpoint"]["step"])
    payload: dict = {STEP_KEY: step, HF_STEP_KEY: step, **scalars(result, prefix)}
    block = int(result.get("settings", {}).get("block_size") or len(result.get("acceptance_histogram") or []))

    hist = [int(c) for c in result.get("acceptance_histogram") or []]
    for tkey, entry in sampled(result):
        thist = [int(c) for c in entry.get("acceptance_histogram") or []]
        if thist:
            edges = [k + 0.5 for k in range(len(thist) + 1)]
            payload[f"{prefix}t{tkey}/accept_hist"] = wandb.Histogram(np_histogram=(thist, edges))
    if hist:
        edges = [k + 0.5 for k in range(len(hist) + 1)]  # bins centred on accept lengths 1..B
        payload[prefix + "accept_hist"] = wandb.Histogram(np_histogram=(hist, edges))
        bar = wandb.Table(columns=["accept_length", "count"], data=[[k, c] for k, c in enumerate(hist, start=1)])
        payload[prefix + "accept_len_bar"] = wandb.plot.bar(bar, "accept_length", "count",
                                                            title=f"accept length, step {step}")
    per = result.get("per_position") or {}
    curves = [(n, [float(v) for v in per.get(n) or []]) for n in ("conditional_accept", "top1_accuracy")]
    curves = [(n, ys) for n, ys in curves if ys]
    if curves:
        payload[prefix + "pos_curve"] = wandb.plot.line_series(
            xs=[list(range(1, len(ys) + 1)) for _, ys in curves], ys=[ys for _, ys in curves],
            keys=[n for n, _ in curves],
            title=f"per-position acceptance, step {step} (B={block})", xname="slot")

    columns = ["train_step", "prompt", "tau", "baseline_tau", "verify_steps", "reference_marked"]
    if html_column:
        columns.append("reference_html")
    rows = []
    for p in result.get("prompts") or []:
        text = str(p.get("reference_text") or "")
        row = [step, str(p.get("name")), _num(p.get("tau")), _num(p.get("baseline_tau")),
               len(p.get("accept_lengths") or []), marked_text(text, p.get("accepted_spans"))]
        if html_column:
            row.append(wandb.Html(marked_html(text, p.get("accepted_spans")), inject=False))
        rows.append(row)
    payload[prefix + "prompts"] = wandb.Table(columns=columns, data=rows)
    return payload
