"""Eval suites: a named, versioned set of prompts plus the generation settings they run with.

A suite file is JSONL. An optional first line with a `"suite"` key is the header; every
other line is one prompt:

    {"suite": "coding", "version": "1", "chat_template": true, "max_new_tokens": 128}
    {"name": "fizzbuzz", "prompt": "Write a Python function ..."}
    {"name": "chat", "messages": [{"role": "user", "content": "..."}]}
    {"name": "raw", "ids": [12, 7, 99]}          # already tokenized (used verbatim)
    {"turns": ["Write ...", "Now ..."]}           # z-lab cache/<bench>.jsonl, DeepSpec eval_datasets/*.jsonl

A `turns` row is its first turn as one user prompt, as z-lab's `benchmark.py` and DeepSpec's
`eval.py` read them (later turns would need the target's own answers; thinking off by default).

Standard benchmarks come from Hugging Face datasets (`hf:NAME[:n=N][:seed=S][:thinking=on][:revision=R]`,
see `HF_SUITES`): the rows the published DFlash benchmark script (z-lab/dflash `benchmark.py`)
reads, formatted as it formats them, rendered with the target's chat template.

The fingerprint covers everything that changes the token ids fed to the target, so a
reference or feature cache keyed by it can never be reused for a different suite; for an
`hf:` suite it also covers the dataset's identity (repository, config, split, and a digest
of the columns read over the whole split, so a revision that changes them is another suite)
and the selection (n, seed). Where the rows came from (Hub commit, local copy) is recorded
in `origin` but does not split the caches of identical data.
"""
from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import random
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_train.common import jsonutil
from dflash_train.common.errors import DFlashError
from eval_worker.engine.options import MAX_NAME, MAX_NEW_TOKENS, MAX_PROMPTS, shorten

BUILTIN_DIR = Path(__file__).resolve().parent / "suites"
DEFAULT_SUITE = "builtin:coding-v1"
DEFAULT_MAX_NEW_TOKENS = 128
# A suite file comes from whoever can write under the suite roots and runs on a shared worker:
# the job options' limits (MAX_NEW_TOKENS, MAX_PROMPTS, MAX_NAME) apply to it too, and these
MAX_SUITE_BYTES = 64 << 20         # the whole file
MAX_PROMPT_CHARS = 1 << 20         # one prompt's text (all its messages)
MAX_PROMPT_IDS = 1 << 20           # one tokenized prompt
MAX_TOKEN_ID = (1 << 31) - 1       # as the eos_token_id option
MAX_DESCRIPTION = 4096
MAX_TEMPLATE_KWARGS_BYTES = 16 << 10


class SuiteError(DFlashError, ValueError):
    """A suite that cannot be used (missing, empty, malformed); the message says where."""


_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")


def _refuse_control_characters(suite) -> None:
    """Suite and prompt names are shown by every view and sink: a control character (an ESC sequence that
    drives a terminal, a newline that forges a table row) is refused where the suite is read (issue 34 D9)."""
    for what, name in [("suite name", suite.name), *(("prompt name", p.name) for p in suite.prompts)]:
        if isinstance(name, str) and _CONTROL.search(name):
            raise SuiteError(f"suite {shorten(suite.name)} ({suite.source or 'in memory'}): {what} {shorten(name)} "
                             "holds a control character; names must be printable text")


@dataclass(frozen=True)
class Prompt:
    name: str
    prompt: str | None = None
    messages: tuple[dict, ...] | None = None
    ids: tuple[int, ...] | None = None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"name": self.name}
        if self.ids is not None:
            d["ids"] = list(self.ids)
        elif self.messages is not None:
            d["messages"] = [dict(m) for m in self.messages]
        else:
            d["prompt"] = self.prompt
        return d


@dataclass(frozen=True)
class EncodedPrompt:
    name: str
    ids: list[int]


