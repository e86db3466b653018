"""The acceptance evaluation engine: exact greedy τ from one cached target pass per prompt.

One evaluation:
  1. encode the suite's prompts; get the target's greedy reference for each (cached);
  2. run the target once over prompt + reference for the drafter's feature layers (cached);
  3. draft the blocks the walks visit, each up to its first miss, all prompts of a group
     stepping together (`walk.py`), or a block at every response position in a few batched
     multi-block passes (`drafting.py`): `options.drafting`, the same numbers either way;
  4. replay the online greedy walk along the reference (what speculative decoding with
     this drafter would do) and derive every metric from the same drafts (statistics over
     every anchor from a fixed seeded sample of anchors, `options.anchor_sample`).
With `options.temperatures`, steps 1-4 run again per temperature on K keyed samples of the
target per prompt (`dflash_train.core.sampling`): τ under sampling, exact per sample.
`Evaluator` keeps the target, the caches and baseline scores loaded across jobs.
"""
from __future__ import annotations

import dataclasses
import logging
import platform
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch

from dflash_train.common.progress import DEFAULT_EVERY_S, Progress, track
from dflash_train.core.model import DFlashDrafter
from dflash_train.core.sampling import Sampler, SamplingParams
from dflash_train.core.speculative import speculative_generate
from dflash_train.core.target import Target
from dflash_train.core.tau import tau
from eval_worker.engine import metrics
from eval_worker.engine.cache import CacheReport, DiskCache, Lookup, MemoryLRU, digest
from eval_worker.engine.checkpoint_source import CheckpointInfo, open_drafter
from eval_worker.engine.decoding import DecodeStats
from eval_worker.engine.diagnostics import Facts, diagnose, reference_collapse
from eval_worker.engine.drafting import DEFAULT_HEAD_ROWS, draft_anchors
from eval_worker.engine.leak_probe import LeakProbe, probe_offsets
from eval_worker.engine.options import EvalOptions, temperature_key
from eval_worker.engine.references import LocalReferences, Reference, ReferenceSourceError, Request
from eval_worker.engine.result import EvalResult, PromptResult
from eval_worker.engine.scoring import PromptScore, Summary, sample_offsets, score_blocks, score_prompt, summarize
from eval_worker.engine.speed import StepCosts
from eval_worker.engine.suite import EncodedPrompt, Suite, SuiteError, load_suite
from eval_worker.engine.walk import GroupKV, Walker, WalkSeq, auto_path, context_kv, group_kv_budget, walk_groups

log = logging.getLogger(__name__)
# what the fixed anchor sample (options.anchor_sample) stands in for every anchor in
SAMPLED_STATS = ("mean_streak_all_anchors", "per_position.top1_accuracy", "prompts[].mean_streak")


def _dt(dtype: torch.dtype) -> str:
    """A dtype as results name it (`bfloat16`, not `torch.bfloat16`)."""
    return str(dtype).removeprefix("torch.")


def _stored(drafter: DFlashDrafter) -> str:
    """The dtype(s) the drafter's file holds (`open_drafter` computes it in the target's)."""
    return drafter.stored_dtype or _dt(drafter.fc.weight.dtype)

@dataclass
class DrafterRun:
    """One drafter scored on the references (kept for the baseline across jobs)."""

    scores: list[PromptScore]
    summary: Summary
    block_size: int
    layer_ids: list[int]
    leak_probe: dict | None = None
    drafting: dict | None = None  # the drafting path, what it drafted, and the anchor sample


