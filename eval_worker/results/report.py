"""Local HTML report of a training run's evaluations, rebuilt from the results ledger.

One self-contained page (inline CSS, figures embedded as data URIs, no JavaScript, no
network) plus the same figures as PNG files next to it:
τ vs training step with 95% CI bands, τ beside the training metrics of each checkpoint
(loss, accuracy, the trainer's accept length: the train/serve gap) on the same step axis,
per-position acceptance for selected checkpoints, the acceptance-length histogram, the
baseline comparison, τ per suite side by side, a table of every evaluation,
and each prompt's reference text with the span committed by every verify step
highlighted (shade = accepted length). All prompt and completion text is escaped by
Jinja's autoescape; nothing from a result is ever inserted as markup.
"""
from __future__ import annotations

import base64
from dataclasses import dataclass
from pathlib import Path

import markupsafe

from dflash_train.common.fsutil import atomic_write_text
from eval_worker.results import report_figures as figs
from eval_worker.results.run_results import ResultsError, RunResult, load_run, series_of, target_notes

TEMPLATE = "report.html.j2"


@dataclass
class Segment:
    text: str
    css: str = ""  # "" = not in any verify step's span
    title: str = ""


def _shade(n: int | None, block: int) -> str:
    if n is None:
        return "s-unk"
    if n <= 1:
        return "s-0"  # only the target's own token: no draft token accepted
    frac = (n - 1) / max(1, block - 1)
    return "s-1" if frac < 0.2 else "s-2" if frac < 0.5 else "s-3"


def segments(text: str, spans: list, accept_lengths: list | None, block: int) -> list[Segment]:
    """Split ``text`` into plain and highlighted pieces (one per verify step's span)."""
    out, pos = [], 0
    lengths = list(accept_lengths or [])
    for i, span in enumerate(spans or []):
        try:
            start, end = max(int(span[0]), pos), min(int(span[1]), len(text))
        except (TypeError, ValueError, IndexError):
            continue
        if end <= start:
            continue
        if start > pos:
            out.append(Segment(text[pos:start]))
        n = lengths[i] if i < len(lengths) else None
        title = f"verify step {i + 1}: {n} token(s) committed" if n is not None else f"verify step {i + 1}"
        out.append(Segment(text[start:end], f"{_shade(n, block)} {'odd' if i % 2 else 'even'}", title))
        pos = end
    if pos < len(text):
        out.append(Segment(text[pos:]))
    return out


def select_steps(rows: list[RunResult], wanted: list[int] | None) -> list[RunResult]:
    """The checkpoints shown in detail: ``wanted``, else first, best and latest."""
    by_step = {r.step: r for r in rows}
    if wanted:
        missing = [s for s in wanted if s not in by_step]
        if missing:
            raise ResultsError(f"no evaluation at step(s) {missing}; evaluated: {sorted(by_step)}")
        return [by_step[s] for s in wanted]
    best = max(rows, key=lambda r: (r.result["tau"]["macro"], -r.step))
    picked = {rows[0].step, best.step, rows[-1].step}
    return [by_step[s] for s in sorted(picked)]


def _verbatim(text: str):
    """Escape ``text`` and keep carriage returns: HTML parsers turn a raw CR into LF."""
    return markupsafe.Markup(str(markupsafe.escape(text)).replace("\r", "&#13;"))


