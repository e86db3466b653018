"""The parts of bench/gpu_check.sh (run one per process, each bounded by `timeout` there) and its table.

    python bench/gpu_check.py PART --results FILE [--dry-run]
    PART: smoke | trainer | engine | table

Every measurement is appended to FILE (one JSON object a line) as soon as it is taken, so a part
killed by its timeout still leaves what it measured; `table` prints them all as one table.
--dry-run: the same code on the CPU at tiny shapes (tests/integration/test_gpu_check.py runs it), with every
installed package the device image lacks (and bench/gpu_wheels.txt does not carry) hidden from imports
(GPU_CHECK_FULL_ENV=1: not hidden).

smoke:   flex vs SDPA losses on the bundled tiny target (same data and seed), then the trainer's
         hidden-state queue off vs on (bench/train_throughput.py's runner).
trainer: a Qwen3-8B-shaped target (random weights, bf16), a 1-layer drafter: target tokens/s and
         peak GPU memory with flex and with SDPA.
engine:  the same target: HF `generate` ms/token at batch 1 and batch 8; then the engine through its
         public entry point (`Evaluator.evaluate`) on 8 prompts x 256 tokens: a cold evaluation
         (phases, reference decoding ms/token: whatever reference path is current), warm evaluations
         of further checkpoints, and drafting walk vs all vs auto.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

# Qwen3-8B (config.json of the published model) and, for --dry-run, a tiny stand-in of the same kind
QWEN3_8B = dict(hidden_size=4096, intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                num_key_value_heads=8, head_dim=128)
DRY_8B = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16)
WHEELS_FILE = REPO / "bench" / "gpu_wheels.txt"
# what the lent machine's image has (/work/shared/notes/gpu.md), with their own requirements
DEVICE_IMAGE = ("torch", "transformers", "accelerate", "safetensors", "tokenizers", "numpy", "xxhash", "filelock",
                "psutil", "fsspec", "pyyaml", "pytest", "hypothesis", "tensorboard")


class Results:
    """Append-only JSON lines: what was measured so far survives a timeout."""

    def __init__(self, path: str, part: str):
        self.path, self.part = Path(path), part

    def add(self, key: str, **values) -> None:
        rec = {"part": self.part, "key": key, **values}
        with self.path.open("a") as f:
            f.write(json.dumps(rec) + "\n")
        print(f"[{self.part}] {key}: {json.dumps(values)}", flush=True)


def _sync(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.synchronize()


def _peak_reset(device: str) -> None:
    import torch

    if device == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def _peak_gb(device: str) -> float | None:
    import torch

    return torch.cuda.max_memory_allocated() / 1e9 if device == "cuda" else None


# --- targets -------------------------------------------------------------------------------------
def qwen3_shaped(dims: dict, device: str, dtype, seed: int = 0, tokenizer: bool = True):
    """A Qwen3 model of the given dims at the real vocabulary (151,936, untied head), random weights,
    built directly on `device` in `dtype`, with the real-shape byte-level tokenizer (tests/support)."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from dflash_train.core.target import Target
    from tests.support.factories import QWEN3_SPECIALS, QWEN3_VOCAB, byte_level_tokenizer

    cfg = Qwen3Config(vocab_size=QWEN3_VOCAB, max_position_embeddings=40960, tie_word_embeddings=False,
                      rope_parameters={"rope_type": "default", "rope_theta": 1e6}, bos_token_id=151643,
                      eos_token_id=151645, **dims)
    torch.manual_seed(seed)
    t = time.perf_counter()
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = Qwen3ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(old)
    model.generation_config.eos_token_id = [151645, 151643]
    _sync(device)
    built_s = time.perf_counter() - t
    return Target(model, byte_level_tokenizer(tuple(QWEN3_SPECIALS.items())) if tokenizer else None), built_s