@dataclass
class ResultBuilder:
    """The parts of one evaluation's result, collected as they are measured (`Evaluator.evaluate`
    fills them in); `build()` makes the `EvalResult`."""

    target: Target
    reference_source: str  # its name: "local" or a server's
    info: CheckpointInfo
    drafter: DFlashDrafter
    suite: Suite
    opts: EvalOptions
    max_new: int
    eos: int | None
    lookahead: int
    report: CacheReport
    timings: dict[str, float]
    train_metrics: dict | None = None
    base: tuple[DFlashDrafter, CheckpointInfo] | None = None
    refs: list[Reference] = field(default_factory=list)
    main: DrafterRun | None = None
    base_run: DrafterRun | None = None
    validation: dict | None = None
    sampled: dict | None = None
    speed: dict | None = None
    reference_notes: dict = field(default_factory=dict)  # how missing references were decoded (provenance)

    def build(self) -> EvalResult:
        assert self.main is not None and self.speed is not None, "the drafter's run and the speed come first"
        main, s, opts, drafter, target = self.main, self.main.summary, self.opts, self.drafter, self.target
        assert main.drafting is not None
        prompts, observed = self._prompts()
        baseline = self._baseline()
        facts = self._facts(*observed)
        return EvalResult(
            checkpoint=self.info.to_dict(),
            target={"path": target.source, "fingerprint": target.fingerprint(),
                    "num_layers": target.num_layers, "dtype": _dt(target.dtype)},
            suite=self.suite.to_dict(),
            settings={"block_size": main.block_size, "max_new_tokens": self.max_new, "mode": opts.mode,
                      "counting": opts.counting, "layer_ids_origin": drafter.config.layer_ids_origin,
                      "sliding_rule": drafter.config.attention_rule(), "layout": drafter.config.layout,
                      "tree_budget": opts.tree_budget, "tree_spine": opts.tree_spine, "max_blocks": opts.max_blocks,
                      "chat_template": self.suite.chat_template if opts.chat_template is None else opts.chat_template,
                      "eos_token_id": self.eos, "lookahead": self.lookahead, "layer_ids": main.layer_ids,
                      "reference_source": self.reference_source,
                      "anchor_sample": main.drafting["anchor_sample"],
                      "drafter_dtype": {"computed": _dt(drafter.fc.weight.dtype), "stored": _stored(drafter)}},
            tau=s.tau, acceptance_histogram=s.histogram, per_position=s.per_position,
            mean_streak_all_anchors=s.mean_streak_all_anchors, tree=s.tree, speedup=self.speed,
            baseline=baseline, prompts=prompts, diagnostics=diagnose(facts), cache=self.report.to_dict(),
            provenance={"software_version": software_version(),
                        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
                        "timings_s": {k: round(v, 4) for k, v in self.timings.items()},
                        "drafting": {k: v for k, v in main.drafting.items() if k != "anchor_sample"},
                        "references": self.reference_notes or None,
                        "torch": torch.__version__, "device": str(target.device), "host": platform.node()},
            stride=s.stride, validation=self.validation, leak_probe=main.leak_probe, sampling=self.sampled)

    def _prompts(self) -> tuple[list[PromptResult], tuple[dict, list, dict]]:
        """Each prompt's result, and what they showed for the diagnostics: the prompts whose reference
        is not the target's greedy output (where), those without a verify step, degenerate references."""
        assert self.main is not None
        main, s, opts = self.main, self.main.summary, self.opts
        decode = self._decoder()
        base_taus = self.base_run.summary.per_prompt_tau if self.base_run else [None] * len(self.refs)
        prompts, divergence, empty, degenerate = [], {}, [], {}
        for ref, sc, prompt_tau, btau in zip(self.refs, main.scores, s.per_prompt_tau, base_taus, strict=False):
            walk_spans = sc.online.spans if opts.mode == "online" else [
                (a + 1, min(a + n, sc.num_tokens - 1) + 1) for a,
                n in zip(range(0, sc.num_tokens, sc.block_size), sc.stride, strict=False)]
            text, spans = _char_spans(decode, ref.tokens, walk_spans)
            assert sc.greedy is not None  # scored with the features pass
            first = _first_divergence(sc.greedy.tolist(), ref.ext)
            if first is not None:
                divergence[ref.name] = first
            if not sc.accepts(opts.mode):
                empty.append(ref.name)
            tree_acc = sc.tree_accepts(opts.mode)
            collapse = reference_collapse(ref.tokens, text if self.target.tokenizer is not None else None)
            if collapse:
                degenerate[ref.name] = collapse
            prompts.append(PromptResult(
                name=ref.name, tau=prompt_tau, accept_lengths=list(sc.accepts(opts.mode)), baseline_tau=btau,
                reference_text=text, accepted_spans=spans, num_tokens=len(ref.tokens), finish=ref.finish,
                tree_tau=tau(tree_acc),
                mean_streak=float(sc.sample_streaks.mean()) if sc.sample.size else None,
                reference_agrees_with_target=first is None, degenerate=collapse))
        return prompts, (divergence, empty, degenerate)

    def _facts(self, divergence: dict, empty: list, degenerate: dict) -> Facts:
        assert self.main is not None
        main, s, drafter, target, base_run = self.main, self.main.summary, self.drafter, self.target, self.base_run
        return Facts(tau=s.tau["macro"], block_size=main.block_size, eval_top1=s.per_position["top1_accuracy"],
                     train_metrics=self.train_metrics, cache_notes=self.report.notes,
                     drafter_dtype=_stored(drafter),
                     target_dtype=_dt(target.dtype), layer_ids=main.layer_ids,
                     target_layers=target.num_layers, drafter_mask_id=drafter.config.mask_token_id,
                     tokenizer_mask_id=target.mask_token_id(), greedy_divergence=divergence,
                     empty_prompts=empty, degenerate=degenerate, num_prompts=len(self.refs),
                     validation=self.validation,
                     sampled_validation={k: e["validation"] for k,
                                         e in (self.sampled or {}).get("by_temperature", {}).items()
                                         if e.get("validation")},
                     baseline_layer_ids=base_run.layer_ids if base_run else None,
                     reference_source=self.reference_source,
                     layer_ids_origin=drafter.config.layer_ids_origin, leak_probe=main.leak_probe,
                     sliding_rule_implicit=(drafter.config.attention_rule() if drafter.config.sliding_implicit
                                            else None))

    def _baseline(self) -> dict | None:
        """The baseline's τ and the paired difference (None without a baseline)."""
        if self.base_run is None or self.base is None:
            return None
        assert self.main is not None
        b = self.base_run.summary
        d = metrics.paired_delta(self.main.summary.per_prompt_tau, b.per_prompt_tau,
                                 n_resamples=self.opts.bootstrap, seed=self.opts.seed)
        binfo = self.base[1]
        return {"checkpoint": binfo.path, "digest": binfo.digest, "tau": b.tau["macro"],
                "tau_pooled": b.tau["pooled"], "ci95": b.tau["ci95"],
                "delta_tau": d["delta"], "delta_ci95": d["ci95"], "num_pairs": d["num_pairs"],
                "tree_tau": b.tree["tau"], "block_size": self.base_run.block_size}

    def _decoder(self):
        tok = self.target.tokenizer
        if tok is None:
            return lambda ids: "".join(f"<{i}>" for i in ids)
        return lambda ids: tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)


def software_version() -> str:
    try:
        from importlib.metadata import PackageNotFoundError, version

        return version("dflash-eval")
    except PackageNotFoundError:  # run from a checkout that is not installed
        return "0.1.0"


