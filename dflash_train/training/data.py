"""Training data: records -> token sequences with a loss mask -> deterministic sharded batches.

Sources:
- a JSONL file, one record per line: `{"prompt": str}`, `{"prompt": str, "response": str}`,
  `{"messages": [{"role", "content"}, ...]}` (last assistant turn = response) or
  `{"text": str}` (everything supervised except the first token);
- `builtin:stdlib-code`: code prefixes cut from the Python standard library at function
  definitions (the files the bundled tiny target trained on, its held-out files excluded);
  `builtin:stdlib-instruct`: coding requests ("Write a Python function f(x) that ...") made
  from the same files' functions, chat-templated like the built-in eval suite, from the
  functions kept out of the target's own chat pairs (never the eval suite's prompts);
  `builtin:stdlib-mix`: half of each.

Prompts without a response get one from the target itself (greedy regeneration, cached
on disk), the setup that matches inference best. Batches are a pure function of
(seed, position): rank r of K takes rows `[r*b, (r+1)*b)` of global batch `position`, and
each row gets its own seed for anchors/noise, so K ranks see exactly the rows one
process would, and a resumed run continues from the saved position.
"""
from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash_train.common.errors import DFlashError
from dflash_train.common.fsutil import atomic_write_text

from .corpus import collect_chat_pairs, collect_corpus

BUILTIN_STDLIB = "builtin:stdlib-code"
BUILTIN_INSTRUCT = "builtin:stdlib-instruct"
BUILTIN_MIX = "builtin:stdlib-mix"
BUILTIN_SOURCES = (BUILTIN_STDLIB, BUILTIN_INSTRUCT, BUILTIN_MIX)


class DataError(DFlashError, ValueError):
    """Unusable training data; the message names the file and line."""


@dataclass
class Example:
    ids: list[int]
    prompt_len: int  # positions >= prompt_len are supervised (the response)
    name: str = ""


@dataclass
class Batch:
    position: int  # global batch index since the start of training (epochs concatenated)
    ids: torch.Tensor  # [b, L] long, right-padded
    loss_mask: torch.Tensor  # [b, L] bool: supervised (response) positions
    lengths: torch.Tensor  # [b] real lengths
    row_seeds: list[int]
    sample_ids: list[int]


# --- records ----------------------------------------------------------------------------
def load_records(path: str | Path) -> list[dict]:
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data file {path} not found")
    records = []
    with path.open() as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{n}: not JSON ({e.msg})") from None
            if not isinstance(rec, dict) or not any(k in rec for k in ("prompt", "messages", "text")):
                raise DataError(f"{path}:{n}: expected an object with 'prompt', 'messages' or 'text'")
            records.append(rec)
    if not records:
        raise DataError(f"{path}: no records")
    return records


def _use_template(tokenizer, chat_template: str) -> bool:
    has = bool(getattr(tokenizer, "chat_template", None))
    if chat_template == "always" and not has:
        raise DataError("chat_template=always but the target's tokenizer has no chat template")
    return has and chat_template in ("auto", "always")


def encode_record(tokenizer, rec: dict, chat_template: str = "auto") -> tuple[list[int], list[int] | None]:
    """(prompt ids, response ids or None when the target should write the response)."""
    if "text" in rec:
        ids = tokenizer(rec["text"], add_special_tokens=False)["input_ids"]
        return ids[:1], ids[1:]
    if "messages" in rec:
        msgs = list(rec["messages"])
        response = None
        if msgs and msgs[-1].get("role") == "assistant":
            response = msgs.pop()["content"]
        if not _use_template(tokenizer, chat_template):
            prompt_text = "\n".join(m["content"] for m in msgs) + "\n"
        else:
            prompt_text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    else:
        response = rec.get("response")
        if _use_template(tokenizer, chat_template):
            prompt_text = tokenizer.apply_chat_template([{"role": "user", "content": rec["prompt"]}],
                                                        tokenize=False, add_generation_prompt=True)
        else:
            prompt_text = rec["prompt"]
    prompt = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
    resp = None if response is None else tokenizer(response, add_special_tokens=False)["input_ids"]
    return prompt, resp


# --- builtin: stdlib code prefixes -------------------------------------------------------
_DEF = re.compile(r"^[ \t]*(?:async[ \t]+)?def [A-Za-z_]\w*\(.*\):[ \t]*\n", re.M)


def stdlib_code_prompts(tokenizer, num_prompts: int, prompt_tokens: int = 64, split: str = "train",
                        stdlib_root: str | None = None) -> list[Example]:
    """Code prefixes that end right after a one-line `def ...:` (the model writes the body).

    `split="train"` uses the files the tiny target trained on, `"heldout"` only its
    held-out files (`corpus.py`: the rule the target's builder uses too).
    Deterministic: candidates are taken in sorted file order, evenly spaced.
    """
    train, heldout, _ = collect_corpus(stdlib_root)
    texts = {"train": train, "heldout": heldout}.get(split)
    if texts is None:
        raise DataError(f"unknown split {split!r} (train, heldout)")
    cands = [(fi, m.end()) for fi, text in enumerate(texts) for m in _DEF.finditer(text) if m.start() > 400]
    if not cands:
        raise DataError(f"no function definitions found in the {split} stdlib files")
    step = max(len(cands) / max(num_prompts, 1), 1.0)
    out: list[Example] = []
    for i in range(min(num_prompts, len(cands))):
        fi, cut = cands[int(i * step)]
        ids = tokenizer(texts[fi][max(0, cut - 8 * prompt_tokens):cut], add_special_tokens=False)["input_ids"]
        ids = ids[1:][-prompt_tokens:]  # drop a possibly cut first token
        out.append(Example(ids, len(ids), name=f"{split}-{fi}-{cut}"))
    return out