# --- smoke: flex vs SDPA losses, queue off vs on ---------------------------------------------------
def part_smoke(args, res: Results) -> None:
    import torch

    from bench.train_throughput import run as throughput_run
    from dflash_train.training.train_config import TrainConfig
    from dflash_train.training.trainer import Trainer

    dev = "cpu" if args.dry_run else "cuda"
    target = examples = mask_id = None
    if args.dry_run:  # a random tiny target and examples (no response regeneration)
        from tests.support.factories import MASK_ID
        from tests.support.train_helpers import target_and_examples

        target, ex = target_and_examples(n=8, hidden=64)
        examples, mask_id = list(ex), MASK_ID
    steps = 2 if args.dry_run else 6
    # flex cannot train off CUDA: the dry run compares SDPA with auto (which resolves to SDPA there)
    backends = ("sdpa", "auto") if args.dry_run else ("sdpa", "flex")
    losses = {}
    with tempfile.TemporaryDirectory() as root:
        for backend in backends:
            # on CUDA the shapes of the queue runs below, so their compiled flex kernels are reused
            cfg = TrainConfig(target="builtin:tiny-target", device=dev, backend=backend, max_steps=steps,
                              batch_size=4 if args.dry_run else 8, num_anchors=4 if args.dry_run else 64,
                              block_size=16, num_features=3, mask_token_id=mask_id, num_prompts=32,
                              max_new_tokens=96, data="builtin:stdlib-mix", max_seq_len=64 if args.dry_run else 256,
                              seq_multiple=16 if args.dry_run else 64,
                              checkpoint_root=root, run_id=f"smoke-{backend}", publish_every=10**6, progress=False,
                              resume="never", data_cache_dir=f"{root}/cache", queue_depth=2, log_every=10**6)
            t = time.perf_counter()
            tr = Trainer(cfg, target=target, examples=examples)
            target, examples = tr.target, tr.examples
            s = tr.train()
            _sync(dev)
            losses[backend] = s.losses
            res.add(f"losses.{backend}", backend=tr.backend, steps=len(s.losses), seconds=time.perf_counter() - t,
                    losses=[round(x, 5) for x in s.losses])
    a, b = losses[backends[0]], losses[backends[1]]
    diff = max(abs(x - y) for x, y in zip(a, b, strict=True))
    res.add("losses.max_diff", value=diff, ok=diff < 0.05 * max(max(a), 1e-9))

    q = SimpleNamespace(target="builtin:tiny-target", device=dev, backend="auto", steps=4 if args.dry_run else 25,
                        warmup=1 if args.dry_run else 5, batch_size=4 if args.dry_run else 8,
                        num_anchors=4 if args.dry_run else 64, drafter_layers=1, data="builtin:stdlib-mix",
                        num_prompts=32, threads=torch.get_num_threads())
    with tempfile.TemporaryDirectory() as root:
        rows = [throughput_run(q, depth, target, examples, mask_id, root) for depth in (0, 2)]
    for r in rows:
        res.add(f"queue.depth{r['depth']}", tokens_per_s=r["tokens_per_s"], step_ms=r["step_ms"],
                consumer_wait=r["consumer_wait_fraction"], final_loss=r["final_loss"])
    res.add("queue.ratio", value=rows[1]["tokens_per_s"] / rows[0]["tokens_per_s"])


# --- trainer at a Qwen3-8B shape ---------------------------------------------------------------------
def part_trainer(args, res: Results) -> None:
    import torch

    from bench.train_throughput import StepClock
    from dflash_train.training.data import Example
    from dflash_train.training.train_config import TrainConfig
    from dflash_train.training.trainer import Trainer

    dev = "cpu" if args.dry_run else "cuda"
    target, built_s = qwen3_shaped(DRY_8B if args.dry_run else QWEN3_8B, dev,
                                   torch.float32 if args.dry_run else torch.bfloat16, tokenizer=False)
    res.add("target", device=dev, dtype=str(target.dtype), built_s=built_s,
            params_b=sum(p.numel() for p in target.model.parameters()) / 1e9)
    seq = 64 if args.dry_run else 512
    g = torch.Generator().manual_seed(0)
    # random ids: the labels are the target's own greedy tokens (computed in the step), not the text
    examples = [Example(torch.randint(0, 151000, (seq,), generator=g).tolist(), seq // 4, f"r{i}") for i in range(64)]
    steps, warmup = (2, 1) if args.dry_run else (10, 3)
    backends = ("sdpa", "auto") if args.dry_run else ("flex", "sdpa")
    with tempfile.TemporaryDirectory() as root:
        for backend in backends:
            cfg = TrainConfig(target="unused", device=dev, backend=backend, max_steps=steps,
                              batch_size=2 if args.dry_run else 4, num_anchors=4 if args.dry_run else 64,
                              block_size=16, drafter_layers=1, num_features=3, mask_token_id=151669,
                              max_seq_len=seq, seq_multiple=16, checkpoint_root=root, run_id=f"t8b-{backend}",
                              publish_every=10**6, progress=False, resume="never", queue_depth=2, log_every=10**6)
            _peak_reset(dev)
            clock = StepClock()
            t = time.perf_counter()
            tr = Trainer(cfg, [clock], target=target, examples=examples)
            s = tr.train()
            _sync(dev)
            dt = clock.times[-1] - clock.times[warmup - 1]
            res.add(f"trainer.{backend}", backend=tr.backend, tokens_per_s=sum(clock.tokens[warmup:]) / dt,
                    step_ms=1000 * dt / (len(clock.times) - warmup), peak_gb=_peak_gb(dev),
                    wall_s=time.perf_counter() - t, final_loss=s.losses[-1])
            del tr


# --- engine at a Qwen3-8B shape, and HF generate on the same model ---------------------------------------
def _generate_ms(target, prompts: list[list[int]], new: int, dev: str) -> dict:
    """HF `generate` (greedy, exactly `new` tokens): ms per step and per generated token."""
    import torch

    tok = target.tokenizer
    width = max(len(p) for p in prompts)
    pad = tok.pad_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=dev)  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=dev)
    kw = dict(do_sample=False, pad_token_id=pad)
    with torch.no_grad():
        target.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=2, min_new_tokens=2, **kw)  # warm
        _sync(dev)
        t = time.perf_counter()
        out = target.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, **kw)
        _sync(dev)
    dt = time.perf_counter() - t
    made = (out.shape[1] - width) * len(prompts)
    return {"batch": len(prompts), "new_tokens": new, "ms_per_step": 1000 * dt / new, "ms_per_token": 1000 * dt / made}


