"""Per-checkpoint cost of the engine as issue 26 found it vs today's, side by side (issue 26's "today's time").

    python bench/filed_cost.py [--cases demo,tau8,forced8,forced8_peaked,forced8_spine,qwen3]
                               [--filed 83a01d9^] [--paths filed,all,walk] [--num-prompts 8]
                               [--max-new-tokens 128] [--real-max-new-tokens 64] [--work DIR] [--repeat 2] [--json OUT]

`bench/walk_cost.py`'s "today" is the current code's `drafting="all"` path, which this issue's own
work sped up as well (the top-k rule's log-sum-exp serves both paths). "Filed" here is the engine at
`--filed` (default 83a01d9^, the commit before walk-driven drafting), checked out into a throwaway
git worktree (removed afterwards) and run in its own process with PYTHONPATH pointing at it; the
current engine runs in a second process (`drafting="all"` and `"walk"`). Both evaluate the same
checkpoint directory, target directory (the tiny target's files from this checkout; the Qwen3
real-shape fixture saved once into --work) and suite file, one thread each, each with its own cache
(warm: one untimed evaluation first). The processes take turns, one call at a time:
  - --repeat calls each under the RSS sampler (bench/eval_speed.py `peak_during`): highest peak;
  - per path one call under the torch profiler: peak live tensor bytes (tests/support/tensor_peak.py,
    deterministic), of the whole call and of the drafting run (`Evaluator._run`) above its start;
  - --repeat plain calls each: fastest time.
Greedy macro τ and tree τ must be equal across the paths (checked before a row is printed); the
other result fields both versions have are compared too and the differing ones named (the walk
takes its all-anchor statistics from a seeded anchor sample, so some differ by design).

Cases: `demo` / `tau8` the tiny target with walk_cost.py's fitted 2-layer B=16 drafters (the same
fits, kept in --work); `qwen3` / `qwen3_5` the real-shape fixtures at vocab 151,936 / 248,320 (random
1-layer drafter);
`forced8` / `forced8_peaked` / `forced8_spine` / `forced8_wide_peaked` walk_cost.py's τ ≈ 9 constructions
(the last at vocab 151,936 and hidden 1024, its target saved once into --work), drafting phase only
(`walk_cost.forced_case`): the parent saves the drafter and the prompts, features and references; the
filed engine drafts them with its own `draft_anchors` + `score_prompt` (the same API then, less the
anchor sample), this one with `walk_cost.forced_all` / `forced_walk`; per-prompt accept lengths compared.
"""
from __future__ import annotations