def stdlib_instruct_prompts(tokenizer, num_prompts: int, split: str = "train", chat_template: str = "auto",
                            stdlib_root: str | None = None) -> list[Example]:
    """Coding requests like the built-in eval suite's, made from stdlib functions.

    "Write a Python function parse_header(line) that parses a Content-type like header." The
    requests are the tiny target's chat pairs (`corpus.collect_chat_pairs`): `split="train"`
    takes the *spare* ones, functions in the target's training files whose pairs the target
    never trained on (the demo drafter's prompts: the target writes a fresh answer, not one it
    memorised); `"heldout"` those of its held-out files. The eval suite's own prompts are never
    used. Deterministic (evenly spaced in file order); chat-templated when the tokenizer has one.
    """
    pairs = {"train": "spare", "heldout": "heldout"}.get(split)
    if pairs is None:
        raise DataError(f"unknown split {split!r} (train, heldout)")
    cands = collect_chat_pairs(stdlib_root)[pairs]
    if not cands:
        raise DataError(f"no documented functions found in the {split} stdlib files")
    step = max(len(cands) / max(num_prompts, 1), 1.0)
    out = []
    for i in range(min(num_prompts, len(cands))):
        pair = cands[int(i * step)]
        prompt, _ = encode_record(tokenizer, {"prompt": pair.ask}, chat_template)
        out.append(Example(prompt, len(prompt), name=f"{split}-instruct-{pair.qualname}"))
    return out


# --- regeneration ------------------------------------------------------------------------
def regenerate(target, prompts: list[list[int]], max_new_tokens: int, *, cache_dir: str | Path | None = None,
               batch_size: int = 32, eos_token_id: int | None = None, progress=None) -> list[list[int]]:
    """The target's greedy responses to `prompts` (cached on disk by target + prompts).

    Prompts are sorted by length and batched; shorter ones in a batch are left-padded with
    an attention mask (the same greedy tokens as one prompt at a time, up to batched-matmul
    numerics; the trainer's labels come from its own forward pass anyway).
    """
    key = hashlib.sha256(json.dumps([target.fingerprint(), max_new_tokens, eos_token_id, prompts]).encode()).hexdigest()
    cache = Path(cache_dir) / f"regen-{key[:20]}.json" if cache_dir else None
    if cache is not None and cache.is_file():
        try:
            data = json.loads(cache.read_text())
            if data.get("key") == key and len(data["responses"]) == len(prompts):
                return data["responses"]
        except (json.JSONDecodeError, KeyError):
            pass  # corrupt cache: rebuild it
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    out: list[list[int] | None] = [None] * len(prompts)
    pad = eos_token_id if eos_token_id is not None else 0
    dev = target.device
    for s in range(0, len(order), batch_size):
        idx = order[s:s + batch_size]
        L = max(len(prompts[i]) for i in idx)
        ids = torch.full((len(idx), L), pad, dtype=torch.long)
        attn = torch.zeros(len(idx), L, dtype=torch.long)
        for r, i in enumerate(idx):
            ids[r, L - len(prompts[i]):] = torch.tensor(prompts[i])
            attn[r, L - len(prompts[i]):] = 1
        with torch.no_grad():
            gen = target.model.generate(ids.to(dev), attention_mask=attn.to(dev), max_new_tokens=max_new_tokens,
                                        do_sample=False, eos_token_id=eos_token_id, pad_token_id=pad)
        for r, i in enumerate(idx):
            resp = gen[r, L:].tolist()
            if eos_token_id is not None and eos_token_id in resp:
                resp = resp[: resp.index(eos_token_id) + 1]
            out[i] = resp
        if progress:
            progress(min(s + batch_size, len(order)), len(order))
    if cache is not None:
        cache.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_text(cache, json.dumps({"key": key, "responses": out}), durable=False)  # a cache: no fsync
    return out  # type: ignore[return-value]


# --- batching ----------------------------------------------------------------------------
def row_seed(seed: int, position: int, row: int) -> int:
    """Seed for global row `row` of batch `position` (anchors, noise): independent of rank."""
    h = hashlib.blake2b(f"{seed}:{position}:{row}".encode(), digest_size=8).digest()
    return int.from_bytes(h, "little") & ((1 << 62) - 1)