@dataclass
class Suite:
    name: str
    version: str
    prompts: list[Prompt]
    chat_template: bool = True
    max_new_tokens: int = DEFAULT_MAX_NEW_TOKENS
    # Qwen3 templates think by default; the DFlash benchmarks run with thinking off
    chat_template_kwargs: dict[str, Any] = field(default_factory=lambda: {"enable_thinking": False})
    description: str = ""
    source: str = ""
    # where the prompts came from when that is not in the prompts themselves (an hf: suite's
    # dataset identity and selection); part of the fingerprint
    origin: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        if not self.prompts:
            raise SuiteError(f"suite {self.name!r} ({self.source or 'in memory'}) has no prompts")
        if len(self.prompts) > MAX_PROMPTS:
            raise SuiteError(f"suite {shorten(self.name)} has {len(self.prompts)} prompts; the limit is {MAX_PROMPTS}")
        # one pass over the names: MAX_PROMPTS of them must be checked in seconds (issue 34 D11)
        dup = sorted(n for n, k in Counter(p.name for p in self.prompts).items() if k > 1)
        if dup:
            more = f" and {len(dup) - 10} more" if len(dup) > 10 else ""
            names = ", ".join(shorten(n) for n in dup[:10])
            raise SuiteError(f"suite {shorten(self.name)}: duplicate prompt names {names}{more}")
        _check_max_new_tokens(self.max_new_tokens, f"suite {shorten(self.name)}")
        _refuse_control_characters(self)

    @property
    def label(self) -> str:
        return f"{self.name}-v{self.version}"

    def fingerprint(self) -> str:
        body = {"name": self.name, "version": self.version, "chat_template": bool(self.chat_template),
                "max_new_tokens": int(self.max_new_tokens), "chat_template_kwargs": self.chat_template_kwargs,
                "prompts": [p.to_dict() for p in self.prompts]}
        if self.origin is not None:  # what the data is, not where it was read from
            body["origin"] = {k: self.origin.get(k) for k in ORIGIN_IDENTITY}
        return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]

    def head(self, n: int | None) -> Suite:
        """The first n prompts (the seeds' `--num-prompts`); same name, its own fingerprint."""
        if n is None or n >= len(self.prompts):
            return self
        if n < 1:
            raise SuiteError(f"num_prompts must be >= 1 (got {n})")
        return dataclasses.replace(self, prompts=self.prompts[:n], chat_template_kwargs=dict(self.chat_template_kwargs))

    def encode(self, tokenizer, chat_template: bool | None = None) -> list[EncodedPrompt]:
        """Token ids of every prompt, as the target will see them."""
        use_chat = self.chat_template if chat_template is None else chat_template
        out = []
        for p in self.prompts:
            if p.ids is not None:
                ids = list(p.ids)
            else:
                if tokenizer is None:
                    raise SuiteError(f"prompt {p.name!r} is text but the target has no tokenizer; give 'ids'")
                ids = _encode_text(tokenizer, p, use_chat, self.chat_template_kwargs)
            if not ids:
                raise SuiteError(f"prompt {p.name!r} encodes to zero tokens")
            out.append(EncodedPrompt(p.name, ids))
        return out

    def to_dict(self) -> dict[str, Any]:
        d = {"name": self.name, "version": self.version, "fingerprint": self.fingerprint(),
             "num_prompts": len(self.prompts)}
        if self.origin is not None:
            d["origin"] = dict(self.origin)
        return d


def _encode_text(tokenizer, p: Prompt, use_chat: bool, kwargs: dict[str, Any]) -> list[int]:
    messages = list(p.messages) if p.messages is not None else [{"role": "user", "content": p.prompt}]
    if use_chat:
        if not getattr(tokenizer, "chat_template", None):
            raise SuiteError("the suite asks for the chat template but the tokenizer has none "
                             "(run with chat_template off, e.g. `--no-chat-template`)")
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    if p.messages is not None:  # no template: plain concatenation of the turns
        text = "\n".join(m["content"] for m in p.messages)
    else:
        text = p.prompt
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