def _data_uri(png: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(png).decode()


def _fmt_ci(ci) -> str:
    return f"[{ci[0]:.2f}, {ci[1]:.2f}]" if ci and None not in ci else "–"


def _summary_row(r: RunResult, best_key: str, label: str | None = None) -> dict:
    res, base, train = r.result, r.result.get("baseline") or {}, r.train_metrics or {}
    return {"train_loss": train.get("loss"), "train_streak": train.get("streak"), "step": r.step,
            "suite": label or res["suite"]["name"], "attempt": r.attempt, "tau": res["tau"]["macro"],
            "ci": _fmt_ci(res["tau"].get("ci95")), "pooled": res["tau"].get("pooled"),
            "tree": (res.get("tree") or {}).get("tau"), "streak": res.get("mean_streak_all_anchors"),
            "delta": base.get("delta_tau"), "delta_ci": _fmt_ci(base.get("delta_ci95")) if base else "–",
            "speedup": (res.get("speedup") or {}).get("estimated"), "n": res["tau"].get("num_steps"),
            "diag": len(res.get("diagnostics") or []), "best": r.key == best_key,
            # two checkpoints evaluated at one step are two rows: the digest tells them apart
            "digest": str((res.get("checkpoint") or {}).get("digest") or "")[:12]}


def _side_by_side(by_suite: dict[str, list[RunResult]]) -> dict:
    """τ [95% CI] per (checkpoint, suite), one row per checkpoint: the published tables' layout."""
    suites = sorted(by_suite)
    cells: dict[tuple[int, str], dict] = {}
    for suite, rows in by_suite.items():
        for r in rows:
            digest = str((r.result.get("checkpoint") or {}).get("digest") or "")[:12]
            cells.setdefault((r.step, digest), {})[suite] = {"tau": r.result["tau"]["macro"],
                                                             "ci": _fmt_ci(r.result["tau"].get("ci95"))}
    return {"suites": suites, "rows": [{"step": step, "digest": digest, "cells": [c.get(s) for s in suites]}
                                       for (step, digest), c in sorted(cells.items())]}


def build_report(run_id: str, *, results_dir, out_dir=None, steps: list[int] | None = None,
                 suite: str | None = None) -> Path:
    """Write ``report.html`` and its PNGs into ``out_dir``; returns the HTML path."""
    import jinja2

    rows = load_run(run_id, results_dir)
    # one series per suite, target and τ-changing options (run_results.series_of): the suite's name in the
    # common case; two counting rules or two targets are two curves and two columns, never one
    series = series_of(rows)
    by_suite: dict[str, list[RunResult]] = {}
    for r in rows:
        by_suite.setdefault(series[r.key].label, []).append(r)
    if suite is not None and suite not in by_suite:
        raise ResultsError(f"run {run_id!r} has no results for suite {suite!r} (has: {sorted(by_suite)})")
    main_suite = suite or max(by_suite, key=lambda s: len(by_suite[s]))
    main = by_suite[main_suite]
    chosen = select_steps(main, steps)
    best = max(main, key=lambda r: (r.result["tau"]["macro"], -r.step))

    out = Path(out_dir) if out_dir else Path("reports") / run_id
    out.mkdir(parents=True, exist_ok=True)
    pngs = {"tau_vs_step": figs.tau_vs_step(by_suite), "tau_by_temperature": figs.tau_vs_step_by_temperature(main),
            "per_position": figs.per_position(chosen),
            "histogram": figs.histogram(chosen), "baseline": figs.baseline_delta(main),
            "train_vs_eval": figs.train_vs_eval(by_suite)}
    images = {}
    for name, png in pngs.items():
        if png is None:
            continue
        (out / f"{name}.png").write_bytes(png)
        images[name] = {"src": _data_uri(png), "file": f"{name}.png"}

    details = []
    for r in chosen:
        block = int(r.result.get("settings", {}).get("block_size") or 16)
        prompts = [{"name": p.get("name"), "tau": p.get("tau"), "baseline_tau": p.get("baseline_tau"),
                    "steps": len(p.get("accept_lengths") or []),
                    "segments": segments(str(p.get("reference_text") or ""), p.get("accepted_spans"),
                                         p.get("accept_lengths"), block)}
                   for p in r.result.get("prompts") or []]
        details.append({"step": r.step, "tau": r.result["tau"]["macro"], "ci": _fmt_ci(r.result["tau"].get("ci95")),
                        "open": r.key == best.key, "prompts": prompts,
                        "diagnostics": [{"severity": str(g.get("severity", "info")), "code": str(g.get("code", "")),
                                         "message": str(g.get("message", ""))}
                                        for g in r.result.get("diagnostics") or [] if isinstance(g, dict)],
                        "checkpoint": r.result["checkpoint"].get("path"), "block": block})

    env = jinja2.Environment(loader=jinja2.PackageLoader("eval_worker.results", "templates"),
                             autoescape=True, undefined=jinja2.StrictUndefined)
    env.filters["verbatim"] = _verbatim
    first = main[0].result
    html = env.get_template(TEMPLATE).render(
        run_id=run_id, suite=main_suite, suites=sorted(by_suite), images=images,
        rows=[_summary_row(r, best.key, series[r.key].label)
              for r in sorted(rows, key=lambda r: (r.step, series[r.key].label))],
        notes=target_notes(rows),
        by_suite=_side_by_side(by_suite),
        best={"step": best.step, "tau": best.result["tau"]["macro"], "ci": _fmt_ci(best.result["tau"].get("ci95"))},
        details=details, target=first.get("target") or {}, settings=first.get("settings") or {},
        generated_from=str(rows[0].path.parents[2]))
    path = out / "report.html"
    atomic_write_text(path, html, durable=False)
    return path