def part_engine(args, res: Results) -> None:
    import torch

    from dflash_train.checkpoints.checkpoint import save_drafter
    from eval_worker.engine.acceptance import Evaluator
    from eval_worker.engine.suite import load_suite
    from tests.support.factories import real_shape_drafter

    dev = "cpu" if args.dry_run else "cuda"
    target, built_s = qwen3_shaped(DRY_8B if args.dry_run else QWEN3_8B, dev,
                                   torch.float32 if args.dry_run else torch.bfloat16)
    res.add("target", device=dev, dtype=str(target.dtype), built_s=built_s)
    n_prompts, max_new = (2, 8) if args.dry_run else (8, 256)
    suite = load_suite("coding").head(n_prompts)
    suite.max_new_tokens = max_new
    prompts = [p.ids for p in suite.encode(target.tokenizer)]

    gen_new = 4 if args.dry_run else 64
    for batch in (1, 8):
        rows = (prompts * 8)[:batch]
        res.add(f"generate.b{batch}", **_generate_ms(target, rows, gen_new, dev))

    with tempfile.TemporaryDirectory() as tmp:
        cks = []
        for seed in (1, 2, 3, 4):  # random 1-layer B=16 drafters: τ ≈ 1, where walk and all differ most
            d = real_shape_drafter(target, layers=1, block_size=16, seed=seed)
            cks.append(save_drafter(d, Path(tmp) / f"ck{seed}", dtype=target.dtype))
            del d
        ev = Evaluator(target, Path(tmp) / "cache", progress=False)

        def evaluate(key: str, ck, **options):
            _peak_reset(dev)
            t = time.perf_counter()
            r = ev.evaluate(ck, suite, options={"max_new_tokens": max_new, **options})
            wall = time.perf_counter() - t
            timings = r.provenance["timings_s"]
            tokens = sum(p.num_tokens for p in r.prompts)
            res.add(key, wall_s=wall, timings=timings, path=r.provenance["drafting"]["path"],
                    chosen=r.provenance["drafting"]["chosen"], tokens=tokens, tau=r.tau["macro"],
                    peak_gb=_peak_gb(dev))
            return timings, tokens

        timings, tokens = evaluate("engine.cold", cks[0])
        res.add("references.ms_per_token", value=1000 * timings["references"] / max(tokens, 1), tokens=tokens,
                prompts=n_prompts)
        for i, ck in enumerate(cks[1:3], 1):  # "auto": measures the path it has not yet, then picks
            evaluate(f"engine.warm{i}", ck)
        evaluate("engine.drafting.walk", cks[3], drafting="walk")
        evaluate("engine.drafting.all", cks[3], drafting="all")
        evaluate("engine.drafting.auto", cks[3], drafting="auto")


# --- the table ---------------------------------------------------------------------------------------
def _fmt(x, unit: str = "", nd: int = 2) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:,.{nd}f}{unit}"
    return f"{x}{unit}"