class BatchPlan:
    """Which examples form global batch `position`, and this rank's share of its rows."""

    def __init__(self, examples: list[Example], global_batch: int, *, seed: int = 0, rank: int = 0,
                 world_size: int = 1, max_seq_len: int = 512, pad_id: int = 0, seq_multiple: int = 64,
                 shuffle: bool = True):
        if global_batch % world_size:
            raise DataError(f"global batch {global_batch} is not divisible by {world_size} ranks")
        if len(examples) < global_batch:
            raise DataError(f"{len(examples)} examples are fewer than one global batch ({global_batch})")
        self.examples, self.global_batch, self.seed = examples, global_batch, seed
        self.rank, self.world_size = rank, world_size
        self.local_batch = global_batch // world_size
        self.max_seq_len, self.pad_id, self.seq_multiple, self.shuffle = max_seq_len, pad_id, seq_multiple, shuffle
        self.batches_per_epoch = len(examples) // global_batch
        self._perm_epoch = -1
        self._perm: list[int] = []  # the order of epoch _perm_epoch (none yet)

    def _order(self, epoch: int) -> list[int]:
        if epoch != self._perm_epoch:
            n = len(self.examples)
            self._perm = (torch.randperm(n, generator=torch.Generator().manual_seed(self.seed * 7919 + epoch)).tolist()
                          if self.shuffle else list(range(n)))
            self._perm_epoch = epoch
        return self._perm

    def batch(self, position: int) -> Batch:
        epoch, i = divmod(position, self.batches_per_epoch)
        order = self._order(epoch)
        rows = range(self.rank * self.local_batch, (self.rank + 1) * self.local_batch)
        sample_ids = [order[i * self.global_batch + r] for r in rows]
        seqs = [self._clip(self.examples[s]) for s in sample_ids]
        L = max(len(ids) for ids, _ in seqs)
        if self.seq_multiple:  # few distinct shapes (compiled kernels, one buffer size)
            L = min(-(-L // self.seq_multiple) * self.seq_multiple, self.max_seq_len)
        ids = torch.full((len(seqs), L), self.pad_id, dtype=torch.long)
        mask = torch.zeros(len(seqs), L, dtype=torch.bool)
        for r, (seq, p) in enumerate(seqs):
            ids[r, : len(seq)] = torch.tensor(seq)
            mask[r, p: len(seq)] = True
        lengths = torch.tensor([len(s) for s, _ in seqs])
        return Batch(position, ids, mask, lengths, [row_seed(self.seed, position, r) for r in rows], sample_ids)

    def _clip(self, ex: Example) -> tuple[list[int], int]:
        ids, p = ex.ids, ex.prompt_len
        if p > self.max_seq_len // 2:  # keep the prompt's end: it is the response's context
            ids, p = ids[p - self.max_seq_len // 2:], self.max_seq_len // 2
        return ids[: self.max_seq_len], p

    def iterate(self, start: int = 0, stop: int | None = None) -> Iterator[Batch]:
        pos = start
        while stop is None or pos < stop:
            yield self.batch(pos)
            pos += 1


# --- putting it together ----------------------------------------------------------------
def build_examples(target, data: str, *, num_prompts: int = 512, prompt_tokens: int = 64,
                   chat_template: str = "auto", regenerate_responses: bool = True, max_new_tokens: int = 128,
                   cache_dir: str | Path | None = None, regen_batch_size: int = 32, progress=None) -> list[Example]:
    """Token sequences with their supervised region, responses regenerated where asked/needed."""
    tok = target.tokenizer
    if tok is None:
        raise DataError("the target has no tokenizer: cannot tokenise training data")
    eos = tok.eos_token_id
    pairs: list[tuple[list[int], list[int] | None]]  # (prompt, response; None: the target's, regenerated below)
    if data in BUILTIN_SOURCES:
        n_code = {BUILTIN_STDLIB: num_prompts, BUILTIN_INSTRUCT: 0}.get(data, num_prompts // 2)
        exs = stdlib_code_prompts(tok, n_code, prompt_tokens, "train") if n_code else []
        if num_prompts - n_code:
            exs += stdlib_instruct_prompts(tok, num_prompts - n_code, "train", chat_template)
        pairs = [(ex.ids, None) for ex in exs]
        names = [ex.name for ex in exs]
    elif data.startswith("builtin:"):
        raise DataError(f"unknown builtin data source {data!r} (known: {', '.join(BUILTIN_SOURCES)})")
    else:
        recs = load_records(data)
        pairs, names = [], []
        for i, rec in enumerate(recs):
            prompt, resp = encode_record(tok, rec, chat_template)
            if "text" not in rec and regenerate_responses:
                resp = None
            pairs.append((prompt, resp))
            names.append(str(rec.get("name", i)))
    todo = [i for i, (_, r) in enumerate(pairs) if r is None]
    if todo:
        regen = regenerate(target, [pairs[i][0] for i in todo], max_new_tokens, cache_dir=cache_dir,
                           batch_size=regen_batch_size, eos_token_id=eos, progress=progress)
        for i, r in zip(todo, regen, strict=True):
            pairs[i] = (pairs[i][0], r)
    out = [Example(p + r, len(p), n) for (p, r), n in zip(pairs, names, strict=True)
           if r is not None and len(r) >= 2]  # (no None is left: regenerated above)
    if not out:
        raise DataError(f"{data}: no example has a response of 2+ tokens")
    return out
