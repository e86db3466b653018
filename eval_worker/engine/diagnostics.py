"""Name known failure signatures in an evaluation, so a bad number explains itself.

Each check reads facts the engine already has and returns zero or more `Diagnostic`s.
The codes are stable (the report and W&B key on them).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from eval_worker.engine.leak_probe import MIN_PROBE_ANCHORS, leak_signature
from eval_worker.engine.result import Diagnostic

# A drafter whose training accuracy is this high has learned *something*; an online τ far
# below what it promises is worth a warning. It is not evidence of a leak by itself: a suite
# far from the training data does the same to a healthy drafter. The leak probe decides.
LEAK_MIN_TRAIN_ACC = 0.3
NEAR_ONE_TAU = 1.15
# A reference is degenerate (collapsed) when a response of COLLAPSE_MIN_TOKENS+ tokens has at
# most COLLAPSE_MAX_LINES distinct lines or fewer than COLLAPSE_MIN_TOKEN_FRAC distinct tokens
# per token: "#\n" repeated, one import repeated. A drafter learns to repeat it, so τ on such
# references says nothing about drafting (every reference of an earlier demo target was "#\n" repeats).
COLLAPSE_MIN_TOKENS = 32
COLLAPSE_MAX_LINES = 3
COLLAPSE_MIN_TOKEN_FRAC = 0.1
COLLAPSE_FAIL_SHARE = 0.5  # the demo fails when more than this share of references collapsed


def reference_collapse(tokens: list[int], text: str | None) -> str | None:
    """Why a reference is degenerate ("2 distinct line(s) in 128 tokens"), or None if it is not.
    `text` is the decoded response (None without a tokenizer: only tokens are counted)."""
    n = len(tokens)
    if n < COLLAPSE_MIN_TOKENS:
        return None  # a short answer that ended is not a collapse
    if text is not None:
        lines = len(set(line.rstrip() for line in text.split("\n")))
        if lines <= COLLAPSE_MAX_LINES:
            return f"{lines} distinct line(s) in {n} tokens"
    kinds = len(set(tokens))
    if kinds < COLLAPSE_MIN_TOKEN_FRAC * n:
        return f"{kinds} distinct token(s) in {n}"
    return None


def mostly_degenerate(prompts: list[dict]) -> list[str] | None:
    """The degenerate prompts' names when they are more than COLLAPSE_FAIL_SHARE of a result's
    prompts (`EvalResult.to_dict()["prompts"]`), else None."""
    bad = [p["name"] for p in prompts if p.get("degenerate")]
    return bad if prompts and len(bad) > COLLAPSE_FAIL_SHARE * len(prompts) else None


@dataclass
class Facts:
    tau: float | None
    block_size: int
    eval_top1: list[float]  # per slot, over all anchors
    train_metrics: dict[str, Any] | None = None
    cache_notes: list[str] = field(default_factory=list)
    drafter_dtype: str = ""
    target_dtype: str = ""
    layer_ids: list[int] = field(default_factory=list)
    target_layers: int = 0
    drafter_mask_id: int | None = None
    tokenizer_mask_id: int | None = None
    greedy_divergence: dict[str, int] = field(default_factory=dict)  # prompt -> first offset
    empty_prompts: list[str] = field(default_factory=list)
    degenerate: dict[str, str] = field(default_factory=dict)  # prompt -> reference_collapse reason
    num_prompts: int = 0
    validation: dict | None = None
    sampled_validation: dict[str, dict] | None = None  # temperature key -> the real loop vs replay under sampling
    baseline_layer_ids: list[int] | None = None
    reference_source: str = "local"
    layer_ids_origin: str = "config"
    leak_probe: dict | None = None  # eval_worker.engine.leak_probe.LeakProbe.to_dict()
    sliding_rule_implicit: str | None = None  # the rule applied to sliding layers the config leaves implicit


def train_accuracy(train_metrics: dict[str, Any] | None) -> float | None:
    for key in ("accuracy", "acc", "train/accuracy", "train/acc", "top1_accuracy"):
        v = (train_metrics or {}).get(key)
        if isinstance(v, (int, float)) and 0.0 <= v <= 1.0:
            return float(v)
    return None


def expected_tau_from_accuracy(acc: float, block_size: int) -> float:
    """τ if every slot were right with probability acc, independently: 1 + Σ acc^k."""
    return 1.0 + sum(acc ** k for k in range(1, block_size))


def _probe_slot1(probe: dict, view: str) -> str:
    v = (probe.get(f"{view}_top1") or [None])[0]
    return "-" if v is None else f"{v:.2f}"


def _leak(f: Facts, acc: float | None, eval_acc: float | None) -> list[Diagnostic]:
    """CONTEXT_LEAK_SUSPECTED only on the leak probe's evidence; a training/eval gap alone is a warning."""
    probe = f.leak_probe
    views = (f"slot-1 top-1 on this suite: {_probe_slot1(probe, 'strict')} as evaluated, "
             f"{_probe_slot1(probe, 'anchor_state')} with the anchor's own state visible, "
             f"{_probe_slot1(probe, 'shifted_label')} against labels one token later; "
             f"{probe['anchors']} anchors") if probe else ""
    sign = leak_signature(probe)
    if sign is not None and sign[0] == "path":
        return [Diagnostic("CONTEXT_LEAK_SUSPECTED", "error",
                           f"the evaluated drafting path reads target states at or after its anchor ({sign[1]}): "
                           "the replayed τ is inflated; the drafter code, the mask or the cached features are wrong")]
    if sign is not None:
        trained = f"training accuracy {acc:.2f}, " if acc is not None else ""
        tau = f"τ={f.tau:.2f}" if f.tau is not None else "no τ"
        return [Diagnostic("CONTEXT_LEAK_SUSPECTED", "error",
                           f"the drafter predicts far better from what inference cannot give it, {sign[1]} ({views}; "
                           f"{trained}{tau}): it was trained with a leak. The training mask must hide the anchor's own "
                           "state (kv < anchor) and slot k must predict anchor+k")]
    gap = None
    if acc is not None and f.tau is not None and acc >= LEAK_MIN_TRAIN_ACC:
        expect = expected_tau_from_accuracy(acc, f.block_size)
        if f.tau - 1.0 < 0.25 * (expect - 1.0):
            gap = f"training accuracy {acc:.2f} predicts τ≈{expect:.2f}, measured τ={f.tau:.2f}"
    if gap is None and acc is not None and eval_acc is not None and acc - eval_acc > 0.25 and acc > 2 * eval_acc:
        gap = f"training accuracy {acc:.2f} vs {eval_acc:.2f} on this suite (all anchors, mean over slots)"
    if gap is None:
        return []
    why = (f"the leak probe finds no leak ({views}), so most likely this suite is far from the training data "
           "(distribution shift) or the drafter overfit" if probe and probe["anchors"] >= MIN_PROBE_ANCHORS else
           "the leak probe did not run (options.leak_probe_anchors), so a leak cannot be told from distribution "
           "shift or overfitting")
    return [Diagnostic("TRAIN_EVAL_ACCURACY_GAP", "warning", f"{gap}: {why}")]


