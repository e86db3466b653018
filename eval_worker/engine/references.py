"""Reference completions: the target's greedy (or sampled) continuation of each prompt, as token ids.

A reference is `tokens` (the response: greedy until eos, included, or max_new_tokens)
plus `lookahead` (the greedy tokens after it, eos or not). The real draft-verify loop
compares the last step's drafts with target tokens past the response end, so replaying
it exactly needs B-1 tokens of lookahead.

A sampled reference (`sampler`, `dflash_train.core.sampling`) takes the target's keyed sample
at every position instead, lookahead included: the real loop given the same sampler
verifies with the same draws, so it emits this very sequence and the replay along it is
exact (docs/design.md, "Sampling").

Sources: local greedy decoding with the target (default), or an OpenAI-compatible server
(SGLang / vLLM) asked for token ids. A server that is down, or answers with text only,
is an error that says so; text is never re-tokenized (that would not be the target's ids).
"""
from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from dflash_train.common.errors import DFlashError
from dflash_train.core.model import DFlashDrafter
from dflash_train.core.sampling import Sampler
from dflash_train.core.target import Target
from eval_worker.engine.decoding import DEFAULT_ROWS, DecodeStats, DrafterProposer, Row, decode


class ReferenceSourceError(DFlashError, RuntimeError):
    """Reference completions could not be obtained; the message says why."""

    retryable = True  # a reference server that is down or overloaded answers later


@dataclass
class Reference:
    name: str
    prompt_ids: list[int]
    tokens: list[int]
    lookahead: list[int]
    finish: str  # "eos" | "length"
    source: str  # "local" | "server:<url>"
    lookahead_requested: int = 0  # a server may return fewer; this many serve any block size up to it + 1
    sample: int | None = None  # sampled references: the sample index (None: greedy)

    @property
    def ext(self) -> list[int]:
        return self.tokens + self.lookahead

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Reference:
        return cls(name=str(d["name"]), prompt_ids=[int(i) for i in d["prompt_ids"]],
                   tokens=[int(i) for i in d["tokens"]], lookahead=[int(i) for i in d["lookahead"]],
                   finish=str(d["finish"]), source=str(d["source"]),
                   lookahead_requested=int(d.get("lookahead_requested", len(d["lookahead"]))),
                   sample=None if d.get("sample") is None else int(d["sample"]))


def split_at_eos(ids: list[int], max_new_tokens: int, eos_token_id: int | None) -> tuple[list[int], list[int], str]:
    """(response, rest, finish): the response ends after the first eos or at max_new_tokens."""
    end = min(len(ids), max_new_tokens)
    finish = "length"
    if eos_token_id is not None and eos_token_id in ids[:end]:
        end = ids.index(eos_token_id) + 1
        finish = "eos"
    return ids[:end], ids[end:], finish


@dataclass
class Request:
    """A greedy reference wanted: `known`, a greedy continuation of the prompt already held (a cached entry), is
    extended, not decoded again."""

    name: str
    prompt_ids: list[int]
    max_new_tokens: int
    eos_token_id: int | None
    lookahead: int
    known: list[int] = field(default_factory=list)

    def need(self, ext: list[int]) -> int | None:
        """Tokens of greedy continuation this request needs given `ext` (None: more than `ext` shows)."""
        tokens, _, finish = split_at_eos(ext, self.max_new_tokens, self.eos_token_id)
        if finish == "eos" or len(tokens) == self.max_new_tokens:
            return len(tokens) + self.lookahead
        return None

    def served(self, ext: list[int], source: str = "local", asked: int = 0) -> Reference | None:
        """The reference `ext` (a greedy continuation) holds for this request, or None when it is too short.
        `asked`: the length its source was asked for, when it returned less (a server's short lookahead):
        what it gave serves a request within that length."""
        need = self.need(ext)
        if need is None or (len(ext) < need and asked < need):
            return None
        tokens, rest, finish = split_at_eos(ext, self.max_new_tokens, self.eos_token_id)
        return Reference(self.name, list(self.prompt_ids), tokens, rest[: self.lookahead], finish, source,
                         self.lookahead)


