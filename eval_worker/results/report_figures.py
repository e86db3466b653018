"""Matplotlib figures for the local report (PNG bytes; headless Agg backend)."""
from __future__ import annotations

import io

from eval_worker.results.run_results import RunResult

COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"]


def _plt():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    _plt().close(fig)
    return buf.getvalue()


def tau_vs_step(by_suite: dict[str, list[RunResult]]) -> bytes:
    """τ (macro) per training step with its 95% CI band, pooled and tree τ, and the baseline."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(9, 3.8))
    for i, (suite, rows) in enumerate(sorted(by_suite.items())):
        c = COLORS[i % len(COLORS)]
        xs = [r.step for r in rows]
        tau = [r.result["tau"]["macro"] for r in rows]
        lo = [(r.result["tau"].get("ci95") or [t, t])[0] for r, t in zip(rows, tau, strict=True)]
        hi = [(r.result["tau"].get("ci95") or [t, t])[1] for r, t in zip(rows, tau, strict=True)]
        ax.fill_between(xs, lo, hi, color=c, alpha=0.18, label=f"{suite}: 95% CI")
        ax.plot(xs, tau, "o-", color=c, label=f"{suite}: τ (macro)")
        ax.plot(xs, [r.result["tau"].get("pooled") for r in rows], "--", color=c, alpha=0.7, label=f"{suite}: τ pooled")
        tree = [(r.step, (r.result.get("tree") or {}).get("tau")) for r in rows]
        tree = [(x, y) for x, y in tree if y is not None]
        if tree:
            ax.plot(*zip(*tree, strict=True), ":", color=c, alpha=0.8, label=f"{suite}: tree τ")
        base = [(r.step, r.result["baseline"]["tau"]) for r in rows if r.result.get("baseline")]
        if base:
            ax.plot(*zip(*base, strict=True), "s", color="#555", ms=4, label=f"{suite}: baseline τ")
    ax.set_xlabel("training step")
    ax.set_ylabel("τ (mean accepted length)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    return _png(fig)


def tau_vs_step_by_temperature(rows: list[RunResult]) -> bytes | None:
    """τ per training step at each sampled temperature next to greedy (temperature 0), with 95% CI
    bands; None when no result of the suite was sampled."""
    series: dict[str, list[tuple[int, float, list | None]]] = {}
    for r in rows:
        t = r.result["tau"]
        series.setdefault("0", []).append((r.step, t["macro"], t.get("ci95")))
        for key, e in ((r.result.get("sampling") or {}).get("by_temperature") or {}).items():
            if (e.get("tau") or {}).get("macro") is not None:
                series.setdefault(str(key), []).append((r.step, e["tau"]["macro"], e["tau"].get("ci95")))
    if len(series) < 2:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(9, 3.8))
    for i, (key, pts) in enumerate(sorted(series.items(), key=lambda kv: float(kv[0]))):
        c = COLORS[i % len(COLORS)]
        pts = [(x, y, ci) for x, y, ci in pts if y is not None]
        xs, ys = [x for x, _, _ in pts], [y for _, y, _ in pts]
        ax.fill_between(xs, [(ci or [y, y])[0] for _, y, ci in pts], [(ci or [y, y])[1] for _, y, ci in pts],
                        color=c, alpha=0.15)
        ax.plot(xs, ys, "o-", color=c, label="greedy (t=0)" if key == "0" else f"t={key}")
    ax.set_xlabel("training step")
    ax.set_ylabel("τ (mean accepted length)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best", title="target temperature", title_fontsize=7)
    return _png(fig)


FEW = 30  # a slot reached by fewer verify steps than this is drawn faded, with its count


def slot_counts(histogram: list[int]) -> list[int]:
    """Verify steps that reached draft slot k = 1..B-1 (accepted length >= k): the n behind P(accept k | k-1)."""
    return [sum(histogram[k - 1:]) for k in range(1, len(histogram))]


def per_position(rows: list[RunResult]) -> bytes:
    """Conditional acceptance per draft slot (solid) and top-1 accuracy (dashed), selected checkpoints.

    Late slots are reached by few verify steps, so their rate is noisy (a jump at k = 8 may rest on
    3 steps): points with fewer than FEW steps are faded and labelled with n.
    """
    plt = _plt()
    fig, ax = plt.subplots(figsize=(9, 3.6))
    for i, r in enumerate(rows):
        c = COLORS[i % len(COLORS)]
        per = r.result.get("per_position") or {}
        acc = per.get("conditional_accept") or []
        ks = range(1, len(acc) + 1)
        ax.plot(ks, acc, "-", color=c, label=f"step {r.step}: P(accept k | k-1)")
        counts = slot_counts(r.result.get("acceptance_histogram") or [])
        counts = counts if len(counts) == len(acc) else [FEW] * len(acc)  # no histogram: no counts to show
        ax.scatter(ks, acc, s=12, color=c, alpha=[1.0 if n >= FEW else 0.25 for n in counts])
        for k, a, n in zip(ks, acc, counts, strict=True):
            if n < FEW:
                ax.annotate(f"n={n}", (k, a), textcoords="offset points", xytext=(0, 5), ha="center",
                            fontsize=6, color=c, alpha=0.8)
        top1 = per.get("top1_accuracy") or []
        if top1:
            ax.plot(range(1, len(top1) + 1), top1, "--", color=c, alpha=0.6, label=f"step {r.step}: top-1 acc")
    ax.set_xlabel("draft slot k")
    ax.set_ylabel("rate")
    ax.set_ylim(0, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="best")
    return _png(fig)


def histogram(rows: list[RunResult]) -> bytes:
    """Share of verify steps by accepted length 1..B, one bar group per selected checkpoint."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(9, 3.4))
    width = 0.8 / max(1, len(rows))
    for i, r in enumerate(rows):
        hist = r.result.get("acceptance_histogram") or []
        total = sum(hist) or 1
        xs = [k + (i - (len(rows) - 1) / 2) * width for k in range(1, len(hist) + 1)]
        ax.bar(xs, [h / total for h in hist], width=width, color=COLORS[i % len(COLORS)], label=f"step {r.step}")
    ax.set_xlabel("accepted length per verify step (incl. bonus token)")
    ax.set_ylabel("share of verify steps")
    ax.grid(alpha=0.3, axis="y")
    ax.legend(fontsize=7)
    return _png(fig)


