"""`dflash-eval run`: evaluate one checkpoint against a target, no queue; prints a table.

Exit status: 0 evaluated; 1 evaluated but the result carries an error diagnostic (e.g. a
suspected context leak, a validation mismatch); 2 bad input (the message names it).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dflash_train.core.tau import COUNTING_RULES
from eval_worker.engine.suite import DEFAULT_SUITE, hf_suites

MULTI_SCHEMA = "dflash-eval-suites/1"
HELP = "evaluate one drafter checkpoint (acceptance length τ and friends), no queue"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True, help="published checkpoint dir or plain drafter dir, or a URL: "
                                                       "s3://bucket/runs/RUN/step-... or hf://ORG/REPO[@REVISION] "
                                                       "(pulled into $DFLASH_HOME/checkpoint-cache, verified)")
    p.add_argument("--target", required=True,
                   help="target model: a local directory, or a Hub model id ORG/NAME[@REVISION] (from the Hugging "
                        "Face cache; downloaded unless HF_HUB_OFFLINE is set)")
    p.add_argument("--baseline", help="baseline drafter dir or URL, as --checkpoint (paired Δτ per prompt)")
    p.add_argument("--suite", action="append", default=None, metavar="SUITE",
                   help="builtin:NAME[-vN], a .jsonl file, or a standard benchmark "
                        "hf:NAME[:n=N][:seed=S][:thinking=on] "
                        f"(NAME one of {', '.join(hf_suites())}; local copies: $DFLASH_HF_DATASETS_DIR); repeatable: "
                        "every suite is evaluated and their τ shown side by side (default builtin:coding-v1)")
    p.add_argument("--json", dest="json_out", help="write the full result JSON here (several suites: "
                                                     "{schema: dflash-eval-suites/1, tau: {suite: τ}, results: [...]})")
    p.add_argument("--max-new-tokens", type=int,
                   help="tokens of each greedy reference completion (default: the suite's)")
    p.add_argument("--num-prompts", type=int, help="only the first N prompts of the suite")
    p.add_argument("--max-blocks", type=int, help="at most N blocks (verify steps) per prompt")
    p.add_argument("--mode", choices=["online", "stride"], default="online",
                   help="online: replay real greedy decoding (default); stride: fixed blocks every B tokens")
    p.add_argument("--counting", choices=COUNTING_RULES, default="response",
                   help="when the online walk stops: response (default: once the response is committed), "
                        "published (z-lab dflash_generate's loop: one more step at N-1, one after an eos first "
                        "token), deepspec, vllm or sglang (their counters); see docs/design.md")
    p.add_argument("--sliding-rule", choices=["serving", "reference"], default=None,
                   help="sliding-window layers a drafter config leaves without a causal flag: serving (vLLM/SGLang: "
                   "causal within the block; default) or reference (z-lab loop: non-causal, windowed)")
    p.add_argument("--tree-budget", type=int, default=8, help="DDTree node budget (0: off)")
    p.add_argument("--tree-spine", action="store_true", help="always keep the top-1 chain in the tree")
    p.add_argument("--validate", action="store_true", help="also run the real draft-verify loop and compare")
    p.add_argument("--drafting", choices=["auto", "walk", "all"], default=None,
                   help="how blocks are drafted: walk (only the blocks the walks visit), all (a block at every "
                        "anchor) or auto (the cheaper, by measured cost; default); the same numbers either way")
    p.add_argument("--reference-drafter", choices=["checkpoint", "baseline", "none"], default=None,
                   help="missing greedy references decoded by speculative decoding with this drafter "
                        "(default: the checkpoint) or plainly (none); the same references either way")
    p.add_argument("--no-chat-template", action="store_true", help="feed prompts as plain text")
    p.add_argument("--train-accuracy", type=float, help="training accuracy, for the leak diagnostic")
    p.add_argument("--cost-ratio", type=float, help="draft/verify cost ratio of the serving hardware")
    p.add_argument("--reference-server", help="OpenAI-compatible server URL for references (SGLang/vLLM)")
    p.add_argument("--reference-model", help="model name to send to the reference server")
    p.add_argument("--measure-mismatched-references", action="store_true",
                   help="measure on a server reference even where it is not the target's greedy output "
                        "(default: such a job fails and caches nothing)")
    p.add_argument("--cache-dir", default=None, help="reference/feature cache (default $DFLASH_CACHE_DIR, else "
                                                     "$DFLASH_HOME/cache: the worker's)")
    p.add_argument("--no-cache", action="store_true", help="do not read or write the disk cache")
    p.add_argument("--dtype", default="float32", help="target dtype (float32, bfloat16)")
    p.add_argument("--device", default=None, help="target device (cpu, cuda, cuda:1)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads")
    from ._common import add_sampling_args

    add_sampling_args(p)
    p.add_argument("--no-progress", action="store_true",
                   help="no progress output (default: a bar on a terminal, else a line with counts and ETA "
                        "every 15 s)")


def main(args: argparse.Namespace) -> int:
    import logging

    import torch

    from dflash_train.checkpoints.publication import CheckpointError
    from dflash_train.core.config import ConfigError
    from dflash_train.core.target import TargetError
    from eval_worker.engine.acceptance import Evaluator
    from eval_worker.engine.references import ReferenceSourceError, ServerReferences
    from eval_worker.engine.suite import SuiteError, load_suite

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")  # progress lines
    if args.threads:
        torch.set_num_threads(args.threads)
    options = {"tree_budget": args.tree_budget, "tree_spine": args.tree_spine, "mode": args.mode,
               "counting": args.counting,
               **({"sliding_rule": args.sliding_rule} if args.sliding_rule else {}),
               "validate": args.validate, "max_new_tokens": args.max_new_tokens, "num_prompts": args.num_prompts,
               "max_blocks": args.max_blocks, "draft_verify_cost_ratio": args.cost_ratio,
               **({"drafting": args.drafting} if args.drafting else {}),
               **({"reference_drafter": args.reference_drafter} if args.reference_drafter else {})}
    from ._common import sampling_options

    options.update(sampling_options(args))
    if args.no_chat_template:
        options["chat_template"] = False
    if args.measure_mismatched_references:
        options["reference_mismatch"] = "measure"
    train_metrics = {"accuracy": args.train_accuracy} if args.train_accuracy is not None else None
    from contextlib import ExitStack

    from dflash_train.checkpoints.location import CheckpointRef

    pulls = ExitStack()
    urls: dict[str, str] = {}
    try:
        for key in ("checkpoint", "baseline"):  # a store or Hub location: evaluate a verified local copy
            where = getattr(args, key)
            if where and not CheckpointRef.parse(where).on_this_machine:
                setattr(args, key, str(_pull(where, args.settings, pulls, urls)))
        from eval_worker.engine.checkpoint_source import check_drafter_config

        for drafter_dir in filter(None, (args.checkpoint, args.baseline)):
            check_drafter_config(drafter_dir)  # before the target: its load can take minutes
        specs = list(dict.fromkeys(args.suite or [DEFAULT_SUITE]))
        suites = [load_suite(spec, hf_datasets_dir=args.settings.hf_datasets_dir) for spec in specs]  # same: early
        names = [s.name for s in suites]
        if len(set(names)) != len(names):
            raise SuiteError(f"two suites share a name ({names}); their results could not be told apart")
        from dflash_train.checkpoints.hub import resolve_target

        target = resolve_target(args.target)
        assert target is not None, "--target is required"
        evaluator = Evaluator(target, None if args.no_cache else (args.cache_dir or args.settings.cache_dir),
                              progress=not args.no_progress, dtype=args.dtype,
                              device=args.device)
        if args.reference_server:
            evaluator.reference_source = ServerReferences(args.reference_server, args.reference_model)
        results = [evaluator.evaluate(args.checkpoint, suite, baseline=args.baseline, train_metrics=train_metrics,
                                      options=options) for suite in suites]
    except (CheckpointError, ConfigError, TargetError, SuiteError, ReferenceSourceError, ValueError, OSError) as e:
        print(f"dflash-eval run: error: {e}", file=sys.stderr)
        return 2
    finally:
        pulls.close()
    dicts = [r.to_dict() for r in results]
    for d in dicts:  # the result names what was asked for, not the cache entry
        if d["checkpoint"].get("path") in urls:
            d["checkpoint"]["path"] = urls[d["checkpoint"]["path"]]
        if d.get("baseline") and d["baseline"].get("checkpoint") in urls:
            d["baseline"]["checkpoint"] = urls[d["baseline"]["checkpoint"]]
    if args.json_out:
        out = Path(args.json_out)
        out.parent.mkdir(parents=True, exist_ok=True)
        doc = dicts[0] if len(dicts) == 1 else {"schema": MULTI_SCHEMA, "tau": {d["suite"]["name"]: d["tau"]["macro"]
                                                                             for d in dicts}, "results": dicts}
        out.write_text(json.dumps(doc, indent=2) + "\n")
    print("\n\n".join(format_table(d) for d in dicts))
    if len(dicts) > 1:
        print("\n" + format_suites(dicts))
    return 1 if any(r.errors() for r in results) else 0


def _pull(url: str, settings, stack, urls: dict):
    """A verified local copy of the checkpoint at `url` (held by `stack`); `urls` maps it back."""
    import os

    from dflash_train.checkpoints.location import CheckpointRef
    from eval_worker.service.worker.checkpoint_cache import CheckpointCache

    ref = CheckpointRef.parse(url)
    url = ref.text
    if ref.kind == "hub":
        from dflash_train.checkpoints import hub

        url = hub.resolve(url)
    cache = CheckpointCache(settings.checkpoint_cache_dir, max_bytes=int(settings.checkpoint_cache_gb * 2**30))
    entry, _ = stack.enter_context(cache.checkout(url))
    urls[os.path.realpath(entry)] = url
    return entry


def format_suites(results: list[dict]) -> str:
    """τ of every suite side by side (the published tables' layout), one row per suite."""
    lines = [f"{'suite':<24} {'prompts':>7} {'τ':>6} {'95% CI':>15} {'pooled':>6} {'tree τ':>6} {'Δτ':>7} "
             f"{'steps':>6}"]
    for r in results:
        tau, b = r["tau"], r.get("baseline") or {}
        ci = tau.get("ci95") or [None, None]
        delta = b.get("delta_tau")
        lines.append(f"{r['suite']['name'][:24]:<24} {r['suite']['num_prompts']:>7} {_f(tau['macro']):>6} "
                     f"{'[' + _f(ci[0], 2) + ', ' + _f(ci[1], 2) + ']':>15} {_f(tau.get('pooled')):>6} "
                     f"{_f((r.get('tree') or {}).get('tau')):>6} {('-' if delta is None else f'{delta:+.3f}'):>7} "
                     f"{tau.get('num_steps') or 0:>6}")
    return "\n".join(lines)


def _f(x, nd=3) -> str:
    return "-" if x is None else f"{x:.{nd}f}"


# what the pooled τ is called where each of the other projects' counting rules comes from
_POOLED_AS = {"deepspec": "DeepSpec's accept_length", "vllm": "vLLM's mean acceptance length",
              "sglang": "SGLang's avg_spec_accept_length"}


def format_table(r: dict) -> str:
    """A readable summary: headline, per prompt, per position, diagnostics."""
    s, tau = r["settings"], r["tau"]
    ci = tau.get("ci95") or [None, None]
    lines = [
        f"checkpoint  {r['checkpoint']['path']}  (digest {str(r['checkpoint']['digest'])[:12]})",
        f"target      {r['target']['path']}  ({r['target']['num_layers']} layers, {r['target']['dtype']}, "
        f"fp {r['target']['fingerprint'][:12]})",
        f"suite       {r['suite']['name']}-v{r['suite']['version']}  ({r['suite']['num_prompts']} prompts, "
        f"fp {r['suite']['fingerprint'][:8]})  mode={s['mode']}  counting={s.get('counting', 'response')}  "
        f"B={s['block_size']}  max_new={s['max_new_tokens']}",
        "",
        f"τ (macro)   {_f(tau['macro'])}   95% CI [{_f(ci[0])}, {_f(ci[1])}]   pooled {_f(tau['pooled'])} "
        f"over {tau['num_steps']} verify steps",
        *([f"            --counting {s['counting']}: its figure is the pooled τ ({_POOLED_AS[s['counting']]})"]
          if s.get("counting") in _POOLED_AS else []),
        f"tree τ      {_f(r['tree'].get('tau'))}   (budget {r['tree'].get('budget')})",
        f"mean streak {_f(r['mean_streak_all_anchors'])}  (all anchors)     "
        f"stride τ {_f(r.get('stride', {}).get('tau'))}",
    ]
    sp = r.get("speedup") or {}
    if sp.get("estimated") is not None:
        lines.append(f"speedup     ~{sp['estimated']:.2f}x  (draft/verify cost {sp['draft_verify_cost_ratio']:.3f}, "
                     f"{sp.get('source')})")
    b = r.get("baseline")
    if b:
        dci = b.get("delta_ci95") or [None, None]
        lines.append(f"baseline    τ {_f(b['tau'])}   Δτ {_f(b['delta_tau'])}  95% CI [{_f(dci[0])}, {_f(dci[1])}]  "
                     f"({b['checkpoint']})")
    lines += ["", f"{'prompt':<28} {'τ':>6} {'tree':>6} {'base':>6} {'steps':>5} {'tokens':>6}"]
    for p in r["prompts"]:
        lines.append(f"{p['name'][:28]:<28} {_f(p['tau'], 2):>6} {_f(p.get('tree_tau'), 2):>6} "
                     f"{_f(p.get('baseline_tau'), 2):>6} {len(p['accept_lengths']):>5} {p.get('num_tokens', 0):>6}")
    hist = r["acceptance_histogram"]
    total = max(sum(hist), 1)
    lines += ["", "accept length histogram: " + " ".join(f"{i + 1}:{c}" for i, c in enumerate(hist) if c),
              "P(accept length):        " + " ".join(f"{c / total:.2f}" for c in hist)]
    pp = r["per_position"]
    lines.append("slot conditional accept: " + " ".join(f"{x:.2f}" for x in pp["conditional_accept"]))
    lines.append("slot top-1 accuracy:     " + " ".join(f"{x:.2f}" for x in pp["top1_accuracy"]))
    smp = r.get("sampling")
    if smp:
        lines += ["", f"sampling    top_p {smp['top_p']}  top_k {smp['top_k'] or 'off'}  K={smp['num_samples']} "
                      f"samples/prompt  seed {smp['seed']}  coupling {smp['coupling']}"]
        lines.append(f"{'temperature':<12} {'τ':>6} {'95% CI':>17} {'pooled':>7} {'steps':>6}  validation")
        lines.append(f"{'0 (greedy)':<12} {_f(tau['macro']):>6} {'[' + _f(ci[0]) + ', ' + _f(ci[1]) + ']':>17} "
                     f"{_f(tau['pooled']):>7} {tau['num_steps']:>6}")
        for key, e in smp["by_temperature"].items():
            t, tci = e["tau"], e["tau"].get("ci95") or [None, None]
            v = e.get("validation")
            check = "-" if not v else ("OK" if v["ok"] else f"{len(v['mismatched_prompts'])} MISMATCHED")
            lines.append(f"{key:<12} {_f(t['macro']):>6} {'[' + _f(tci[0]) + ', ' + _f(tci[1]) + ']':>17} "
                         f"{_f(t['pooled']):>7} {t['num_steps']:>6}  {check}")
        if smp.get("coupling_note"):
            lines.append(f"note: {smp['coupling_note']}")
    val = r.get("validation")
    if val:
        lines.append(f"validation: {val['prompts_checked']} prompts, {val['steps_checked']} steps, "
                     f"{'OK' if val['ok'] else str(len(val['mismatched_prompts'])) + ' MISMATCHED'}")
    c = r["cache"]
    lines.append(f"cache: references {c['references']}, features {c['features']}")
    t = r["provenance"]["timings_s"]
    lines.append("timings: " + ", ".join(f"{k} {v:.2f}s" for k, v in t.items()))
    if r["diagnostics"]:
        lines.append("")
        for d in r["diagnostics"]:
            lines.append(f"[{d['severity'].upper()}] {d['code']}: {d['message']}")
    return "\n".join(lines)