import argparse
import functools
import gc
import importlib.util
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if "MALLOC_MMAP_THRESHOLD_" not in os.environ:  # RSS that tracks live memory (see eval_speed.py); children inherit
    os.execve(sys.executable, [sys.executable, *sys.argv],
              {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_TRIM_THRESHOLD_": "0"})

REPO = Path(__file__).resolve().parents[1]
FILED = "83a01d9^"  # the parent of "Walk-driven drafting ...": the engine as issue 26 was filed against
RESULT = "@@result "  # a child's reply line on stdout (anything else there is passed through)


def _load_file(name: str, path: Path):
    """A module from a file of this checkout, without leaving this checkout on sys.path (a child
    imports the engine from another checkout)."""
    saved = list(sys.path)
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    sys.path[:] = saved
    return mod


# --- child: one engine, warm, answering one call per request -----------------------------------------------------

def child(args) -> None:
    import torch

    tensor_peak = _load_file("_tensor_peak", REPO / "tests" / "support" / "tensor_peak.py")
    rss = _load_file("_eval_speed", REPO / "bench" / "eval_speed.py")
    torch.set_num_threads(1)
    from eval_worker.engine.acceptance import Evaluator

    engine = Path(str(sys.modules["eval_worker"].__file__)).resolve().parents[1]
    assert engine == Path(args.engine).resolve(), f"engine imported from {engine}, not {args.engine}"
    ev = Evaluator(args.target, args.cache, progress=False)
    base = json.loads(args.options)
    marks: list[int] = []
    if "forced" in base:
        call = forced_call(args, ev, base["forced"], marks)
    else:
        def call(drafting):
            opts = dict(base, **({"drafting": drafting} if drafting else {}))
            return ev.evaluate(args.checkpoint, args.suite, options=opts)

        # the drafting run (features from cache, drafting, leak probe, scoring): both versions have `_run`
        ev._run = tensor_peak.marked(ev._run, marks)  # type: ignore[method-assign]
    call(None if args.engine_kind == "filed" else "walk")  # warm: references, features, one-time setup
    for line in sys.stdin:
        req = json.loads(line)
        fn = functools.partial(call, req["drafting"])
        gc.collect()
        marks.clear()
        reply: dict = {}
        if req["how"] == "tensor":
            res, events = tensor_peak.tensor_events_during(fn)
            assert len(marks) == 2, marks  # one drafting run per call (no baseline)
            reply["tensor_mb"] = tensor_peak.peak_live_bytes(events) / 2**20
            reply["run_tensor_mb"] = tensor_peak.peak_live_bytes(events, *marks) / 2**20
        elif req["how"] == "rss":
            res, _, reply["rss_mb"] = rss.peak_during(fn)
        else:
            t = time.perf_counter()
            res = fn()
            reply["s"] = time.perf_counter() - t
        if req.get("result"):
            d = res if isinstance(res, dict) else res.to_dict()
            d.pop("provenance", None), d.pop("cache", None)
            Path(req["result"]).write_text(json.dumps(d))
        print(RESULT + json.dumps(reply), flush=True)


def forced_call(args, ev, spec: dict, marks: list[int]):
    """The forced τ ≈ 9 cases (walk_cost.py `forced_case`), drafting phase only, on inputs the parent saved:
    the filed engine's `draft_anchors` + `score_prompt`; this one's `forced_all` / `forced_walk`."""
    import torch

    from eval_worker.engine.checkpoint_source import open_drafter

    drafter = open_drafter(args.checkpoint, ev.target)[0]
    data = torch.load(spec["inputs"], weights_only=True)
    seqs, n, quota, spine = data["seqs"], data["n"], data["quota"], spec["spine"]
    embed, head = ev.target.parts.embed_tokens, ev.target.parts.lm_head
    B = drafter.config.block_size

    def summary(scores):
        walks = [[list(s.online.accept_lengths), list(s.tree_online.accept_lengths)] for s in scores]
        return {"tau": {"macro": sum(s.online.tau for s in scores) / len(scores)},
                "tree": {"tau": sum(s.tree_online.tau for s in scores) / len(scores)},
                "prompts": [{"accept_lengths": g, "tree_accept_lengths": t} for g, t in walks]}

    def filed(_):
        import numpy as np

        from eval_worker.engine.drafting import draft_anchors
        from eval_worker.engine.scoring import score_prompt

        out = []
        for j, (prompt, feats, ext) in enumerate(seqs):
            P = len(prompt)
            d = draft_anchors(drafter, embed, head, torch.tensor(prompt + ext[:n]), feats, np.arange(P, P + n),
                              topk=8, topk_slots=8)
            out.append(score_prompt(f"p{j}", ext, n, d, B, tree_budget=8, tree_spine=spine, max_blocks=None,
                                    counting="response", ends_with_stop=False))
        return summary(out)

    def current(drafting):
        from bench.walk_cost import forced_all, forced_walk

        if drafting == "all":
            return summary(forced_all(drafter, embed, head, seqs, n, quota, spine))
        return summary(forced_walk(drafter, embed, head, seqs, n, quota, spine)[0])

    fn = filed if args.engine_kind == "filed" else current

    def call(drafting):  # the whole call is the drafting phase
        marks.append(time.time_ns())
        try:
            return fn(drafting)
        finally:
            marks.append(time.time_ns())

    return call


# --- parent ------------------------------------------------------------------------------------------------------

class Engine:
    """A child process running one checkout's engine."""

    def __init__(self, kind: str, root: Path, target: Path, ckpt: Path, suite: Path, options: dict, work: Path):
        env = {**os.environ, "PYTHONPATH": str(root), "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        cache = Path(tempfile.mkdtemp(dir=work, prefix=f"cache-{kind}-"))
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--child", "--engine", str(root), "--engine-kind", kind,
             "--target", str(target), "--checkpoint", str(ckpt), "--suite", str(suite), "--cache", str(cache),
             "--options", json.dumps(options)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=str(work))
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.stdin, self.stdout = self.proc.stdin, self.proc.stdout

    def ask(self, drafting: str | None, how: str, result: Path | None = None) -> dict:
        req = {"drafting": drafting, "how": how, "result": str(result) if result else None}
        self.stdin.write(json.dumps(req) + "\n")
        self.stdin.flush()
        for line in self.stdout:
            if line.startswith(RESULT):
                return json.loads(line[len(RESULT):])
            sys.stdout.write(line)
        raise RuntimeError(f"engine child exited with {self.proc.wait()}")

    def close(self) -> None:
        self.stdin.close()
        self.proc.wait(timeout=60)


def flat(d, prefix=""):
    """{dotted path: leaf} of a nested dict (a list of dicts by index, `prompts[3].tau`; other lists are leaves)."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(flat(v, f"{prefix}{k}."))
        elif isinstance(v, list) and v and all(isinstance(x, dict) for x in v):
            for i, x in enumerate(v):
                out.update(flat(x, f"{prefix}{k}[{i}]."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def compare(a: dict, b: dict) -> tuple[list[str], list[str], list[str]]:
    """(fields equal in a and b, fields that differ, fields only one has), dotted to two levels, list indices
    folded (`prompts[].tau`: some prompt's differs)."""
    fa, fb = flat(a), flat(b)
    short = lambda ks: sorted({".".join(re.sub(r"\[\d+\]", "[]", k).split(".")[:2]) for k in ks})  # noqa: E731
    both = fa.keys() & fb.keys()
    differ = short(k for k in both if fa[k] != fb[k])
    return sorted(set(short(both)) - set(differ)), differ, short(fa.keys() ^ fb.keys())


def prepare(name: str, args, work: Path):
    """(target dir, checkpoint dir, suite file, filed options, current options, vocab) of a case; the checkpoint
    is walk_cost.py's own fit."""
    sys.path.insert(0, str(REPO))
    from bench.walk_cost import CASES, fitted_checkpoint
    from dflash_train.core.target import Target
    from eval_worker.engine.acceptance import Evaluator
    from eval_worker.engine.suite import load_suite

    if name.startswith("forced8"):
        return prepare_forced(name, args, work)
    kind, layers, steps = CASES[name]
    max_new = args.max_new_tokens if kind == "tiny" else args.real_max_new_tokens
    if kind == "tiny":
        tdir = REPO / "dflash_train" / "assets" / "tiny_target"
    else:  # the real-shape fixture, saved once as a model directory both engines load
        tdir = work / f"{kind}-real-shape"
        if not (tdir / "config.json").is_file():
            from tests.support import factories

            factories.save_target(getattr(factories, f"{kind}_real_shape")(), tdir)
    target = Target.load(tdir)
    suite_file = REPO / "eval_worker" / "engine" / "suites" / "coding.jsonl"
    suite = load_suite(str(suite_file)).head(args.num_prompts)
    suite.max_new_tokens = max_new
    ev = Evaluator(target, Path(tempfile.mkdtemp(dir=work, prefix="cache-fit-")), progress=False)
    ckpt = fitted_checkpoint(target, kind, layers, steps, suite, work, ev)
    tokens = args.num_prompts * max_new  # the anchor sample and the leak probe scaled as in walk_cost.py
    options = {"measure_speed": False, "tree_budget": 8, "num_prompts": args.num_prompts, "max_new_tokens": max_new,
               "leak_probe_anchors": max(8, round(256 * tokens / 34_500))}
    new_options = {**options, "anchor_sample": max(8, round(512 * tokens / 34_500))}
    return tdir, ckpt, suite_file, options, new_options, target.vocab_size


def prepare_forced(name: str, args, work: Path):
    """walk_cost.py's forced inputs (its drafter saved as a checkpoint, prompts, features and references to a
    file) for both engines' children."""
    import torch

    from bench.walk_cost import forced_inputs
    from dflash_train.checkpoints.checkpoint import save_drafter

    peaked, wide = "peaked" in name, "wide" in name
    target, drafter, seqs, quota = forced_inputs(args, peaked, wide)
    n = args.real_max_new_tokens if wide else args.max_new_tokens
    tag = f"forced{'-wide' if wide else ''}{'-peaked' if peaked else ''}-p{args.num_prompts}-n{n}"
    ckpt = work / tag
    save_drafter(drafter, ckpt)
    inputs = work / f"{tag}-inputs.pt"
    torch.save({"seqs": seqs, "n": n, "quota": quota}, inputs)
    options = {"forced": {"inputs": str(inputs), "spine": "spine" in name}}
    tdir = REPO / "dflash_train" / "assets" / "tiny_target"
    if wide:  # walk_cost.py's wide target (its random weights, seed 0), saved once for both engines to load
        tdir = work / "qwen3-wide-target"
        if not (tdir / "config.json").is_file():
            from tests.support import factories

            factories.save_target(target, tdir)
    return tdir, ckpt, Path("-"), options, options, target.vocab_size


def run_case(name: str, args, work: Path, filed_root: Path) -> dict:
    tdir, ckpt, suite, options, new_options, vocab = prepare(name, args, work)
    paths = args.paths.split(",")
    engines = {}
    if "filed" in paths:
        engines["filed"] = Engine("filed", filed_root, tdir, ckpt, suite, options, work)
    if {"all", "walk"} & set(paths):
        engines["current"] = Engine("current", REPO, tdir, ckpt, suite, new_options, work)
    which = {"filed": ("filed", None), "all": ("current", "all"), "walk": ("current", "walk")}
    out: dict = {p: {"s": [], "rss_mb": [], "tensor": None} for p in paths}
    results = {}
    try:
        for _ in range(args.repeat):
            for p in paths:
                e, drafting = which[p]
                out[p]["rss_mb"].append(engines[e].ask(drafting, "rss")["rss_mb"])
        for p in paths:  # after the RSS runs: the profiler's buffers leave the heap larger (RSS then reads ~0)
            e, drafting = which[p]
            file = work / f"result-{name}-{p}.json"
            out[p]["tensor"] = engines[e].ask(drafting, "tensor", file)
            results[p] = json.loads(file.read_text())
        for _ in range(args.repeat):
            for p in paths:
                e, drafting = which[p]
                out[p]["s"].append(engines[e].ask(drafting, "plain")["s"])
    finally:
        for engine in engines.values():
            engine.close()
    taus = {p: (r["tau"]["macro"], r["tree"]["tau"]) for p, r in results.items()}
    assert len(set(taus.values())) == 1, f"greedy / tree τ differ between paths: {taus}"
    row = {"case": name, "vocab": vocab, "tau": taus[paths[0]][0], "tree_tau": taus[paths[0]][1]}
    for p in paths:
        row[p] = {"s": min(out[p]["s"]), "all_s": out[p]["s"], "rss_mb": max(out[p]["rss_mb"]), **out[p]["tensor"]}
        if p != paths[0]:
            row[p]["fields_equal"], row[p]["fields_differ"], row[p]["fields_not_in_both"] = compare(
                results[paths[0]], results[p])
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default="demo,tau8,forced8,forced8_peaked,forced8_spine,qwen3")
    p.add_argument("--filed", default=FILED, help="the commit whose engine is 'today as filed'")
    p.add_argument("--paths", default="filed,all,walk", help="filed: that commit's engine; all / walk: this one's")
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=128, help="reference tokens, tiny target")
    p.add_argument("--real-max-new-tokens", type=int, default=64, help="reference tokens, real-shape targets")
    p.add_argument("--work", default=str(Path(tempfile.gettempdir()) / "dflash-walk-bench"))
    p.add_argument("--repeat", type=int, default=2, help="alternate calls per path: fastest time, highest RSS peak")
    p.add_argument("--json")
    for flag in ("--engine", "--engine-kind", "--target", "--checkpoint", "--suite", "--cache", "--options"):
        p.add_argument(flag, help=argparse.SUPPRESS)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args)
    import torch

    torch.set_num_threads(1)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    filed_root = Path(tempfile.mkdtemp(dir=work, prefix="filed-"))
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", str(filed_root), args.filed],
                   check=True, capture_output=True)
    commit = subprocess.run(["git", "-C", str(filed_root), "log", "-1", "--format=%h %s"], check=True,
                            capture_output=True, text=True).stdout.strip()
    print(f"filed engine: {commit[:100]}\nload average at start: {os.getloadavg()}", flush=True)
    rows = []
    try:
        for name in args.cases.split(","):
            r = run_case(name, args, work, filed_root)
            rows.append(r)
            paths = args.paths.split(",")
            print(f"{name:>6} vocab {r['vocab']:>7} τ {r['tau']:.2f} / tree {r['tree_tau']:.2f}", flush=True)
            for k in paths:
                x = r[k]
                print(f"  {k:>6}: {x['s']:.2f} s (runs {', '.join(f'{t:.2f}' for t in x['all_s'])}); tensors: call "
                      f"{x['tensor_mb']:.2f} MB, drafting run {x['run_tensor_mb']:.2f} MB; RSS {x['rss_mb']:.1f} MB"
                      + (f"; fields differing from {paths[0]}: {x['fields_differ']}, in one only: "
                         f"{x['fields_not_in_both']}" if k != paths[0] else ""), flush=True)
    finally:
        subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(filed_root)], check=False)
    print(f"load average at end: {os.getloadavg()}")
    if args.json:
        Path(args.json).write_text(json.dumps({"filed": commit, "cases": rows}, indent=2))


if __name__ == "__main__":
    main()