# --- loading -------------------------------------------------------------------
def _check_max_new_tokens(value: Any, where: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_NEW_TOKENS:
        raise SuiteError(f"{where}: max_new_tokens must be >= 1 and <= {MAX_NEW_TOKENS} (an integer; the "
                         f"job option's limit), got {shorten(value)}")


def _check_header(header: dict[str, Any], source: str) -> None:
    """The header's values, within the limits a job's options have."""
    for key in ("suite", "version"):
        if key in header and len(str(header[key])) > MAX_NAME:
            raise SuiteError(f"{source}: header '{key}' must be at most {MAX_NAME} characters, "
                             f"got {shorten(str(header[key]))}")
    if "max_new_tokens" in header:
        _check_max_new_tokens(header["max_new_tokens"], source)
    if "description" in header and (not isinstance(header["description"], str)
                                    or len(header["description"]) > MAX_DESCRIPTION):
        raise SuiteError(f"{source}: header 'description' must be a string of at most {MAX_DESCRIPTION} characters")
    if "chat_template_kwargs" in header:
        kwargs = header["chat_template_kwargs"]
        if not isinstance(kwargs, dict) or len(json.dumps(kwargs)) > MAX_TEMPLATE_KWARGS_BYTES:
            raise SuiteError(f"{source}: header 'chat_template_kwargs' must be an object of at most "
                             f"{MAX_TEMPLATE_KWARGS_BYTES} bytes of JSON")


def parse_suite(lines: list[str], source: str, default_name: str = "suite") -> Suite:
    header: dict[str, Any] = {}
    prompts: list[Prompt] = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = jsonutil.loads(line)
        except json.JSONDecodeError as e:
            raise SuiteError(f"{source}:{lineno}: not valid JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise SuiteError(f"{source}:{lineno}: each line must be a JSON object")
        if "suite" in obj:
            if header or prompts:
                raise SuiteError(f"{source}:{lineno}: the suite header must be the first line")
            header = obj
            continue
        if len(prompts) >= MAX_PROMPTS:
            raise SuiteError(f"{source}: more than {MAX_PROMPTS} prompts (the num_prompts option's limit)")
        prompts.append(_parse_prompt(obj, f"{source}:{lineno}", len(prompts)))
    if not prompts:
        raise SuiteError(f"{source}: the suite is empty (no prompt lines)")
    known = {"suite", "version", "chat_template", "max_new_tokens", "chat_template_kwargs", "description"}
    unknown = sorted(set(header) - known)
    if unknown:
        raise SuiteError(f"{source}: unknown header fields {[shorten(k) for k in unknown][:10]} "
                         f"(known: {sorted(known)})")
    _check_header(header, source)
    kw: dict[str, Any] = {}
    if "chat_template_kwargs" in header:
        kw["chat_template_kwargs"] = dict(header["chat_template_kwargs"])
    try:
        return Suite(name=str(header.get("suite", default_name)), version=str(header.get("version", "1")),
                     prompts=prompts, chat_template=bool(header.get("chat_template", True)),
                     max_new_tokens=int(header.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)),
                     description=str(header.get("description", "")), source=source, **kw)
    except (TypeError, ValueError) as e:
        if isinstance(e, SuiteError):
            raise
        raise SuiteError(f"{source}: bad header value ({e})") from None


def _parse_prompt(obj: dict, where: str, index: int) -> Prompt:
    name = str(obj.get("name") or f"prompt_{index:03d}")
    if len(name) > MAX_NAME:
        raise SuiteError(f"{where}: prompt name {shorten(name)} is longer than {MAX_NAME} characters")
    kinds = [k for k in ("prompt", "messages", "ids", "turns") if k in obj]
    if len(kinds) != 1:
        raise SuiteError(f"{where}: give exactly one of 'prompt', 'messages', 'ids', 'turns' (got {kinds or 'none'})")
    if "turns" in obj:  # z-lab / DeepSpec benchmark rows: the first turn, as their evaluators use it
        turns = obj["turns"]
        if not isinstance(turns, list) or not turns or not isinstance(turns[0], str) or not turns[0]:
            raise SuiteError(f"{where}: 'turns' must be a non-empty list whose first item is a non-empty string")
        obj = {"prompt": turns[0]}  # checked as a prompt below (the same size limit)
    if "prompt" in obj:
        if not isinstance(obj["prompt"], str) or not obj["prompt"]:
            raise SuiteError(f"{where}: 'prompt' must be a non-empty string")
        if len(obj["prompt"]) > MAX_PROMPT_CHARS:
            raise SuiteError(f"{where}: 'prompt' is {len(obj['prompt'])} characters; the limit is {MAX_PROMPT_CHARS}")
        return Prompt(name, prompt=obj["prompt"])
    if "messages" in obj:
        msgs = obj["messages"]
        if (not isinstance(msgs, list) or not msgs
                or not all(isinstance(m, dict) and isinstance(m.get("content"), str) and "role" in m for m in msgs)):
            raise SuiteError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
        if sum(len(m["content"]) for m in msgs) > MAX_PROMPT_CHARS:
            raise SuiteError(f"{where}: 'messages' hold more than {MAX_PROMPT_CHARS} characters")
        return Prompt(name, messages=tuple(dict(m) for m in msgs))
    ids = obj["ids"]
    if (not isinstance(ids, list) or not ids or len(ids) > MAX_PROMPT_IDS
            or not all(isinstance(i, int) and not isinstance(i, bool) and 0 <= i <= MAX_TOKEN_ID for i in ids)):
        raise SuiteError(f"{where}: 'ids' must be a non-empty list of at most {MAX_PROMPT_IDS} token ids "
                         f"(non-negative integers up to {MAX_TOKEN_ID})")
    return Prompt(name, ids=tuple(ids))


def load_suite(spec: str | Path, *, hf_datasets_dir: str | Path | None = None) -> Suite:
    """`builtin:NAME[-vN]`, a bare builtin name (`coding`), `hf:NAME[:k=v,...]` (a standard
    benchmark; `hf_datasets_dir`: local copies of dataset repositories, see `load_hf_suite`),
    or a path to a JSONL file."""
    text = str(spec)
    if text.startswith(HF_PREFIX):
        return load_hf_suite(text, datasets_dir=hf_datasets_dir)
    path = Path(text)
    if not text.startswith("builtin:") and (path.suffix == ".jsonl" or path.exists() or "/" in text):
        if not path.is_file():
            raise SuiteError(f"suite file {path} not found")
        size = path.stat().st_size
        if size > MAX_SUITE_BYTES:
            raise SuiteError(f"suite file {path} is {size} bytes; the limit is {MAX_SUITE_BYTES}")
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            raise SuiteError(f"suite file {path} is not UTF-8 text ({e})") from None
        return parse_suite(text.splitlines(), str(path), default_name=path.stem)
    name = text.removeprefix("builtin:")
    version = None
    base, _, v = name.rpartition("-v")
    if base and v.isdigit():
        name, version = base, v
    file = BUILTIN_DIR / f"{name}.jsonl"
    if not file.is_file():
        have = sorted(p.stem for p in BUILTIN_DIR.glob("*.jsonl"))
        raise SuiteError(f"no built-in suite {name!r} (built-in: {have}); or give a .jsonl path")
    suite = parse_suite(file.read_text().splitlines(), f"builtin:{name}", default_name=name)
    if version is not None and suite.version != version:
        raise SuiteError(f"built-in suite {name!r} is version {suite.version}, not {version}")
    return suite


def check_suite_spec(spec: str, *, hf_datasets_dir: str | Path | None = None) -> str | None:
    """Check a suite name where it is given (a trainer's start-up): raise SuiteError for a bad
    `builtin:` / `hf:` spec or a malformed local file; return a note when the name is a path
    not found here (it may exist only on the worker's machine)."""
    text = str(spec)
    if text.startswith(HF_PREFIX):
        parse_hf_spec(text)  # the rows are the worker's to fetch; the name and options are checked here
        return None
    path = Path(text)
    if not text.startswith("builtin:") and (path.suffix == ".jsonl" or "/" in text) and not path.exists():
        return f"{text}: not found on this machine; the eval worker must be able to read it"
    load_suite(text, hf_datasets_dir=hf_datasets_dir)
    return None


def builtin_suites() -> list[str]:
    return sorted(p.stem for p in BUILTIN_DIR.glob("*.jsonl"))


def request_fingerprint(spec: str | Path) -> str:
    """Identity of a suite *request*, for job ids: an `hf:` suite's canonical spec (benchmark,
    format version, dataset, selection; nothing is loaded, so the trainer's hook and `enqueue`
    need no copy of the dataset); any other suite's own fingerprint. The result carries the
    fingerprint of the prompts actually evaluated (`Suite.fingerprint`), and the ledger keys by that."""
    text = str(spec)
    if text.startswith(HF_PREFIX):
        req = parse_hf_spec(text)
        body = {"hf": req.canonical, "format": HF_SUITES[req.name].version}
        return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]
    return load_suite(spec).fingerprint()


