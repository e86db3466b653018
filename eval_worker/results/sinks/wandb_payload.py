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
``accept_rate@<i>``, ``verify_rate``). The scalars and every name are ``sinks/names.py``'s, shared by
every sink; this module adds what only W&B shows (histograms, plots, tables, the HF step key).
"""
from __future__ import annotations

import html

import numpy as np

from eval_worker.results.sinks.names import aliases, finite, sampled, scalars, suite_prefix

STEP_KEY = "train/step"
# HF Trainer's x-axis: the same number (its state.global_step is the step the callback
# publishes), logged too so a panel of an HF run's group plots both runs on one axis.
HF_STEP_KEY = "train/global_step"
MARK_OPEN, MARK_CLOSE = "\u27e6", "\u27e7"  # ⟦ ⟧: rare in code, unlike brackets


def prefix_for(suite_name: str, primary_suite: str | None) -> str:
    """Where a result's full payload goes: plain ``eval/`` for the primary suite, else its own prefix."""
    if primary_suite is None or suite_name == primary_suite:
        return "eval/"
    return suite_prefix(suite_name)


def run_log(result: dict, primary_suite: str | None, *, html_column: bool = True, series=None) -> dict:
    """The ``run.log()`` payload of one result in a run of several suites: the full payload
    under ``prefix_for``, and the suite's scalars under ``eval/<suite>/`` when that is not the same.
    With `series` (run_results.series_of), the series' label stands for the suite's name and its
    `primary` flag for the comparison with `primary_suite`."""
    name = series.label if series is not None else result["suite"]["name"]
    prefix = ("eval/" if series.primary else suite_prefix(name)) if series is not None else prefix_for(name,
                                                                                                      primary_suite)
    payload = log_dict(result, prefix, html_column=html_column)
    if prefix != suite_prefix(name):
        payload.update(scalars(result, suite_prefix(name)))
    payload.update(aliases(result, suite_prefix(name)))  # the field's names beside ours
    return payload


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
            payload[f"{prefix}t{tkey}/accept_hist"] = wandb.Histogram(np_histogram=(np.asarray(thist),
                                                                                     np.asarray(edges)))
    if hist:
        edges = [k + 0.5 for k in range(len(hist) + 1)]  # bins centred on accept lengths 1..B
        payload[prefix + "accept_hist"] = wandb.Histogram(np_histogram=(np.asarray(hist), np.asarray(edges)))
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

    columns: list[str | int] = ["train_step", "prompt", "tau", "baseline_tau", "verify_steps", "reference_marked"]
    if html_column:
        columns.append("reference_html")
    rows = []
    for p in result.get("prompts") or []:
        text = str(p.get("reference_text") or "")
        row = [step, str(p.get("name")), finite(p.get("tau")), finite(p.get("baseline_tau")),
               len(p.get("accept_lengths") or []), marked_text(text, p.get("accepted_spans"))]
        if html_column:
            row.append(wandb.Html(marked_html(text, p.get("accepted_spans")), inject=False))
        rows.append(row)
    payload[prefix + "prompts"] = wandb.Table(columns=columns, data=rows)
    return payload