def diagnose(f: Facts) -> list[Diagnostic]:
    out: list[Diagnostic] = []
    acc = train_accuracy(f.train_metrics)
    eval_acc = sum(f.eval_top1) / len(f.eval_top1) if f.eval_top1 else None
    out += _leak(f, acc, eval_acc)
    if f.tau is not None and f.tau < NEAR_ONE_TAU and not any(d.code == "CONTEXT_LEAK_SUSPECTED" for d in out):
        out.append(Diagnostic("TAU_NEAR_ONE", "warning",
                              f"τ={f.tau:.3f}: almost no draft token is accepted (untrained/random weights, a "
                              "wrong target, or a wrong mask token)"))
    for note in f.cache_notes:
        out.append(Diagnostic("CACHE_REBUILT", "warning", note))
    if f.drafter_dtype and f.target_dtype and f.drafter_dtype != f.target_dtype:
        out.append(Diagnostic("DTYPE_MISMATCH", "info",
                              f"drafter weights are stored as {f.drafter_dtype}, target runs in {f.target_dtype}: "
                              f"drafts are computed in {f.target_dtype}, as serving engines run a drafter"))
    if f.target_layers and f.layer_ids and max(f.layer_ids) == f.target_layers - 1:
        out.append(Diagnostic("LAST_LAYER_AS_FEATURE", "warning",
                              f"target_layer_ids {f.layer_ids} include the last layer ({f.target_layers - 1}), whose "
                              "output is already final-normed and feeds the target's own head (DFlash uses up to L-3)"))
    if f.layer_ids_origin != "config":
        out.append(Diagnostic("LAYER_IDS_FROM_FALLBACK", "info",
                              f"config.json names no target_layer_ids: layers {f.layer_ids} come from the "
                              f"{f.layer_ids_origin}"))
    if f.sliding_rule_implicit:
        out.append(Diagnostic("SLIDING_RULE_IMPLICIT", "warning",
                              "config.json has sliding-window layers and no causal flag: vLLM/SGLang draft them "
                              "causally within the block, z-lab's loop non-causally; this τ used "
                              f"{f.sliding_rule_implicit} (option sliding_rule chooses; dflash_config.causal "
                              "in the config settles it)"))
    if f.baseline_layer_ids is not None and f.baseline_layer_ids != f.layer_ids:
        out.append(Diagnostic("BASELINE_LAYER_MISMATCH", "info",
                              f"baseline reads target layers {f.baseline_layer_ids}, checkpoint reads {f.layer_ids}"))
    if f.tokenizer_mask_id is not None and f.drafter_mask_id is not None and f.tokenizer_mask_id != f.drafter_mask_id:
        out.append(Diagnostic("MASK_TOKEN_MISMATCH", "warning",
                              f"drafter mask_token_id {f.drafter_mask_id} but the tokenizer's <|MASK|> is "
                              f"{f.tokenizer_mask_id}"))
    if f.greedy_divergence:
        worst = ", ".join(f"{k}@{v}" for k, v in list(f.greedy_divergence.items())[:5])
        out.append(Diagnostic("REFERENCE_NOT_TARGET_GREEDY", "warning",
                              f"{len(f.greedy_divergence)} reference(s) differ from the target's own argmax "
                              f"(first offsets: {worst}; source {f.reference_source}): past that point the replay "
                              "follows a path real greedy decoding would not take"))
    if f.empty_prompts:
        out.append(Diagnostic("EMPTY_REFERENCE", "info",
                              f"no verify step for {f.empty_prompts[:5]} (the reference ends after one token)"))
    if f.degenerate:
        some = "; ".join(f"{k}: {v}" for k, v in list(f.degenerate.items())[:3])
        out.append(Diagnostic("DEGENERATE_REFERENCE", "warning",
                              f"{len(f.degenerate)} of {f.num_prompts or '?'} reference(s) collapsed ({some}): the "
                              "target repeats a line or a few tokens, so τ on them measures repetition, not drafting "
                              "(an untrained target, or a prompt format it never saw)"))
    if f.validation is not None and f.validation.get("mismatched_prompts"):
        bad = f.validation["mismatched_prompts"]
        out.append(Diagnostic("VALIDATION_MISMATCH", "error",
                              f"replayed acceptance differs from the real draft-verify loop on {len(bad)} prompt(s), "
                              f"first: {bad[0]}"))
    for key, val in (f.sampled_validation or {}).items():
        if val.get("mismatched_prompts"):
            bad = val["mismatched_prompts"]
            out.append(Diagnostic("VALIDATION_MISMATCH", "error",
                                  f"at temperature {key}, replayed acceptance differs from the real loop sampling with "
                                  f"the same keyed draws on {len(bad)} (prompt, sample) pair(s), first: {bad[0]}"))
    return out
