"""Eval suites: a named, versioned set of prompts plus the generation settings they run with.

A suite file is JSONL. An optional first line with a `"suite"` key is the header; every
other line is one prompt:

    {"suite": "coding", "version": "1", "chat_template": true, "max_new_tokens": 128}
    {"name": "fizzbuzz", "prompt": "Write a Python function ..."}
    {"name": "chat", "messages": [{"role": "user", "content": "..."}]}
    {"name": "raw", "ids": [12, 7, 99]}          # already tokenized (used verbatim)

The fingerprint covers everything that changes the token ids fed to the target, so a
reference or feature cache keyed by it can never be reused for a different suite.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dflash_train.errors import DFlashError

BUILTIN_DIR = Path(__file__).resolve().parent / "suites"
DEFAULT_SUITE = "builtin:coding-v1"
DEFAULT_MAX_NEW_TOKENS = 128


class SuiteError(DFlashError, ValueError):
    """A suite that cannot be used (missing, empty, malformed); the message says where."""


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

    def __post_init__(self) -> None:
        if not self.prompts:
            raise SuiteError(f"suite {self.name!r} ({self.source or 'in memory'}) has no prompts")
        names = [p.name for p in self.prompts]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise SuiteError(f"suite {self.name!r}: duplicate prompt names {dup}")
        if int(self.max_new_tokens) < 1:
            raise SuiteError(f"suite {self.name!r}: max_new_tokens must be >= 1 (got {self.max_new_tokens})")

    @property
    def label(self) -> str:
        return f"{self.name}-v{self.version}"

    def fingerprint(self) -> str:
        body = {"name": self.name, "version": self.version, "chat_template": bool(self.chat_template),
                "max_new_tokens": int(self.max_new_tokens), "chat_template_kwargs": self.chat_template_kwargs,
                "prompts": [p.to_dict() for p in self.prompts]}
        return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:16]

    def head(self, n: int | None) -> "Suite":
        """The first n prompts (the seeds' `--num-prompts`); same name, its own fingerprint."""
        if n is None or n >= len(self.prompts):
            return self
        if n < 1:
            raise SuiteError(f"num_prompts must be >= 1 (got {n})")
        return Suite(self.name, self.version, self.prompts[:n], self.chat_template, self.max_new_tokens,
                     dict(self.chat_template_kwargs), self.description, self.source)

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
        return {"name": self.name, "version": self.version, "fingerprint": self.fingerprint(),
                "num_prompts": len(self.prompts)}


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
def parse_suite(lines: list[str], source: str, default_name: str = "suite") -> Suite:
    header: dict[str, Any] = {}
    prompts: list[Prompt] = []
    for lineno, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise SuiteError(f"{source}:{lineno}: not valid JSON ({e.msg})") from None
        if not isinstance(obj, dict):
            raise SuiteError(f"{source}:{lineno}: each line must be a JSON object")
        if "suite" in obj:
            if header or prompts:
                raise SuiteError(f"{source}:{lineno}: the suite header must be the first line")
            header = obj
            continue
        prompts.append(_parse_prompt(obj, f"{source}:{lineno}", len(prompts)))
    if not prompts:
        raise SuiteError(f"{source}: the suite is empty (no prompt lines)")
    known = {"suite", "version", "chat_template", "max_new_tokens", "chat_template_kwargs", "description"}
    unknown = sorted(set(header) - known)
    if unknown:
        raise SuiteError(f"{source}: unknown header fields {unknown} (known: {sorted(known)})")
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
    kinds = [k for k in ("prompt", "messages", "ids") if k in obj]
    if len(kinds) != 1:
        raise SuiteError(f"{where}: give exactly one of 'prompt', 'messages', 'ids' (got {kinds or 'none'})")
    if "prompt" in obj:
        if not isinstance(obj["prompt"], str) or not obj["prompt"]:
            raise SuiteError(f"{where}: 'prompt' must be a non-empty string")
        return Prompt(name, prompt=obj["prompt"])
    if "messages" in obj:
        msgs = obj["messages"]
        if (not isinstance(msgs, list) or not msgs
                or not all(isinstance(m, dict) and isinstance(m.get("content"), str) and "role" in m for m in msgs)):
            raise SuiteError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
        return Prompt(name, messages=tuple(dict(m) for m in msgs))
    ids = obj["ids"]
    if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and i >= 0 for i in ids):
        raise SuiteError(f"{where}: 'ids' must be a non-empty list of non-negative integers")
    return Prompt(name, ids=tuple(ids))


def load_suite(spec: str | Path) -> Suite:
    """`builtin:NAME[-vN]`, a bare builtin name (`coding`), or a path to a JSONL file."""
    text = str(spec)
    path = Path(text)
    if not text.startswith("builtin:") and (path.suffix == ".jsonl" or path.exists() or "/" in text):
        if not path.is_file():
            raise SuiteError(f"suite file {path} not found")
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


def builtin_suites() -> list[str]:
    return sorted(p.stem for p in BUILTIN_DIR.glob("*.jsonl"))