# --- standard benchmarks from Hugging Face datasets ------------------------------
HF_PREFIX = "hf:"
# the parts of an hf: suite's origin that are its identity (in the fingerprint); the rest
# (revision, local, copy_digest, spec) says where the rows were read from
ORIGIN_IDENTITY = ("dataset", "config", "split", "data_fingerprint", "rows", "n", "seed")
HF_MAX_NEW_TOKENS = 2048  # the published benchmark's --max-new-tokens default
_BOXED = "\nPlease reason step by step, and put your final answer within \\boxed{{}}."


@dataclass(frozen=True)
class HFBenchmark:
    """One standard benchmark: which dataset rows, and how a row becomes the user turn."""

    repo: str
    config: str | None
    split: str
    fields: tuple[str, ...]          # the columns `format` reads (checked, named when missing)
    format: Callable[[dict], str]
    version: str = "1"               # bump when the formatting changes (it is in the fingerprint)
    note: str = ""


def _alpaca(row: dict) -> str:
    extra = str(row.get("input") or "").strip()
    return str(row["instruction"]) + (f"\n\n{extra}" if extra else "")


def _first_turn(row: dict) -> str:
    turns = row["prompt"]
    return str(turns[0] if isinstance(turns, (list, tuple)) else turns)


# Dataset ids, configs, splits and formats as z-lab/dflash benchmark.py (DATASETS) has them;
# alpaca (the DFlash paper's sixth table column) as tatsu-lab/alpaca: instruction, then input.
HF_SUITES: dict[str, HFBenchmark] = {
    "gsm8k": HFBenchmark("openai/gsm8k", "main", "test", ("question",),
                         lambda r: ("{question}" + _BOXED).format(**r)),
    "math500": HFBenchmark("HuggingFaceH4/MATH-500", None, "test", ("problem",),
                           lambda r: ("{problem}" + _BOXED).format(**r)),
    "humaneval": HFBenchmark("openai/openai_humaneval", None, "test", ("prompt",),
                             lambda r: ("Write a solution to the following problem and make sure that it passes "
                                        "the tests:\n```python\n{prompt}\n```").format(**r)),
    "mbpp": HFBenchmark("google-research-datasets/mbpp", "sanitized", "test", ("prompt",), lambda r: str(r["prompt"])),
    "mt-bench": HFBenchmark("HuggingFaceH4/mt_bench_prompts", None, "train", ("prompt",), _first_turn,
                            note="first turn of each question (the published script's second turn follows the "
                                 "model's own first answer, which a fixed suite cannot hold)"),
    "alpaca": HFBenchmark("tatsu-lab/alpaca", None, "train", ("instruction",), _alpaca),
}
_HF_KEYS = {"n", "seed", "thinking", "revision"}
_ON, _OFF = {"on", "true", "1", "yes"}, {"off", "false", "0", "no"}
_REVISION = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]{0,127}")