class LocalReferences:
    """Greedy decoding with the loaded target (no logits processors: plain argmax), or keyed sampling.

    Greedy references are decoded in batches across prompts (`eval_worker.engine.decoding`), plainly
    or, given a drafter, by lossless greedy speculative decoding."""

    name = "local"
    couples_sampling = True  # the same keyed draws as the real loop's

    def __init__(self, target: Target, max_rows: int = DEFAULT_ROWS):
        self.target = target
        self.max_rows = max_rows

    def identity(self) -> dict[str, Any]:
        return {"kind": "local"}

    def generate(self, name: str, prompt_ids: list[int], max_new_tokens: int, eos_token_id: int | None,
                 lookahead: int, sampler: Sampler | None = None) -> Reference:
        if sampler is not None:
            return self.generate_samples(name, prompt_ids, max_new_tokens, eos_token_id, lookahead, [sampler])[0]
        req = Request(name, list(prompt_ids), max_new_tokens, eos_token_id, lookahead)
        return next(ref for batch in self.generate_many([req]) for _, ref in batch)

    def generate_many(self, requests: list[Request], drafter: DFlashDrafter | None = None,
                      stats: DecodeStats | None = None) -> Iterator[list[tuple[int, Reference]]]:
        """(index in `requests`, reference) per batch as it is done. `drafter`: decoded speculatively with it
        (the same greedy output, fewer target steps); each request's `known` continuation is extended."""
        done: list[tuple[int, Reference]] = []
        rows = []
        for i, req in enumerate(requests):
            ref = req.served(req.known)
            if ref is not None:
                done.append((i, ref))
            else:
                rows.append(Row(i, req.prompt_ids + req.known, _need_beyond_known(req)))
        if done:
            yield done
        proposer = DrafterProposer(drafter, self.target) if drafter is not None else None
        for batch in decode(self.target, rows, proposer, max_rows=self.max_rows, stats=stats):
            out = []
            for row in batch:
                req = requests[row.index]
                ref = req.served(req.known + row.result())
                assert ref is not None, "a row stops once its request is served"
                out.append((row.index, ref))
            yield out

    def generate_samples(self, name: str, prompt_ids: list[int], max_new_tokens: int, eos_token_id: int | None,
                         lookahead: int, samplers: list[Sampler]) -> list[Reference]:
        """One sampled reference per sampler, the prompt's samples decoded as one batch."""
        rows = sample_continuations(self.target, prompt_ids, samplers, max_new_tokens, eos_token_id, lookahead)
        refs = []
        for ids, sampler in zip(rows, samplers, strict=False):
            tokens, more, finish = split_at_eos(ids, max_new_tokens, eos_token_id)
            refs.append(Reference(name, list(prompt_ids), tokens, more[:lookahead], finish, "local", lookahead,
                                  sample=sampler.sample))
        return refs


def _need_beyond_known(req) -> Callable[[list[int]], int | None]:
    """A row's need counted from the end of what the request already knows."""
    return lambda out: _less(req.need(req.known + out), len(req.known))


def _less(need: int | None, known: int) -> int | None:
    return None if need is None else max(need - known, 1)


SAMPLE_BATCH = 16  # samples of one prompt decoded together (rows of one batched forward)


@torch.no_grad()
def sample_continuation(target: Target, prompt_ids: list[int], sampler: Sampler, max_new_tokens: int,
                        eos_token_id: int | None, lookahead: int) -> list[int]:
    """The target's keyed samples after the prompt: the response (up to eos or max_new_tokens)
    and `lookahead` tokens more, eos or not."""
    return sample_continuations(target, prompt_ids, [sampler], max_new_tokens, eos_token_id, lookahead)[0]


@torch.no_grad()
def sample_continuations(target: Target, prompt_ids: list[int], samplers: list[Sampler], max_new_tokens: int,
                         eos_token_id: int | None, lookahead: int) -> list[list[int]]:
    """`sample_continuation` for several samplers of one prompt, decoded as the rows of one batch
    (same prompt, one token per row per forward: no padding). KV cached; the LM head runs on the
    last position only (memory flat in the vocabulary, as the greedy decoder's)."""
    from transformers import DynamicCache

    if len(samplers) > SAMPLE_BATCH:
        return [row for i in range(0, len(samplers), SAMPLE_BATCH) for row in sample_continuations(
            target, prompt_ids, samplers[i:i + SAMPLE_BATCH], max_new_tokens, eos_token_id, lookahead)]
    dev, n = target.device, len(samplers)
    cache = DynamicCache(config=target.model.config)
    inp = torch.tensor([prompt_ids] * n, device=dev)
    out: list[list[int]] = [[] for _ in samplers]
    ends: list[int | None] = [None] * n  # a row's response length once it is complete
    pos = 0
    while any(e is None or len(o) < e + lookahead for o, e in zip(out, ends, strict=True)):
        last = target.forward(inp, [], past_key_values=cache, use_cache=True,
                              position_ids=torch.arange(pos, pos + inp.shape[1], device=dev).expand(n, -1)).last_hidden
        pos += inp.shape[1]
        logits = target.logits(last[:, -1])
        t = len(prompt_ids) + len(out[0])  # every row is at the same absolute position
        for i, s in enumerate(samplers):
            out[i].append(int(s.tokens(logits[i:i + 1], t)[0]))
            if ends[i] is None and (out[i][-1] == eos_token_id or len(out[i]) == max_new_tokens):
                ends[i] = len(out[i])
        inp = torch.tensor([[o[-1]] for o in out], device=dev)
    kept = []
    for o, e in zip(out, ends, strict=True):
        assert e is not None  # the loop above ran until every row ended
        kept.append(o[: e + lookahead])
    return kept