def table(path: Path, statuses: dict[str, str]) -> list[str]:  # noqa: C901 - one row per check, in order
    recs: dict[tuple[str, str], dict] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                recs[(r["part"], r["key"])] = r
    get = lambda part, key: recs.get((part, key), {})  # noqa: E731
    rows = [("part", "measure", "value")]
    for part, status in statuses.items():
        rows.append((part, "status", status))
    for b in ("sdpa", "flex", "auto"):
        r = get("smoke", f"losses.{b}")
        if r:
            rows.append(("smoke", f"losses, backend={b} (ran {r['backend']}), {r['steps']} steps",
                         " ".join(f"{x:.4f}" for x in r["losses"])))
    r = get("smoke", "losses.max_diff")
    if r:
        rows.append(("smoke", "max |loss difference|", f"{r['value']:.4f} ({'ok' if r['ok'] else 'DISAGREE'})"))
    for d in (0, 2):
        r = get("smoke", f"queue.depth{d}")
        if r:
            rows.append(("smoke", f"queue depth {d}: target tok/s", f"{r['tokens_per_s']:,.0f} "
                         f"({r['step_ms']:.1f} ms/step, consumer wait {r['consumer_wait']:.2f})"))
    r = get("smoke", "queue.ratio")
    if r:
        rows.append(("smoke", "queue on / off", f"{r['value']:.2f}x"))
    r = get("trainer", "target")
    if r:
        rows.append(("trainer", "Qwen3-8B-shaped target", f"{r['params_b']:.2f}B params, {r['dtype']}, "
                     f"built in {r['built_s']:.1f}s"))
    for b in ("flex", "sdpa", "auto"):
        r = get("trainer", f"trainer.{b}")
        if r:
            rows.append(("trainer", f"backend={b} (ran {r['backend']}): target tok/s, peak",
                         f"{r['tokens_per_s']:,.0f} tok/s, {_fmt(r['step_ms'], ' ms/step', 0)}, "
                         f"peak {_fmt(r['peak_gb'], ' GB', 1)}"))
    for b in (1, 8):
        r = get("engine", f"generate.b{b}")
        if r:
            rows.append(("engine", f"HF generate, batch {b}", f"{r['ms_per_token']:.2f} ms/token "
                         f"({r['ms_per_step']:.1f} ms/step, {r['new_tokens']} tokens)"))
    r = get("engine", "references.ms_per_token")
    if r:
        rows.append(("engine", f"engine references ({r['prompts']} prompts)",
                     f"{r['value']:.2f} ms/token ({r['tokens']} tokens)"))
    for key, label in (("engine.cold", "cold evaluation"), ("engine.warm1", "warm, checkpoint 2"),
                       ("engine.warm2", "warm, checkpoint 3"), ("engine.drafting.walk", "drafting=walk"),
                       ("engine.drafting.all", "drafting=all"), ("engine.drafting.auto", "drafting=auto")):
        r = get("engine", key)
        if r:
            t = r["timings"]
            phases = ", ".join(f"{k} {v:.2f}" for k, v in sorted(t.items(), key=lambda kv: -kv[1]) if k != "total")
            rows.append(("engine", f"{label} [{r['path']}, {r['chosen']}]",
                         f"{r['wall_s']:.2f}s (draft {t.get('draft', 0):.2f}s; {phases}); "
                         f"peak {_fmt(r['peak_gb'], ' GB', 1)}"))
    w = [max(len(str(row[i])) for row in rows) for i in range(3)]
    out = []
    for i, row in enumerate(rows):
        out.append("| " + " | ".join(str(c).ljust(w[j]) for j, c in enumerate(row)) + " |")
        if i == 0:
            out.append("|" + "|".join("-" * (x + 2) for x in w) + "|")
    return out


# --- what the parts imported, against what the lent machine has -------------------------------------------
def wheels() -> list[str]:
    """The packages carried as wheels to the lent machine (bench/gpu_wheels.txt)."""
    return [ln.split("#")[0].strip() for ln in WHEELS_FILE.read_text().splitlines() if ln.split("#")[0].strip()]