class Evaluator:
    """Target + caches, loaded once; `evaluate(...)` per checkpoint."""

    def __init__(self, target: Target | str | Path, cache_dir: str | Path | None = None, *,
                 reference_source=None, progress: bool = True, progress_every_s: float = DEFAULT_EVERY_S,
                 memory_cache_bytes: int = 1 << 30, dtype: str = "float32", device: str | None = None):
        if not isinstance(target, Target):
            target = Target.load(target, dtype=dtype, device=device)
        self.target = target
        self.disk = DiskCache(cache_dir)
        self.memory = MemoryLRU(memory_cache_bytes)
        self.reference_source = reference_source or LocalReferences(target)
        self.progress, self.progress_every_s = progress, progress_every_s
        self._baselines: dict[str, DrafterRun] = {}
        self.step_costs = StepCosts(self.disk)  # one measurement per (target, device, drafter shape)
        self._draft_costs: dict[str, dict] = {}  # drafting seconds per response token, per path and drafter shape
        self._auto_runs: dict[str, int] = {}  # evaluations "auto" chose a path for, per drafter shape

    # --- public -----------------------------------------------------------------------
    def evaluate(self, checkpoint_dir: str | Path, suite: Suite | str = "builtin:coding-v1",
                 baseline: str | Path | None = None, train_metrics: dict | None = None,
                 options: dict | EvalOptions | None = None, verified: dict | None = None) -> EvalResult:
        """Evaluate one drafter directory. `verified`: manifests of published checkpoints the
        caller has just verified, keyed by real path (the worker's; they are not hashed again)."""
        opts = options if isinstance(options, EvalOptions) else EvalOptions.from_dict(options)
        timings: dict[str, float] = {}
        report = CacheReport()
        t_start = time.perf_counter()
        with _timer(timings, "load"):
            drafter, info = open_drafter(checkpoint_dir, self.target, verified=verified, sliding_rule=opts.sliding_rule)
            base = (open_drafter(baseline, self.target, verified=verified, sliding_rule=opts.sliding_rule)
                    if baseline is not None else None)
            suite = load_suite(suite) if isinstance(suite, (str, Path)) else suite
            suite = suite.head(opts.num_prompts)
            prompts = self._encode(suite, opts, [drafter] + ([base[0]] if base else []))
        max_new = opts.max_new_tokens or suite.max_new_tokens
        eos = self._eos(opts)
        B_max = max(drafter.config.block_size, base[0].config.block_size if base else 0)
        lookahead = B_max - 1  # what the last verify step of the real loop can look at
        parts = ResultBuilder(target=self.target, reference_source=getattr(self.reference_source, "name", "local"),
                              info=info, drafter=drafter, suite=suite, opts=opts, max_new=max_new, eos=eos,
                              lookahead=lookahead, report=report, timings=timings, base=base,
                              train_metrics=train_metrics if train_metrics is not None else info.train_metrics)
        with _timer(timings, "references"):
            refs, pending = self._references(suite, prompts, max_new, eos, lookahead, report,
                                             drafter=self._reference_drafter(opts, drafter, base),
                                             layer_ids=list(drafter.config.layer_ids),
                                             notes=parts.reference_notes)
        parts.refs = refs
        # a server's reference must be the target's own greedy output (checked on the features
        # pass, which computes that argmax anyway); a local one is by construction, up to numerics
        check = opts.reference_mismatch == "fail" and getattr(self.reference_source, "name", "local") != "local"
        written: list[tuple[str, str]] = []
        try:
            parts.main = self._run(drafter, refs, suite, opts, report, timings, check=check, written=written,
                                   probe=True)
        except ReferenceSourceError:
            for kind, slot in written:  # a failed job leaves nothing behind
                self.disk.remove(kind, slot)
            raise
        for slot, key, ref in pending:  # only references that passed the check are kept
            self.disk.put_json("references", slot, key, ref.to_dict())
        if base is not None:
            with _timer(timings, "baseline"):
                parts.base_run = self._baseline_run(base, refs, suite, opts, report)
        if opts.validate:
            with _timer(timings, "validation"):
                full = [sc.full_walk().accept_lengths for sc in parts.main.scores]
                parts.validation = self.validate(drafter, refs, full, max_new, eos, counting=opts.counting)
        parts.sampled = self._sampled(drafter, suite, prompts, opts, max_new, eos, lookahead, report, timings)
        with _timer(timings, "speed"):
            parts.speed = self._speedup(drafter, refs, parts.main.summary.tau["macro"], opts)
        for entry in (parts.sampled or {}).get("by_temperature", {}).values():  # the same step costs, τ at T
            entry["speedup_estimated"] = _estimate_at(parts.speed, entry["tau"]["macro"])
        timings["total"] = time.perf_counter() - t_start
        return parts.build()

    def validate(self, drafter: DFlashDrafter, refs: list[Reference], replays: list[list[int]], max_new: int,
                 eos: int | None, counting: str = "response",
                 sampling: tuple[SamplingParams, int] | None = None) -> dict:
        """Run the real draft-verify loop on every prompt and compare step by step with the replay.

        The engine's one per-prompt loop, on purpose: what it checks is the published loop itself (batch 1,
        its own numerics), so batching its prompts would validate another loop. It costs what that loop costs,
        one target step per verify (bench/cold_cost.py's "loop" column: at τ ≈ 7 on the tiny target about
        the cost of a warm evaluation with run defaults, at τ ≈ 1 one step per token, several times it).

        `sampling` (params, seed): the loop samples with each reference's keyed draws (its sample index)."""
        mismatched, token_mismatch, steps = [], [], 0
        for ref, replay in zip(refs, replays, strict=False):
            sampler = None if sampling is None else Sampler.for_prompt(sampling[0], sampling[1], ref.prompt_ids,
                                                                       ref.sample or 0)
            real = speculative_generate(self.target, drafter, ref.prompt_ids, max_new, eos_token_id=eos,
                                        counting=counting, sampler=sampler)
            steps += len(real.accept_lengths)
            if real.accept_lengths != replay:
                first = next((i for i, (a, b) in enumerate(zip(real.accept_lengths, replay, strict=False)) if a != b),
                             min(len(real.accept_lengths), len(replay)))
                mismatched.append({"name": ref.name, "sample": ref.sample, "first_step": first,
                                   "real": real.accept_lengths, "replay": replay})
            if real.tokens != ref.tokens:
                token_mismatch.append(ref.name if ref.sample is None else f"{ref.name}#{ref.sample}")
        return {"prompts_checked": len(refs), "steps_checked": steps, "mismatched_prompts": mismatched,
                "reference_differs_from_loop": token_mismatch, "ok": not mismatched}

    # --- steps --------------------------------------------------------------------------
    def _reference_drafter(self, opts: EvalOptions, drafter: DFlashDrafter,
                           base: tuple[DFlashDrafter, CheckpointInfo] | None) -> DFlashDrafter | None:
        """The drafter that decodes missing greedy references speculatively (`opts.reference_drafter`): the
        evaluated checkpoint or the baseline; None (plain decoding) for "none" or a reference server."""
        if not isinstance(self.reference_source, LocalReferences) or opts.reference_drafter == "none":
            return None
        if opts.reference_drafter == "baseline" and base is not None:
            return base[0]
        return drafter

    def _encode(self, suite: Suite, opts: EvalOptions, drafters: list[DFlashDrafter]) -> list[EncodedPrompt]:
        prompts = suite.encode(self.target.tokenizer, opts.chat_template)
        vocab = min([self.target.vocab_size] + [d.config.vocab_size for d in drafters])
        for p in prompts:
            bad = [i for i in p.ids if i >= vocab]
            if bad:
                raise SuiteError(f"prompt {p.name!r} has token ids {bad[:5]} outside the vocabulary ({vocab})")
        return prompts

    def _eos(self, opts: EvalOptions) -> int | None:
        if opts.eos_token_id is not None:
            return opts.eos_token_id
        tok = self.target.tokenizer
        if tok is not None and getattr(tok, "eos_token_id", None) is not None:
            return int(tok.eos_token_id)
        eos = getattr(getattr(self.target.model, "generation_config", None), "eos_token_id", None)
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        return None if eos is None else int(eos)

    def _target_slot(self) -> str:
        return self.target.source or self.target.fingerprint()

    def _references(self, suite: Suite, prompts: list[EncodedPrompt], max_new: int, eos: int | None,
                    lookahead: int, report: CacheReport,
                    sampling: tuple[SamplingParams, int, int] | None = None,
                    drafter: DFlashDrafter | None = None, layer_ids: list[int] | None = None,
                    notes: dict | None = None) -> tuple[list[Reference], list[tuple]]:
        """References (cached or made) and the cache writes of the made ones, which the caller makes once
        they are known to be the target's greedy output.

        The cache holds a continuation per (target, suite prompt, source): any entry serves a request
        for fewer tokens or a shorter lookahead, and a shorter one is extended, not decoded again (the
        drafter's block size matters only through the lookahead; docs/design.md, "Reference cache").
        Missing greedy references are decoded in batches across prompts; with `drafter` (local source),
        speculatively, each then checked against the target's argmax on the features pass (`layer_ids`:
        the evaluated drafter's, cached for its run) and decoded plainly where it differs (`notes`).

        `sampling` (params, seed, K): K keyed samples per prompt instead (prompt-major); a prompt's
        missing samples are generated together (`generate_samples`: one batched decode locally)."""
        src = self.reference_source
        K = 1 if sampling is None else sampling[2]
        what = "references" if sampling is None else f"sampled references (t={sampling[0].temperature:g}, K={K})"
        notes = notes if notes is not None else {}
        refs: list[Reference | None] = []
        todo = []  # (position in refs, label, slot, key, lookup, known continuation, sampler, prompt)
        for p in prompts:
            for k in [None] if sampling is None else range(K):
                sampler = None if k is None or sampling is None else Sampler.for_prompt(sampling[0], sampling[1],
                                                                                        p.ids, k)
                variant = {} if sampler is None else {"sampling": sampler.params.to_dict(), "seed": sampler.seed,
                                                      "sample": k}
                slot = digest({"target": self._target_slot(), "suite": suite.name, "prompt": p.name,
                               "source": src.identity(), **variant})  # greedy slots and keys as before
                key = {"target_fingerprint": self.target.fingerprint(), "prompt_ids": digest(p.ids),
                       "source": src.identity(), **variant}
                # what a continuation does not depend on; entries written before they left the key still serve
                look = self.disk.get_json("references", slot, key, ignore=("max_new_tokens", "eos_token_id"))
                label = p.name if k is None else f"{p.name}#{k}"
                known, asked = self._cached_ext(look)
                req = Request(p.name, list(p.ids), max_new, eos, lookahead, known)
                ref = req.served(known, getattr(src, "name", "local"), asked=asked)
                if ref is not None:
                    ref.sample = k
                    report.record("references", look, label)
                else:
                    todo.append((len(refs), label, slot, key, look, req, sampler, p))
                refs.append(ref)
        pending = []
        for at, ref in self._make_references(todo, sampling, drafter, what, suite, notes):
            _, label, slot, key, look, req, sampler, p = todo[at]
            if not ref.tokens:
                raise ReferenceSourceError(f"reference for {label!r} is empty")
            ref.sample = None if sampler is None else sampler.sample
            if req.known and look.status == "hit":
                look.status = "extended"
                log.info("references of %r: the cached %d tokens extended to %d (max_new_tokens %d, lookahead %d)",
                         label, len(req.known), len(ref.ext), max_new, lookahead)
            elif look.status in ("mismatch", "corrupt"):
                log.warning("references of %r rebuilt: %s", label,
                            "key changed: " + look.note if look.status == "mismatch" else look.note)
            report.record("references", look, label)
            pending.append((slot, key, ref))
            refs[todo[at][0]] = ref
        if drafter is not None and layer_ids is not None and todo and sampling is None:
            self._check_speculative(refs, pending, {x[0]: x[5] for x in todo}, suite, layer_ids, report, notes)
        assert all(r is not None for r in refs)
        return refs, pending  # type: ignore[return-value]

    def _make_references(self, todo: list, sampling, drafter, what: str, suite: Suite, notes: dict):
        """(index into `todo`, reference) for every missing reference: greedy ones batched across prompts
        (speculative with `drafter` where the source is local), sampled ones per prompt."""
        src = self.reference_source
        if not todo:
            return
        if sampling is None and hasattr(src, "generate_many"):
            stats = DecodeStats()
            t0 = time.perf_counter()
            decoding = "speculative" if drafter is not None else "plain"
            with Progress(f"{suite.name}: {what} ({decoding}, batched)", len(todo), unit="prompts",
                          enabled=self.progress, every_s=self.progress_every_s, logger=log) as bar:
                for batch in src.generate_many([x[5] for x in todo], drafter=drafter, stats=stats):
                    yield from batch
                    bar.update(len(batch))
            notes.update(decoding=decoding, prompts=len(todo), target_steps=stats.target_steps,
                         tokens=stats.tokens, seconds=round(time.perf_counter() - t0, 4),
                         speculative_steps=stats.speculative)  # the last batch's adaptive choice
            log.info("%s: %d references decoded (%s): %d tokens in %d target steps", suite.name, len(todo),
                     decoding, stats.tokens, stats.target_steps)
            return
        by_prompt: dict[str, list[int]] = {}
        for i, x in enumerate(todo):
            by_prompt.setdefault(x[7].name, []).append(i)
        for idx in self._bar(list(by_prompt.values()), f"{suite.name}: {what}"):
            first = todo[idx[0]]
            p, req = first[7], first[5]
            if sampling is None:
                yield idx[0], src.generate(p.name, p.ids, req.max_new_tokens, req.eos_token_id, req.lookahead)
            elif hasattr(src, "generate_samples"):
                made = src.generate_samples(p.name, p.ids, req.max_new_tokens, req.eos_token_id, req.lookahead,
                                            [todo[i][6] for i in idx])
                yield from zip(idx, made, strict=True)
            else:
                for i in idx:
                    yield i, src.generate(p.name, p.ids, req.max_new_tokens, req.eos_token_id, req.lookahead,
                                          sampler=todo[i][6])

    def _check_speculative(self, refs: list, pending: list, requests: dict[int, Request], suite: Suite,
                           layer_ids: list[int], report: CacheReport, notes: dict) -> None:
        """Every speculatively decoded reference against the target's argmax on the features pass (the run
        reads those features next, from memory); a prompt where they differ is decoded plainly instead."""
        bad = []
        for i in requests:
            feats = self._features(refs[i], suite, layer_ids, report)
            if _first_divergence(feats["greedy"].tolist(), refs[i].ext) is not None:
                bad.append(i)
        notes["fallback_plain"] = [refs[i].name for i in bad]
        if not bad:
            return
        log.warning("%s: speculative references of %s differ from the target's argmax on the features pass; "
                    "decoded plainly instead", suite.name, ", ".join(repr(refs[i].name) for i in bad))
        reqs = [dataclasses.replace(requests[i], known=[]) for i in bad]  # from the prompt: the plain decoder's own
        swap = {}
        for batch in self.reference_source.generate_many(reqs):
            for j, ref in batch:
                swap[id(refs[bad[j]])] = ref
                refs[bad[j]] = ref
        pending[:] = [(slot, key, swap.get(id(ref), ref)) for slot, key, ref in pending]

    @staticmethod
    def _cached_ext(look: Lookup) -> tuple[list[int], int]:
        """The continuation a cache entry holds and how much of it its source was asked for (a server may
        return fewer lookahead tokens than asked): ([], 0) when it holds none (missing, changed, unreadable)."""
        if look.status != "hit":
            return [], 0
        try:
            ref = Reference.from_dict(look.value)
        except (KeyError, TypeError, ValueError) as e:
            look.status, look.note = "corrupt", f"bad reference record ({e})"
            return [], 0
        return ref.ext, len(ref.tokens) + ref.lookahead_requested

    def _features(self, ref: Reference, suite: Suite, layer_ids: list[int], report: CacheReport,
                  check: bool = False, written: list | None = None, sampling_id: dict | None = None) -> dict:
        """Target features over prompt + response (and the target's argmax there), cached.

        With `check`, a reference that differs from that argmax raises ReferenceSourceError
        before anything is cached for it."""
        ids = ref.prompt_ids + ref.tokens
        # a sampled reference has its own slot (its key, the tokens' digest, tells the samples apart)
        variant = {} if sampling_id is None else {"sampling": sampling_id}
        # the length in the slot: references of other lengths (another max_new_tokens) keep their own features
        slot = digest({"target": self._target_slot(), "suite": suite.name, "prompt": ref.name, "layers": layer_ids,
                       "num_tokens": len(ids), **variant})
        key = {"target_fingerprint": self.target.fingerprint(), "layer_ids": list(layer_ids), "tokens": digest(ids),
               "num_tokens": len(ids), "dtype": _dt(self.target.dtype)}
        mkey = digest({"slot": slot, "key": key})
        cached = self.memory.get(mkey)  # host RAM: device memory is the drafter's
        if cached is not None:
            if check:
                self._check_reference(ref, cached["greedy"])
            report.record("features", Lookup(None, "hit"), _label(ref))
            return _on(cached, self.target.device)
        look = self.disk.get_tensors("features", slot, key)
        value = look.value
        if value is not None and (tuple(value.get("features", torch.empty(0)).shape[:1]) != (len(ids),)
                                  or "greedy" not in value):
            look.status, look.note, value = "corrupt", "tensor shapes do not match the key", None
        if value is None:
            out = self.target.forward(torch.tensor([ids], device=self.target.device), layer_ids)
            value = {"features": out.features[0].contiguous().cpu(),
                     "greedy": self.target.greedy_tokens(out.last_hidden[0, len(ref.prompt_ids) - 1:]).cpu()}
            if check:
                self._check_reference(ref, value["greedy"])
            self.disk.put_tensors("features", slot, key, value)
            if written is not None:
                written.append(("features", slot))
        elif check:
            self._check_reference(ref, value["greedy"])
        report.record("features", look, _label(ref))
        self.memory.put(mkey, value)
        return _on(value, self.target.device)

    def _check_reference(self, ref: Reference, greedy: torch.Tensor) -> None:
        first = _first_divergence(greedy.tolist(), ref.ext)
        if first is None:
            return
        raise ReferenceSourceError(
            f"the reference for prompt {ref.name!r} from {ref.source} is not the target's greedy output: at response "
            f"token {first} it has id {ref.ext[first]}, the target's argmax is {int(greedy[first])}; nothing was "
            "measured or cached. Usual causes: the server re-tokenizes text, serves another checkpoint or dtype, or "
            "applies the chat template twice. Use local references (no reference server), or measure on this text "
            "anyway with option reference_mismatch='measure' (dflash-eval run --measure-mismatched-references)")

    def _run(self, drafter: DFlashDrafter, refs: list[Reference], suite: Suite, opts: EvalOptions,
             report: CacheReport, timings: dict[str, float], check: bool = False,
             written: list | None = None, probe: bool = False, sampling_id: dict | None = None) -> DrafterRun:
        cfg = drafter.config
        B = cfg.block_size
        leak = LeakProbe(B, opts.leak_probe_anchors, len(refs)) if probe and opts.leak_probe_anchors else None
        quota = -(-opts.anchor_sample // max(len(refs), 1))
        path, costs = self._drafting_path(drafter, opts)
        t0, drafted = timings.get("draft", 0.0), {"blocks": 0, "head_slots": 0}
        run = self._run_walk if path == "walk" else self._run_all
        scores = run(drafter, refs, suite, opts, report, timings, check, written, sampling_id, leak, quota, drafted)
        tokens = sum(len(r.tokens) for r in refs)
        if tokens and costs is not None:  # what the next "auto" choice for this drafter shape reads
            costs[path] = (timings.get("draft", 0.0) - t0) / tokens
        with _timer(timings, "score"):
            summary = summarize(scores, B, opts.mode, tree_budget=opts.tree_budget, tree_spine=opts.tree_spine,
                                max_blocks=opts.max_blocks, n_resamples=opts.bootstrap, seed=opts.seed)
        sampled = sum(len(sc.sample) for sc in scores)
        drafting = {"path": path, "chosen": "auto" if opts.drafting == "auto" else "given",
                    "draft_s_per_token": dict(costs) if costs else None, **drafted,
                    "anchor_sample": {"anchors": sampled, "of": tokens, "seed": opts.seed,
                                      "every_anchor": sampled == tokens, "stats": list(SAMPLED_STATS)}}
        return DrafterRun(scores, summary, B, list(cfg.layer_ids), leak.to_dict() if leak else None, drafting)

    def _drafting_path(self, drafter: DFlashDrafter, opts: EvalOptions) -> tuple[str, dict | None]:
        """"walk" or "all", and the measured drafting cost per response token of each (None: not
        measured yet) for this drafter's shape on this device (`walk.auto_path`: "auto" starts with the
        path the device favours, times the other once, then takes the cheaper, re-timing the dearer now and then)."""
        device = self.target.device.type
        key = digest({"cfg": drafter.config.to_dict(), "dtype": str(drafter.fc.weight.dtype), "device": device})
        costs = self._draft_costs.setdefault(key, {"walk": None, "all": None})
        if opts.drafting != "auto":
            return opts.drafting, costs
        runs = self._auto_runs[key] = self._auto_runs.get(key, -1) + 1
        return auto_path(device, costs, runs), costs

    def _features_for(self, ref, suite, cfg, report, timings, check, written, sampling_id) -> dict:
        with _timer(timings, "features"):
            return self._features(ref, suite, cfg.layer_ids, report, check, written,
                                  None if sampling_id is None else {**sampling_id, "sample": ref.sample})

    def _probe(self, leak: LeakProbe, drafter, ref: Reference, ids, feats, opts, timings, sample=None):
        """The leak probe's anchor-state view of `ref` (and its contract check), at anchors of `sample` (the
        run's anchor sample of `ref`) where it has enough. Returns (offsets, anchor-state argmax)."""
        embed, head = self.target.parts.embed_tokens, self.target.parts.lm_head
        P, n = len(ref.prompt_ids), len(ref.tokens)
        with _timer(timings, "leak_probe"):
            rows = probe_offsets(n, leak.quota, sample)
            kw = {"head_rows": opts.head_rows or DEFAULT_HEAD_ROWS, "backend": opts.backend}
            seen = draft_anchors(drafter, embed, head, ids, feats, P + rows, see_anchor_state=True,
                                 anchors_per_chunk=opts.anchors_per_chunk, **kw)
            leak.check_contract(ref.name, drafter, embed, head, ids, feats, P, rows, **kw)
        return rows, seen.argmax

    def _run_all(self, drafter, refs, suite, opts, report, timings, check, written, sampling_id, leak, quota,
                 drafted) -> list[PromptScore]:
        """A block at every anchor, one prompt at a time (`drafting.draft_anchors`)."""
        cfg, eos = drafter.config, self._eos(opts)
        B, embed, head = cfg.block_size, self.target.parts.embed_tokens, self.target.parts.lm_head
        topk = min(opts.tree_budget, cfg.vocab_size) if opts.tree_budget > 0 else 0
        scores = []
        for ref in self._bar(refs, f"{suite.name}: features + drafting (B={B})"):
            feats = self._features_for(ref, suite, cfg, report, timings, check, written, sampling_id)
            P, n = len(ref.prompt_ids), len(ref.tokens)
            with _timer(timings, "draft"):
                ids = torch.tensor(ref.prompt_ids + ref.tokens, device=self.target.device)
                drafts = draft_anchors(drafter, embed, head, ids, feats["features"], np.arange(P, P + n),
                                       topk=topk, topk_slots=opts.tree_budget, anchors_per_chunk=opts.anchors_per_chunk,
                                       head_rows=opts.head_rows or DEFAULT_HEAD_ROWS, backend=opts.backend)
            drafted["blocks"] += n
            drafted["head_slots"] += n * (B - 1)
            sample = sample_offsets(n, quota, opts.seed, _label(ref))
            with _timer(timings, "score"):
                sc = score_prompt(ref.name, ref.ext, n, drafts, B, tree_budget=opts.tree_budget,
                                  tree_spine=opts.tree_spine, max_blocks=opts.max_blocks, counting=opts.counting,
                                  ends_with_stop=ref.finish == "eos", stop_offset=_stop_offset(ref.ext, eos),
                                  sample=sample)
                sc.greedy = feats["greedy"].numpy()
            if leak is not None:
                rows, seen = self._probe(leak, drafter, ref, ids, feats["features"], opts, timings, sample)
                leak.add(ref.ext, rows, drafts.argmax[rows], seen)
            scores.append(sc)
        return scores

    def _run_walk(self, drafter, refs, suite, opts, report, timings, check, written, sampling_id, leak, quota,
                  drafted) -> list[PromptScore]:
        """Only the blocks the walks visit (`walk.Walker`), prompts in groups that walk together."""
        cfg, eos = drafter.config, self._eos(opts)
        B, embed, head = cfg.block_size, self.target.parts.embed_tokens, self.target.parts.lm_head
        topk = min(opts.tree_budget, cfg.vocab_size) if opts.tree_budget > 0 else 0
        walker = Walker(drafter, embed, head, topk=topk, tree_budget=opts.tree_budget, tree_spine=opts.tree_spine,
                        head_rows=opts.head_rows or DEFAULT_HEAD_ROWS)
        lengths = [max(len(r.prompt_ids) + len(r.tokens) - 1, 1) for r in refs]  # each context_kv's
        budget = group_kv_budget(drafter, [(len(r.prompt_ids), len(r.tokens)) for r in refs], head.weight.shape[0],
                                 walker.D)
        scores, bar = [], iter(self._bar(refs, f"{suite.name}: features + walk-driven drafting (B={B})"))
        for members in walk_groups(drafter, lengths, budget):  # keys within the budget
            group, lens = [refs[j] for j in members], [lengths[j] for j in members]
            seqs, extra = [], []
            kvs = GroupKV(drafter, lens) if leak is None else None
            for j, ref in enumerate(group):  # with a leak probe (an all-anchor pass), before any keys are held
                next(bar, None)
                feats = self._features_for(ref, suite, cfg, report, timings, check, written, sampling_id)
                P, n = len(ref.prompt_ids), len(ref.tokens)
                ids = torch.tensor(ref.prompt_ids + ref.tokens, device=self.target.device)
                sample = sample_offsets(n, quota, opts.seed, _label(ref))
                probed = self._probe(leak, drafter, ref, ids, feats["features"], opts, timings, sample) if leak \
                    else None
                full = np.union1d(sample, probed[0]) if probed else sample
                seqs.append(WalkSeq(ids, P, n, np.asarray(ref.ext, dtype=np.int64), full=full,
                                    max_blocks=opts.max_blocks,
                                    greedy_steps=None if opts.validate else opts.max_blocks))
                extra.append((sample, probed, feats["greedy"].numpy()))
                if kvs is not None:
                    with _timer(timings, "draft"):
                        kvs.add(j, context_kv(drafter, feats["features"][:lens[j]]))
                del feats
            if kvs is None:
                kvs = GroupKV(drafter, lens)
                for j, ref in enumerate(group):
                    # the features again (host RAM cache, else disk), counted once: read above
                    feats = self._features_for(ref, suite, cfg, CacheReport(), timings, False, None, sampling_id)
                    with _timer(timings, "draft"):
                        kvs.add(j, context_kv(drafter, feats["features"][:lens[j]]))
                    del feats
            with _timer(timings, "draft"):
                walked = walker.run(seqs, kvs)
            del kvs
            for ref, seq, got, (sample, probed, greedy) in zip(group, seqs, walked, extra, strict=False):
                drafted["blocks"] += got.blocks
                drafted["head_slots"] += got.head_slots
                with _timer(timings, "score"):
                    streaks = np.full(seq.num_tokens, -1, dtype=np.int64)
                    streaks[list(got.streak)] = list(got.streak.values())
                    sample_arg = np.stack([got.argmax[o] for o in sample.tolist()]) if sample.size else \
                        np.zeros((0, B - 1), dtype=np.int64)
                    sc = score_blocks(ref.name, ref.ext, seq.num_tokens, B, streaks,
                                      got.tree_streaks.__getitem__ if topk else None, sample, sample_arg,
                                      max_blocks=opts.max_blocks, counting=opts.counting,
                                      ends_with_stop=ref.finish == "eos", stop_offset=_stop_offset(ref.ext, eos))
                    sc.greedy = greedy
                if probed is not None:
                    rows, seen = probed
                    leak.add(ref.ext, rows, np.stack([got.argmax[o] for o in rows.tolist()]).reshape(len(rows), B - 1),
                             seen)
                scores.append(sc)
        return scores

    def _baseline_run(self, base: tuple[DFlashDrafter, CheckpointInfo], refs, suite, opts, report) -> DrafterRun:
        drafter, info = base
        key = digest({"digest": info.digest, "refs": [digest(r.to_dict()) for r in refs],
                      "opts": {k: getattr(opts, k) for k in ("mode", "counting", "tree_budget", "tree_spine",
                                                             "max_blocks", "bootstrap", "seed")},
                      "target": self.target.fingerprint()})
        if key not in self._baselines:  # a baseline is re-scored only when something it depends on changes
            if len(self._baselines) > 8:
                self._baselines.pop(next(iter(self._baselines)))
            self._baselines[key] = self._run(drafter, refs, suite, opts, report, {})  # timed as "baseline"
        return self._baselines[key]

    def _sampled(self, drafter: DFlashDrafter, suite: Suite, prompts: list[EncodedPrompt], opts: EvalOptions,
                 max_new: int, eos: int | None, lookahead: int, report: CacheReport,
                 timings: dict[str, float]) -> dict | None:
        """τ at each of `opts.temperatures`: K keyed samples of the target per prompt, each one
        drafted at every anchor and replayed like a greedy reference (docs/design.md, "Sampling")."""
        if not opts.temperatures:
            return None
        src = self.reference_source
        coupled = bool(getattr(src, "couples_sampling", False))
        sopts = opts.model_copy(update={"tree_budget": 0})  # the tree walk is greedy verification only
        out: dict[str, Any] = {
            "temperatures": list(opts.temperatures), "top_p": opts.top_p, "top_k": opts.top_k,
            "num_samples": opts.num_samples, "seed": opts.seed, "reference_source": getattr(src, "name", "local"),
            "coupling": "keyed" if coupled else "none", "by_temperature": {}}
        if not coupled:
            out["coupling_note"] = (
                f"references from {out['reference_source']} are drawn by the server's own generator (seeded per "
                "prompt and sample): τ is measured on samples of the target, but not on the keyed draws the real "
                "loop makes, so they are not checked against the target and validation cannot replay them")
        for T in opts.temperatures:
            params = SamplingParams(T, opts.top_p, opts.top_k)
            sub: dict[str, float] = {}
            with _timer(sub, "references"):
                refs, pending = self._references(suite, prompts, max_new, eos, lookahead, report,
                                                 sampling=(params, opts.seed, opts.num_samples))
            run = self._run(drafter, refs, suite, sopts, report, sub,
                            sampling_id={"sampling": params.to_dict(), "seed": opts.seed})
            for slot, key, ref in pending:
                self.disk.put_json("references", slot, key, ref.to_dict())
            entry = _sampled_entry(T, refs, run, opts)
            if opts.validate and coupled:
                with _timer(sub, "validation"):
                    full = [sc.full_walk().accept_lengths for sc in run.scores]
                    entry["validation"] = self.validate(drafter, refs, full, max_new, eos, counting=opts.counting,
                                                        sampling=(params, opts.seed))
            out["by_temperature"][temperature_key(T)] = entry
            for k, v in sub.items():
                timings[f"sampled_{k}"] = timings.get(f"sampled_{k}", 0.0) + v
        return out

    def _speedup(self, drafter: DFlashDrafter, refs: list[Reference], tau: float | None, opts: EvalOptions) -> dict:
        out: dict[str, Any] = {"draft_verify_cost_ratio": None, "estimated": None, "source": None}
        if opts.draft_verify_cost_ratio is not None:
            out.update(draft_verify_cost_ratio=opts.draft_verify_cost_ratio, source="given",
                       estimated=metrics.estimated_speedup(tau, cost_ratio=opts.draft_verify_cost_ratio))
            return out
        if not opts.measure_speed:
            return out
        ctx = int(np.median([len(r.prompt_ids) + len(r.tokens) for r in refs]))
        committed = max(1, round(tau or 1))  # hybrid targets re-run the accepted tokens after a rejection
        costs, cached = self.step_costs.get(self.target, drafter, max(ctx, drafter.config.block_size + 8), committed)
        if costs is None:
            out["source"] = "not measurable on this target (sliding-window target layers)"
            return out
        out.update(draft_verify_cost_ratio=costs["draft_s"] / costs["verify_s"],
                   verify_decode_cost_ratio=costs["verify_s"] / costs["decode_s"],
                   estimated=metrics.estimated_speedup(tau, draft_s=costs["draft_s"], verify_s=costs["verify_s"],
                                                       ar_s=costs["decode_s"]),
                   measured=costs, source=f"measured on {self.target.device}", cached=cached)
        return out

    def _bar(self, items, desc: str):
        """Progress of a per-prompt phase: a bar on a terminal, else a log line with counts and ETA
        every `progress_every_s` (a worker's log shows a long first job moving)."""
        if not self.progress:
            return items
        return track(items, desc, unit="prompts", every_s=self.progress_every_s, logger=log)


def _estimate_at(speed: dict, tau: float | None) -> float | None:
    """The speed-up estimate of `speed` (measured step costs or a given cost ratio) at another τ."""
    costs = speed.get("measured")
    if costs:
        return metrics.estimated_speedup(tau, draft_s=costs["draft_s"], verify_s=costs["verify_s"],
                                         ar_s=costs["decode_s"])
    if speed.get("source") == "given":
        return metrics.estimated_speedup(tau, cost_ratio=speed["draft_verify_cost_ratio"])
    return None


def _sampled_entry(temperature: float, refs: list[Reference], run: DrafterRun, opts: EvalOptions) -> dict:
    """One temperature's block of the result: τ over prompts of the mean over their K samples,
    its interval resampling prompts and then samples within each, histogram and per-slot
    figures over every (prompt, sample) step."""
    s, K = run.summary, opts.num_samples
    groups = [s.per_prompt_tau[i:i + K] for i in range(0, len(refs), K)]
    per_prompt = [None if all(t is None for t in g) else float(np.mean([t for t in g if t is not None]))
                  for g in groups]
    macro = [t for t in per_prompt if t is not None]
    ci = metrics.nested_bootstrap_ci(groups, n_resamples=opts.bootstrap, seed=opts.seed)
    return {
        "temperature": temperature,
        "tau": {"macro": float(np.mean(macro)) if macro else None, "pooled": s.tau["pooled"],
                "ci95": list(ci) if ci else None, "num_steps": s.tau["num_steps"],
                "num_pairs": sum(t is not None for t in s.per_prompt_tau)},
        "acceptance_histogram": s.histogram, "per_position": s.per_position,
        "mean_streak_all_anchors": s.mean_streak_all_anchors,
        "prompts": [{"name": refs[i * K].name, "tau": t, "sample_taus": g,
                     "num_tokens": [len(r.tokens) for r in refs[i * K:(i + 1) * K]]}
                    for i, (t, g) in enumerate(zip(per_prompt, groups, strict=False))],
        "validation": None}


def _stop_offset(ext: list[int], eos: int | None) -> int | None:
    """Where the reference's first stop token lies, its lookahead included (DeepSpec's counting stops
    there; a reference cut at max_new_tokens can hold one in its lookahead)."""
    return ext.index(eos) if eos is not None and eos in ext else None


def _label(ref: Reference) -> str:
    return ref.name if ref.sample is None else f"{ref.name}#{ref.sample}"


def _on(value: dict, device: torch.device) -> dict:
    return {k: v.to(device) if k == "features" else v for k, v in value.items()}


def _first_divergence(greedy: list[int], ext: list[int]) -> int | None:
    """First response offset where the target's own argmax differs from the reference."""
    for i, (g, r) in enumerate(zip(greedy, ext, strict=False)):
        if g != r:
            return i
    return None


def _char_spans(decode, tokens: list[int], token_spans: list[tuple[int, int]]) -> tuple[str, list[list[int]]]:
    """The reference text and each step's [start, end) character span in it."""
    text = decode(tokens)
    cuts = sorted({0, len(tokens)} | {a for a, _ in token_spans} | {b for _, b in token_spans})
    offset = {c: min(len(decode(tokens[:c])), len(text)) for c in cuts}
    spans, last = [], 0
    for a, b in token_spans:
        lo = max(offset[a], last)  # byte-level BPE: partial characters can shift a prefix's length
        hi = max(offset[b], lo)
        spans.append([lo, hi])
        last = hi
    return text, spans


@contextmanager
def _timer(timings: dict[str, float], name: str):
    t = time.perf_counter()
    try:
        yield
    finally:
        timings[name] = timings.get(name, 0.0) + time.perf_counter() - t


__all__ = ["Evaluator", "EvalOptions", "EvalResult"]