class ServerReferences:
    """`POST {url}/v1/completions` with the prompt as token ids, greedy, asking for ids back.

    The request carries the flags both servers understand: vLLM `return_token_ids` /
    `return_tokens_as_token_ids` (+ logprobs), SGLang `return_token_ids`; `ignore_eos`
    lets one request also return the lookahead.
    """

    def __init__(self, url: str, model: str | None = None, timeout: float = 600.0, api_key: str | None = None):
        self.url = url.rstrip("/")
        self.model = model
        self.timeout = timeout
        self.api_key = api_key
        self.name = f"server:{self.url}"

    def identity(self) -> dict[str, Any]:
        return {"kind": "server", "url": self.url, "model": self.model}

    # a server draws with its own generator: its samples are the target's, not the keyed ones
    couples_sampling = False

    def generate(self, name: str, prompt_ids: list[int], max_new_tokens: int, eos_token_id: int | None,
                 lookahead: int, sampler: Sampler | None = None) -> Reference:
        body = {"prompt": list(prompt_ids), "max_tokens": max_new_tokens + lookahead, "temperature": 0.0,
                "top_p": 1.0, "n": 1, "stream": False, "ignore_eos": True, "skip_special_tokens": False,
                "logprobs": 1, "return_tokens_as_token_ids": True, "return_token_ids": True}
        if sampler is not None:  # seeded per (seed, prompt, sample): repeatable where the server honours `seed`
            p = sampler.params
            body.update(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k or -1,
                        seed=int(sampler.uniform_at(-1) * (1 << 31)))
        if self.model:
            body["model"] = self.model
        data = self._post("/v1/completions", body)
        ids = token_ids_from_response(data, where=f"{self.url}/v1/completions ({name})")
        tokens, rest, finish = split_at_eos(ids, max_new_tokens, eos_token_id)
        return Reference(name, list(prompt_ids), tokens, rest[:lookahead], finish, self.name, lookahead,
                         sample=None if sampler is None else sampler.sample)

    def _post(self, path: str, body: dict) -> dict:
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        req = urllib.request.Request(self.url + path, data=json.dumps(body).encode(), headers=headers, method="POST")
        try:
            with urllib.request.urlopen(req, timeout=self.timeout) as resp:
                raw = resp.read()
        except urllib.error.HTTPError as e:
            detail = e.read()[:300].decode(errors="replace")
            raise ReferenceSourceError(
                f"reference server {self.url} answered HTTP {e.code} to {path}: {detail}") from None
        except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise ReferenceSourceError(f"cannot reach reference server {self.url} ({reason}); is it running? "
                                 "(or drop --reference-server to generate references locally)") from None
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            raise ReferenceSourceError(
                f"reference server {self.url} returned non-JSON from {path}: {raw[:200]!r}") from None


def token_ids_from_response(data: Any, where: str) -> list[int]:
    """Token ids from an OpenAI-style completion, in any of the shapes SGLang/vLLM use."""
    try:
        choice = data["choices"][0]
    except (KeyError, IndexError, TypeError):
        raise ReferenceSourceError(f"{where}: response has no choices: {str(data)[:200]}") from None
    for key in ("token_ids", "output_token_ids", "output_ids"):
        ids = choice.get(key)
        if ids is None and isinstance(choice.get("meta_info"), dict):
            ids = choice["meta_info"].get(key)
        if isinstance(ids, list) and all(isinstance(i, int) for i in ids):
            return list(ids)
    toks = ((choice.get("logprobs") or {}).get("tokens")) if isinstance(choice.get("logprobs"), dict) else None
    if isinstance(toks, list) and toks and all(isinstance(t, str) and t.startswith("token_id:") for t in toks):
        return [int(t.split(":", 1)[1]) for t in toks]
    raise ReferenceSourceError(f"{where}: the server returned text without token ids; the engine needs the target's "
                         "exact ids (vLLM: return_token_ids / return_tokens_as_token_ids; SGLang: return_token_ids). "
                         "Re-tokenizing text is not the same sequence.")