def baseline_delta(rows: list[RunResult]) -> bytes | None:
    """Δτ against the baseline per step, with its 95% CI; None when no result has a baseline."""
    pts = [(r.step, r.result["baseline"]) for r in rows if r.result.get("baseline")]
    if not pts:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(9, 3.0))
    xs = [x for x, _ in pts]
    d = [b["delta_tau"] for _, b in pts]
    lo = [b["delta_tau"] - (b.get("delta_ci95") or [b["delta_tau"]] * 2)[0] for _, b in pts]
    hi = [(b.get("delta_ci95") or [b["delta_tau"]] * 2)[1] - b["delta_tau"] for _, b in pts]
    ax.errorbar(xs, d, yerr=[lo, hi], fmt="o-", capsize=3, color=COLORS[0])
    ax.axhline(0, color="#555", lw=1)
    ax.set_xlabel("training step")
    ax.set_ylabel("Δτ vs baseline")
    ax.grid(alpha=0.3)
    return _png(fig)


def train_vs_eval(by_suite: dict[str, list[RunResult]]) -> bytes | None:
    """The train/serve gap on one step axis: τ per suite beside the trainer's own accept length
    (1 + leading correct slots on training blocks), and the training loss and accuracy below.
    None when no evaluation carries training metrics (a checkpoint published without them)."""
    train: dict[int, dict] = {}
    for rows in by_suite.values():
        for r in rows:
            if r.train_metrics:
                train.setdefault(r.step, r.train_metrics)
    if not train:
        return None
    plt = _plt()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 5.6), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    for i, (suite, rows) in enumerate(sorted(by_suite.items())):
        top.plot([r.step for r in rows], [r.result["tau"]["macro"] for r in rows], "o-",
                 color=COLORS[i % len(COLORS)], label=f"{suite}: τ (eval)")
    steps = sorted(train)

    def series(key):
        pts = [(s, train[s][key]) for s in steps if train[s].get(key) is not None]
        return list(zip(*pts, strict=True)) if pts else None

    if (streak := series("streak")) is not None:
        top.plot(*streak, "s--", color="#333", label="train: 1 + leading correct slots (accept length)")
    top.set_ylabel("accepted length")
    top.grid(alpha=0.3)
    top.legend(fontsize=7, loc="best")
    if (loss := series("loss")) is not None:
        bottom.plot(*loss, "o-", color=COLORS[4], label="train loss")
        bottom.set_ylabel("train loss")
    if (acc := series("accuracy")) is not None:
        right = bottom.twinx()
        right.plot(*acc, "^:", color=COLORS[2], label="train accuracy (draft slots)")
        right.set_ylabel("train accuracy")
        right.set_ylim(0, 1.02)
        right.legend(fontsize=7, loc="upper right")
    bottom.set_xlabel("training step")
    bottom.grid(alpha=0.3)
    if loss is not None:
        bottom.legend(fontsize=7, loc="upper left")
    return _png(fig)