@dataclass(frozen=True)
class HFRequest:
    """A parsed `hf:` spec: the benchmark, how many rows (None: all) and which (seed), thinking."""

    name: str
    n: int | None = None
    seed: int = 0
    thinking: bool = False
    revision: str | None = None

    @property
    def canonical(self) -> str:
        parts = [f"n={self.n}"] if self.n is not None else []
        if self.n is not None and self.seed:
            parts.append(f"seed={self.seed}")
        if self.thinking:
            parts.append("thinking=on")
        if self.revision:
            parts.append(f"revision={self.revision}")
        return HF_PREFIX + ":".join([self.name, *parts])

    @property
    def suite_name(self) -> str:
        """The name results, W&B keys (`eval/<name>/tau`) and the report show: the benchmark,
        plus the selection when it is not the whole split, so two selections never share a curve."""
        name = self.name
        if self.n is not None:
            name += f"-n{self.n}" + (f"-s{self.seed}" if self.seed else "")
        return name + ("-think" if self.thinking else "") + (f"-r{self.revision[:12]}" if self.revision else "")


def parse_hf_spec(spec: str) -> HFRequest:
    """`hf:NAME[:n=N][:seed=S][:thinking=on|off][:revision=R]` -> HFRequest; SuiteError names what is
    wrong. Colons, not commas, separate the parts: comma-separated lists of suites stay splittable."""
    body = str(spec).removeprefix(HF_PREFIX)
    name, _, args = body.partition(":")
    if name not in HF_SUITES:
        raise SuiteError(f"no standard benchmark {name!r} (hf: suites: {sorted(HF_SUITES)})")
    values: dict[str, Any] = {}
    for item in filter(None, (a.strip() for a in args.split(":"))):
        key, sep, value = item.partition("=")
        if not sep or key not in _HF_KEYS:
            raise SuiteError(f"{spec}: {item!r} is not KEY=VALUE with KEY one of {sorted(_HF_KEYS)}")
        if key in values:
            raise SuiteError(f"{spec}: {key} given twice")
        if key in ("n", "seed"):
            if not value.isdigit() or (key == "n" and int(value) < 1) or int(value) >= 2 ** 32:
                raise SuiteError(f"{spec}: {key} must be an integer {'>= 1' if key == 'n' else '>= 0'} (got {value!r})")
            values[key] = int(value)
        elif key == "thinking":
            if value.lower() not in _ON | _OFF:
                raise SuiteError(f"{spec}: thinking must be on or off (got {value!r})")
            values[key] = value.lower() in _ON
        else:
            if not _REVISION.fullmatch(value) or ".." in value:
                raise SuiteError(f"{spec}: revision must be a branch, tag or commit of the dataset (got {value!r})")
            values[key] = value
    if "seed" in values and "n" not in values:
        raise SuiteError(f"{spec}: seed selects n rows; give n too")
    return HFRequest(name, **values)