def _norm(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def _top_imports(path: Path) -> set[str]:
    """Top-level names a source file imports (lazy imports in functions too; relative ones left out)."""
    import ast

    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


# the lent machine's interpreter, for requirement markers
DEVICE_MARKERS = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
                  "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
                  "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}


def _requires(dist: str) -> set[str]:
    """A distribution's requirements on the lent machine (no extras; markers evaluated for its Python)."""
    from importlib.metadata import PackageNotFoundError, requires

    from packaging.requirements import Requirement

    try:
        reqs = requires(dist) or []
    except PackageNotFoundError:
        return set()
    out = set()
    for text in reqs:
        r = Requirement(text)
        if r.marker is None or r.marker.evaluate(DEVICE_MARKERS):
            out.add(_norm(r.name))
    return out


def _closure(names) -> set[str]:
    todo, seen = [_norm(n) for n in names], set()
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(_requires(name) - seen)
    return seen


def missing_on_device() -> list[str]:
    """Distributions this process needed that the lent machine would lack: what the repository's loaded
    modules imported and the carried wheels, with what those require (a `--no-deps` install leaves it to
    the image), outside the image's packages with their requirements and bench/gpu_wheels.txt. Optional
    imports inside third-party packages (accelerate's of boto3, transformers' of scipy) are not counted:
    they are skipped where the package is absent."""
    from importlib.metadata import packages_distributions

    owners = packages_distributions()
    loaded_tops = {m.split(".")[0] for m in sys.modules}
    ours = [Path(f) for m in list(sys.modules.values())
            if (f := getattr(m, "__file__", None)) and os.path.isabs(f) and Path(f).resolve().is_relative_to(REPO)
            and ".venv" not in Path(f).parts and f.endswith(".py")]
    used = set()
    for path in ours:
        for top in _top_imports(path) & loaded_tops:
            if not (REPO / top).exists():  # the repository's own packages (some wheels ship a `tests` too)
                used |= {_norm(d) for d in owners.get(top, ())}
    carried = {_norm(w) for w in wheels()}
    allowed = _closure(DEVICE_IMAGE) | carried
    # the carried wheels are installed --no-deps: what they require must be there too
    return sorted(_closure((used | carried) - {"dflash-eval"}) - allowed - {"dflash-eval"})


class _ImageOnly:
    """A sys.meta_path path finder that does not find what the lent machine lacks (so an import of it
    fails, and a probe for it answers "absent", as there)."""

    def __init__(self, inner, blocked: set[str]):
        self.inner, self.blocked = inner, blocked

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in self.blocked:
            return None
        return self.inner.find_spec(name, path, target)

    def __getattr__(self, attr):  # invalidate_caches, find_distributions, ...
        return getattr(self.inner, attr)


def emulate_device_image() -> set[str]:
    """Hide every installed package outside the device image (with its requirements) and the carried
    wheels: the dry run then imports only what a lent machine would have. Returns the hidden top-level names."""
    import importlib.machinery
    from importlib.metadata import packages_distributions

    allowed = _closure(DEVICE_IMAGE) | {_norm(w) for w in wheels()}
    blocked = {top for top, dists in packages_distributions().items()
               if not (REPO / top).exists() and not any(_norm(d) in allowed for d in dists)}
    sys.meta_path[:] = [_ImageOnly(f, blocked) if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
    return blocked


PARTS = {"smoke": part_smoke, "trainer": part_trainer, "engine": part_engine}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("part", help="smoke | trainer | engine (or several, comma-separated, in one process) | table")
    ap.add_argument("--results", required=True)
    ap.add_argument("--dry-run", action="store_true")
    ap.add_argument("--status", action="append", default=[], help="PART=STATUS lines for the table")
    args = ap.parse_args()
    if args.part == "table":
        statuses = dict(s.split("=", 1) for s in args.status)
        print("\n".join(table(Path(args.results), statuses)))
        missing = [r for r in _records(Path(args.results)) if r["key"] == "imports" and r["outside"]]
        if missing:
            print("\nFAILED: needed on the device, outside its image and bench/gpu_wheels.txt: "
                  + "; ".join(f"{r['part']}: {', '.join(r['outside'])}" for r in missing))
            sys.exit(1)
        return
    parts = args.part.split(",")
    unknown = [p for p in parts if p not in PARTS]
    if unknown:
        ap.error(f"unknown part(s) {unknown}: {', '.join(PARTS)} or table")
    if args.dry_run and os.environ.get("GPU_CHECK_FULL_ENV") != "1":
        hidden = emulate_device_image()
        print(f"dry run: {len(hidden)} installed top-level packages hidden (not on the device image nor carried)")
    import torch

    if args.dry_run:  # tiny shapes: a second thread only adds contention (the dev VM's 2 cores are shared)
        torch.set_num_threads(1)
    else:
        assert torch.cuda.is_available(), "bench/gpu_check.py needs a CUDA device (or --dry-run)"
        print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}", flush=True)
    for part in parts:
        PARTS[part](args, Results(args.results, part))
    Results(args.results, "+".join(parts)).add("imports", outside=missing_on_device())


def _records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


if __name__ == "__main__":
    main()