def hf_suites() -> list[str]:
    return sorted(HF_SUITES)


@contextlib.contextmanager
def _offline(datasets):
    """`datasets` and huggingface_hub in offline mode for one load (they read these at call time)."""
    from huggingface_hub import constants

    saved = datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE, constants.HF_HUB_OFFLINE = saved


def _load_rows(bench: HFBenchmark, req: HFRequest, datasets_dir: str | Path | None, cache_dir=None):
    """The benchmark's split via `datasets`: from `datasets_dir/<repo>` when that local copy
    exists (e.g. `hf download --repo-type dataset <repo> --local-dir DIR/<repo>`), else from
    the Hub through the datasets cache (offline: the cached copy, when there is one)."""
    try:
        import datasets
    except ImportError:  # pragma: no cover - a core dependency; a trimmed install may lack it
        raise SuiteError("hf: suites need the `datasets` package (pip install datasets)") from None
    local = Path(datasets_dir) / bench.repo if datasets_dir else None
    where = str(local) if local is not None and local.is_dir() else bench.repo
    what = f"{bench.repo} (config {bench.config or 'default'}, split {bench.split})"
    if where == bench.repo and req.revision is None and local is not None:
        what += f"; no local copy at {local}"
    digest = None
    if where != bench.repo:
        assert local is not None  # `where` is the local copy
        # datasets keys its cache of a local folder by the config name alone, so a changed copy
        # would be read from the old cache: key it by the copy's content instead
        digest = _tree_digest(local)
        cache_dir = Path(cache_dir or datasets.config.HF_DATASETS_CACHE) / "dflash-local" / digest[:16]
    from dflash_train.checkpoints.hub import unreachable

    # offline or no Hub: say so in seconds (datasets retries for ~35 s), reading only its cache
    why = unreachable() if where == bench.repo else None
    try:
        with _offline(datasets) if why else contextlib.nullcontext():
            ds = datasets.load_dataset(where, bench.config, split=bench.split,
                                       cache_dir=cache_dir and str(cache_dir),
                                       revision=req.revision if where == bench.repo else None)
    except Exception as e:  # noqa: BLE001 - datasets raises many kinds (ConnectionError, FileNotFoundError, ValueError...)
        offline = bool(why or getattr(datasets.config, "HF_HUB_OFFLINE", False))
        cause = (f"the Hub cannot be reached ({why}) and the datasets cache has no copy" if why
                 else f"{type(e).__name__}: {_no_cli_hint(str(e))[:300]}")
        raise SuiteError(
            f"{req.canonical}: dataset {what} is not available{' offline' if offline else ''}: {cause}. Load it "
            f"once where the Hub is reachable (the datasets cache keeps it), or download it (`hf download "
            f"--repo-type dataset {bench.repo} --local-dir DIR/{bench.repo}`) and point $DFLASH_HF_DATASETS_DIR "
            "at DIR") from None
    missing = [f for f in bench.fields if f not in ds.column_names]
    if missing:
        raise SuiteError(f"{req.canonical}: dataset {what} has no column(s) {missing} (has {ds.column_names})")
    revision = req.revision
    if where == bench.repo and ds.cache_files:  # a Hub download sits in a folder named by its commit
        revision = revision or Path(ds.cache_files[0]["filename"]).parent.name
    origin = {"dataset": bench.repo, "config": bench.config, "split": bench.split, "revision": revision,
              "data_fingerprint": _content_digest(ds, bench.fields), "rows": len(ds), "local": where != bench.repo,
              "copy_digest": digest, "n": req.n, "seed": req.seed if req.n is not None else None,
              "spec": req.canonical}
    return ds, origin


def _no_cli_hint(text: str) -> str:
    """A library message with its `huggingface-cli ...` advice spelled for the `hf` command installed
    with huggingface_hub >= 1 (`huggingface-cli` is gone)."""
    return text.replace("huggingface-cli", "hf")


def _content_digest(ds, fields: tuple[str, ...]) -> str:
    """xxh3-128 of the columns a benchmark reads, every row of the split in order: a dataset
    revision that changes them is another suite, wherever the rows were read from (Hub, cache, copy)."""
    import xxhash

    h = xxhash.xxh3_128()
    for batch in ds.select_columns(list(fields)).iter(batch_size=1024):
        h.update(json.dumps(batch, sort_keys=True, default=str).encode())
    return h.hexdigest()


def _tree_digest(root: Path) -> str:
    """xxh3-128 over the relative path and bytes of every file of a local dataset copy."""
    import xxhash

    h = xxhash.xxh3_128()
    for f in sorted(p for p in root.rglob("*") if p.is_file() and not any(
            part.startswith(".") for part in p.relative_to(root).parts)):
        h.update(f.relative_to(root).as_posix().encode() + b"\0")
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 20):
                h.update(chunk)
        h.update(b"\0")
    return h.hexdigest()


def load_hf_suite(spec: str, *, datasets_dir: str | Path | None = None, cache_dir=None) -> Suite:
    """A standard benchmark as a suite: the published script's rows and formatting, every
    row (default) or `n` of them chosen as it chooses (`random.Random(seed).shuffle`, then
    the first n; its decode benchmark seeds 0), chat template on, thinking as asked."""
    req = parse_hf_spec(spec)
    bench = HF_SUITES[req.name]
    ds, origin = _load_rows(bench, req, datasets_dir, cache_dir)
    order = list(range(len(ds)))
    if req.n is not None and req.n < len(order):
        random.Random(req.seed).shuffle(order)
        order = order[:req.n]
    prompts = []
    for i in order:
        row = ds[i]
        try:
            text = bench.format(row)
        except (KeyError, IndexError, TypeError, ValueError) as e:
            raise SuiteError(f"{req.canonical}: row {i} of {bench.repo} cannot be formatted ({e!r})") from None
        prompts.append(Prompt(f"{req.name}-{i:05d}", prompt=text))
    return Suite(req.suite_name, bench.version, prompts, chat_template=True, max_new_tokens=HF_MAX_NEW_TOKENS,
                 chat_template_kwargs={"enable_thinking": req.thinking},
                 description=f"{bench.repo} {bench.split}" + (f"; {bench.note}" if bench.note else ""),
                 source=req.canonical, origin=origin)
