"""Deterministic builder for the tiny bundled target model (dflash_train/assets/tiny_target).

A developer tool, run from a checkout (not part of the installed package)::

    python -m tools.build_tiny_target [--out DIR] [--steps N] [--chat-steps N]
                                      [--minutes M] [--seed S] [--base DIR]

(or ``python tools/build_tiny_target.py ...`` with the project installed). What it does (all
seeded; given the same Python stdlib, CPU type and thread count, the same settings give
bit-identical weights), one function per stage:

1. `load_corpus`: the Python standard library sources of the running interpreter and the
   chat pairs made from them (``dflash_train/training/corpus.py``: the same rule the
   trainer's built-in prompts use, so the demo drafter's requests stay out of the target's
   pairs). Without the pairs the chat template is out of distribution and the target answers
   every chat prompt with ``#\n`` repeats.
2. `tokenize`: trains a byte-level BPE tokenizer on the raw source (Qwen2-style pre-tokenizer
   regex, vocab 4096 incl. special tokens ``<|endoftext|>`` (eos/pad), ``<|MASK|>`` (DFlash
   mask), ``<|im_start|>``, ``<|im_end|>``), wraps it in ``transformers.PreTrainedTokenizerFast``
   with a Qwen-style chat template, and encodes the corpus and the pairs.
3. `base_stage`: trains a small ``Qwen3ForCausalLM`` from scratch on raw-source windows
   (AdamW, linear warmup + cosine decay, 256-token windows, bf16 autocast on CPU with
   fp32 master weights unless ``--no-bf16-autocast``) for ``--steps`` steps.
4. `chat_stage`: from the base's weights rounded to bfloat16 (what a saved base loads
   as, so ``--base DIR`` resumes a saved base exactly), a fresh optimizer trains
   ``--chat-steps`` more steps on batches of which ``PAIR_FRACTION`` are windows that
   open at a chat pair and the rest raw source (so it keeps writing plain code), in fp32
   unless ``--chat-bf16-autocast``.
5. `save` and `build_info`: model (bfloat16 safetensors), tokenizer, greedy generation config and
   ``build_info.json`` (both stages' settings; held-out losses of the *saved* weights
   upcast to fp32 on raw source and on the held-out files' chat pairs, build time,
   parameter count, on-disk size).

``--minutes M`` is an alternative to ``--steps``: the step count is calibrated
from the speed of the first few steps so that the base stage takes about M minutes.
The chosen count is recorded in ``build_info.json`` so the build can be
reproduced exactly with ``--steps``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dflash_train.training.corpus import MAX_CORPUS_CHARS, ChatPair, collect_chat_pairs, collect_corpus

DEFAULT_OUT = Path(__file__).resolve().parents[1] / "dflash_train" / "assets" / "tiny_target"
BUILDER = "tools/build_tiny_target.py"  # recorded in build_info.json (the bundled build names its old place)

if TYPE_CHECKING:  # torch is imported where it is used: --help answers at once
    import torch

PAIR_FRACTION = 0.75  # of each chat-stage batch (the rest: raw source, so it keeps writing code)

# ---- tokenizer ----------------------------------------------------------------
VOCAB_SIZE = 4096
EOS_TOKEN = "<|endoftext|>"
MASK_TOKEN = "<|MASK|>"
IM_START = "<|im_start|>"
IM_END = "<|im_end|>"
SPECIAL_TOKENS = [EOS_TOKEN, MASK_TOKEN, IM_START, IM_END]  # ids 0..3
# Qwen2-style pre-tokenization: newlines are split from the indentation that
# follows them (``"):\n" | "   " | " return"``), digits are single tokens.
# GPT-2's ByteLevel regex would merge ``"\n    "`` into one token, so a prompt
# ending in ``"\n"`` (e.g. ``"def f(n):\n"``) would end in a token that in
# training is only ever followed by unindented code.
PRETOKENIZE_REGEX = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# ---- model / training ---------------------------------------------------------
MODEL_KW = dict(
    hidden_size=256,
    num_hidden_layers=8,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    intermediate_size=704,
    max_position_embeddings=2048,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
    use_cache=True,
    initializer_range=0.02,
)
SEQ_LEN = 256
# The bundled build (tiny_target/build_info.json) used exactly these defaults.
# Stage 1 (base): raw source only. Stage 2 (chat): from the base's weights, mostly chat pairs.
DEFAULT_STEPS = 450
DEFAULT_BATCH = 16
DEFAULT_LR = 4e-3
DEFAULT_WARMUP = 30
CHAT_STEPS = 800
CHAT_LR = 2e-3
CHAT_WARMUP = 20
MIN_LR_FRAC = 0.1
WEIGHT_DECAY = 0.1
GRAD_CLIP = 1.0
NUM_THREADS = 2


def log(msg: str) -> None:
    print(msg, flush=True)


# ------------------------------------------------------------------------------


def chat_text(pair: ChatPair) -> str:
    """The pair as the chat template renders it (same string as ``CHAT_TEMPLATE``)."""
    return f"{IM_START}user\n{pair.ask}{IM_END}\n{IM_START}assistant\n{pair.answer}\n{IM_END}\n"


# ------------------------------------------------------------------------------
# tokenizer
# ------------------------------------------------------------------------------
def train_tokenizer(texts: list[str], vocab_size: int = VOCAB_SIZE):
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    for i, s in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))

    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        mask_token=MASK_TOKEN,
        additional_special_tokens=[IM_START, IM_END],
        model_max_length=MODEL_KW["max_position_embeddings"],
        clean_up_tokenization_spaces=False,
        padding_side="right",
    )
    hf_tok.chat_template = CHAT_TEMPLATE
    return hf_tok


def _make_tokenizer_config_portable(path: Path) -> None:
    """transformers 5 writes ``tokenizer_class: TokenizersBackend`` and only
    ``extra_special_tokens``; also spell it the transformers-4 way
    (``PreTrainedTokenizerFast``, ``additional_special_tokens``, inline
    ``chat_template``) so older stacks (e.g. an inference server) load the same
    tokenizer. transformers 5 maps ``PreTrainedTokenizerFast`` to
    ``TokenizersBackend``."""
    cfg = json.loads(path.read_text())
    for loader_state in ("is_local", "local_files_only"):  # written when the tokenizer was loaded (--base)
        cfg.pop(loader_state, None)
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["additional_special_tokens"] = [IM_START, IM_END]
    cfg["chat_template"] = CHAT_TEMPLATE
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def encode_stream(tokenizer, texts: list[str], eos_id: int, with_starts: bool = False):
    """Encode documents and join them into one stream, eos after each document
    (with ``with_starts``: also each document's start offset)."""
    import torch

    encs = tokenizer.backend_tokenizer.encode_batch(texts, add_special_tokens=False)
    ids: list[int] = []
    starts: list[int] = []
    for e in encs:
        starts.append(len(ids))
        ids.extend(e.ids)
        ids.append(eos_id)
    stream = torch.tensor(ids, dtype=torch.long)
    return (stream, torch.tensor(starts, dtype=torch.long)) if with_starts else stream


# ------------------------------------------------------------------------------
# model
# ------------------------------------------------------------------------------
def make_config(vocab_len: int, special_ids: dict):
    from transformers import Qwen3Config

    vocab = ((vocab_len + 63) // 64) * 64
    return Qwen3Config(
        vocab_size=vocab,
        bos_token_id=special_ids["eos"],
        eos_token_id=special_ids["eos"],
        pad_token_id=special_ids["pad"],
        **MODEL_KW,
    )


def lr_at(step: int, total: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    prog = (step - warmup) / max(1, total - warmup)
    prog = min(1.0, prog)
    return peak * (MIN_LR_FRAC + (1 - MIN_LR_FRAC) * 0.5 * (1 + math.cos(math.pi * prog)))


def heldout_loss(model, stream, seq_len: int = SEQ_LEN, batch: int = 32) -> float:
    """Token-weighted mean CE over the held-out stream, non-overlapping windows."""
    import torch
    import torch.nn.functional as F

    model.eval()
    windows = [stream[i : i + seq_len] for i in range(0, len(stream) - 1, seq_len)]
    tot, n = 0.0, 0
    with torch.no_grad():
        for b in range(0, len(windows), batch):
            chunk = windows[b : b + batch]
            full = [w for w in chunk if len(w) == seq_len]  # the ragged last window runs alone
            ragged = [w for w in chunk if len(w) != seq_len]
            groups = ([torch.stack(full)] if full else []) + [w[None] for w in ragged]
            for x in groups:
                if x.shape[1] < 2:
                    continue
                logits = model(input_ids=x).logits.float()
                ce = F.cross_entropy(
                    logits[:, :-1].reshape(-1, logits.shape[-1]),
                    x[:, 1:].reshape(-1),
                    reduction="sum",
                )
                tot += ce.item()
                n += x[:, 1:].numel()
    return tot / max(1, n)


def dir_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def seed_everything(seed: int) -> None:
    import numpy as np
    import torch

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


# ------------------------------------------------------------------------------
# main
# ------------------------------------------------------------------------------
def train_stage(model, batch_fn, total: int, lr: float, warmup: int, name: str,
                minutes: float | None = None, bf16_autocast: bool = True) -> tuple[int, float, float]:
    """AdamW (fresh), linear warm-up then cosine decay; ``batch_fn()`` gives each batch.
    Returns (steps run, seconds, final loss EMA)."""
    import torch

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": WEIGHT_DECAY}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr, betas=(0.9, 0.95), eps=1e-8,
    )
    calib_steps = 3
    t_train = time.time()
    model.train()
    step, running = 0, None
    while step < total:
        cur_lr = lr_at(step, total, lr, warmup)
        for g in opt.param_groups:
            g["lr"] = cur_lr
        x = batch_fn()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16_autocast):
            loss = model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        step += 1
        lv = loss.item()
        running = lv if running is None else 0.95 * running + 0.05 * lv
        elapsed = time.time() - t_train
        if minutes is not None and step == calib_steps:
            per = elapsed / step
            total = max(warmup + 1, int(minutes * 60 / per))
            log(f"[{name}] calibrated: {per:.2f}s/step -> {total} steps for {minutes} min")
        if step % 10 == 0 or step == total or step == 1:
            per = elapsed / step
            log(f"[{name}] step {step}/{total} loss {lv:.3f} (ema {running:.3f}) lr {cur_lr:.2e} "
                f"{per:.2f}s/step elapsed {elapsed:.0f}s eta {per * (total - step):.0f}s")
    return total, time.time() - t_train, running




# ------------------------------------------------------------------------------
# the build, stage by stage
# ------------------------------------------------------------------------------
@dataclass
class Corpus:
    train_texts: list[str]
    heldout_texts: list[str]
    stats: dict  # collect_corpus's
    pairs: dict[str, list[ChatPair]]  # by split: train, spare, heldout


@dataclass
class Tokens:
    """The tokenizer and everything the stages train and measure on, as token streams."""

    tokenizer: Any  # transformers.PreTrainedTokenizerFast
    special_ids: dict[str, int]
    train: torch.Tensor  # raw source, eos after each file
    heldout: torch.Tensor
    chat: torch.Tensor  # the training chat pairs
    chat_starts: torch.Tensor  # where each pair opens in `chat` (those a full window fits after)
    heldout_chat: torch.Tensor

    def raw_rows(self, n: int, gen):
        """`n` raw-source windows at random offsets drawn from `gen`."""
        import torch

        starts = torch.randint(0, len(self.train) - SEQ_LEN, (n,), generator=gen)
        return self.train[starts[:, None] + torch.arange(SEQ_LEN)[None, :]]

    def chat_rows(self, n: int, gen):
        """`n` windows that open at a chat pair (the position a real chat prompt has, its <|im_start|> first)."""
        import torch

        starts = self.chat_starts[torch.randint(0, len(self.chat_starts), (n,), generator=gen)]
        return self.chat[starts[:, None] + torch.arange(SEQ_LEN)[None, :]]


def load_corpus(max_chars: int) -> Corpus:
    """Stage 1: the stdlib source and its chat pairs."""
    train_texts, heldout_texts, stats = collect_corpus(max_chars=max_chars)
    pairs = collect_chat_pairs(max_chars=max_chars)
    log(
        f"[corpus] {stats['n_train_files']} train files ({stats['n_train_chars']:,} chars), "
        f"{stats['n_heldout_files']} held-out files ({stats['n_heldout_chars']:,} chars); chat pairs "
        + ", ".join(f"{k} {len(v)}" for k, v in pairs.items())
    )
    return Corpus(train_texts, heldout_texts, stats, pairs)


def tokenize(corpus: Corpus, base: Path | None) -> Tokens:
    """Stage 2: the tokenizer (trained on raw source only: the base never sees a pair; a saved
    base's own with `base`) and the encoded streams."""
    from transformers import PreTrainedTokenizerFast

    t_tok = time.time()
    if base is not None:
        tokenizer = PreTrainedTokenizerFast.from_pretrained(base)
        tokenizer.chat_template = CHAT_TEMPLATE
    else:
        tokenizer = train_tokenizer(corpus.train_texts)
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    special_ids = {
        "eos": eos_id,
        "pad": tokenizer.pad_token_id,
        "mask": tokenizer.convert_tokens_to_ids(MASK_TOKEN),
        "im_start": tokenizer.convert_tokens_to_ids(IM_START),
        "im_end": tokenizer.convert_tokens_to_ids(IM_END),
    }
    train_stream = encode_stream(tokenizer, corpus.train_texts, eos_id)
    heldout_stream = encode_stream(tokenizer, corpus.heldout_texts, eos_id)
    chat_stream, chat_starts = encode_stream(tokenizer, [chat_text(p) for p in corpus.pairs["train"]], eos_id,
                                             with_starts=True)
    chat_starts = chat_starts[chat_starts < len(chat_stream) - SEQ_LEN]
    heldout_chat_stream = encode_stream(tokenizer, [chat_text(p) for p in corpus.pairs["heldout"]], eos_id)
    n_train_chars = corpus.stats["n_train_chars"]
    log(
        f"[tokenizer] vocab {len(tokenizer)} specials {special_ids} | train tokens "
        f"{len(train_stream):,} ({n_train_chars / len(train_stream):.2f} chars/tok), "
        f"held-out tokens {len(heldout_stream):,} | chat tokens {len(chat_stream):,} (held-out "
        f"{len(heldout_chat_stream):,}) | {time.time() - t_tok:.1f}s"
    )
    return Tokens(tokenizer, special_ids, train_stream, heldout_stream, chat_stream, chat_starts, heldout_chat_stream)


def base_stage(tokens: Tokens, *, base: Path | None, seed: int, steps: int, minutes: float | None, batch: int,
               lr: float, warmup: int, bf16_autocast: bool):
    """Stage 3: the base model trained from scratch on raw source, or a saved base loaded
    (`base`). Returns (model in fp32, holding bf16-rounded weights; the stage's record)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3ForCausalLM

    if base is not None:
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        info_path = Path(base) / "build_info.json"
        base_info = json.loads(info_path.read_text()) if info_path.exists() else {}
        if base_info.get("steps") == 0 and "base_stage" in base_info:  # a --chat-steps 0 build
            base_info = base_info["base_stage"]
        record = dict(from_dir=str(base), **{k: base_info.get(k) for k in
                                             ("steps", "peak_lr", "warmup_steps", "train_time_s", "bf16_autocast")})
        log(f"[base] loaded from {base} ({record['steps']} steps)")
    else:
        seed_everything(seed)
        model = Qwen3ForCausalLM(make_config(len(tokens.tokenizer), tokens.special_ids))
        gen = torch.Generator().manual_seed(seed)
        n1, t1, ema1 = train_stage(model, lambda: tokens.raw_rows(batch, gen), steps, lr, warmup, "base",
                                   minutes=minutes, bf16_autocast=bf16_autocast)
        model = model.to(torch.bfloat16).to(torch.float32)  # what a saved base would load as
        record = dict(steps=n1, peak_lr=lr, warmup_steps=warmup, train_time_s=round(t1, 1),
                      bf16_autocast=bf16_autocast, final_train_loss_ema=ema1)
    record["heldout_loss"] = heldout_loss(model, tokens.heldout)
    record["heldout_chat_loss"] = heldout_loss(model, tokens.heldout_chat)
    log(f"[base] {sum(p.numel() for p in model.parameters()):,} params | held-out loss "
        f"{record['heldout_loss']:.4f}, held-out chat-pair loss {record['heldout_chat_loss']:.4f}")
    return model, record


def chat_stage(model, tokens: Tokens, *, seed: int, steps: int, batch: int, lr: float, warmup: int,
               bf16_autocast: bool) -> dict:
    """Stage 4: `PAIR_FRACTION` of each batch opening at a chat pair, the rest raw source
    (0 steps: the base as it is). Returns the stage's record, fp32 losses included."""
    import torch

    gen = torch.Generator().manual_seed(seed + 1)
    n_chat = int(batch * PAIR_FRACTION)

    def mixed_batch():
        chat = tokens.chat_rows(n_chat, gen)  # drawn before the raw rows: the bundled build's order
        return torch.cat([tokens.raw_rows(batch - n_chat, gen), chat])

    n, t, ema = (train_stage(model, mixed_batch, steps, lr, warmup, "chat", bf16_autocast=bf16_autocast)
                 if steps > 0 else (0, 0.0, None))
    return dict(steps=n, train_time_s=t, final_train_loss_ema=ema,
                heldout_loss_fp32_before_save=heldout_loss(model, tokens.heldout),
                # memorisation check: the first training pairs, as many tokens as the held-out ones
                train_chat_loss_fp32=heldout_loss(model, tokens.chat[: len(tokens.heldout_chat)]))


def save(model, tokens: Tokens, out: Path) -> dict:
    """Stage 5: the model as bfloat16 safetensors, the tokenizer, a greedy generation config;
    then the held-out losses of what ships (bf16 weights reloaded and upcast to fp32)."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    for p in out.glob("*"):
        if p.is_file() and p.name.endswith((".safetensors", ".json", ".jinja", ".txt")):
            p.unlink()
    model = model.to(torch.bfloat16)
    ids = tokens.special_ids
    model.generation_config = GenerationConfig(do_sample=False, bos_token_id=ids["eos"], eos_token_id=ids["eos"],
                                               pad_token_id=ids["pad"])
    model.save_pretrained(out, safe_serialization=True)
    tokens.tokenizer.save_pretrained(out)
    _make_tokenizer_config_portable(out / "tokenizer_config.json")
    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    return dict(heldout_loss=heldout_loss(reloaded, tokens.heldout),
                heldout_chat_loss=heldout_loss(reloaded, tokens.heldout_chat))


def build_info(*, seed: int, batch: int, chat_lr: float, chat_warmup: int, chat_bf16_autocast: bool,
               corpus: Corpus, tokens: Tokens, config, n_params: int, base: dict, chat: dict, saved: dict) -> dict:
    """`build_info.json`: both stages' settings and losses, the data's sizes, the software that built it."""
    import torch
    import transformers

    return dict(
        builder=BUILDER,
        seed=seed,
        base_stage=base,
        steps=chat["steps"],  # the chat stage's
        batch_size=batch,
        seq_len=SEQ_LEN,
        peak_lr=chat_lr,
        warmup_steps=chat_warmup,
        min_lr_frac=MIN_LR_FRAC,
        weight_decay=WEIGHT_DECAY,
        bf16_autocast=chat_bf16_autocast,
        num_threads=NUM_THREADS,
        heldout_loss=saved["heldout_loss"],
        heldout_loss_fp32_before_save=chat["heldout_loss_fp32_before_save"],
        heldout_chat_loss=saved["heldout_chat_loss"],
        train_chat_loss_fp32=chat["train_chat_loss_fp32"],
        chat_pairs={k: len(v) for k, v in corpus.pairs.items()},
        pair_fraction=PAIR_FRACTION,
        chat_tokens=int(len(tokens.chat)),
        heldout_chat_tokens=int(len(tokens.heldout_chat)),
        heldout_tokens=int(len(tokens.heldout)),
        train_tokens=int(len(tokens.train)),
        ln_vocab=math.log(config.vocab_size),
        final_train_loss_ema=chat["final_train_loss_ema"],
        n_params=n_params,
        vocab_size=config.vocab_size,
        tokenizer_size=len(tokens.tokenizer),
        special_token_ids=tokens.special_ids,
        model=dict(MODEL_KW),
        train_time_s=round(chat["train_time_s"], 1),
        sec_per_step=round(chat["train_time_s"] / max(1, chat["steps"]), 3),
        build_time_s=None,
        size_on_disk_bytes=None,
        corpus={k: v for k, v in corpus.stats.items() if k != "heldout_files"},
        heldout_files=corpus.stats["heldout_files"],
        python=platform.python_version(),
        torch=torch.__version__,
        transformers=transformers.__version__,
        machine=platform.machine(),
    )


def build(
    out: Path,
    steps: int = DEFAULT_STEPS,
    minutes: float | None = None,
    seed: int = 0,
    batch: int = DEFAULT_BATCH,
    lr: float = DEFAULT_LR,
    warmup: int = DEFAULT_WARMUP,
    chat_steps: int = CHAT_STEPS,
    chat_lr: float = CHAT_LR,
    chat_warmup: int = CHAT_WARMUP,
    base: Path | None = None,
    max_chars: int = MAX_CORPUS_CHARS,
    bf16_autocast: bool = True,
    chat_bf16_autocast: bool = False,
) -> dict:
    """Stage 1 (base): tokenizer and model from scratch on raw source. Stage 2 (chat): from the
    base's weights rounded to bfloat16 (exactly what a saved base loads as), ``PAIR_FRACTION``
    of each batch opening at a chat pair. ``base=DIR`` skips stage 1 and starts stage 2 from a
    saved base (model and tokenizer), e.g. a ``chat_steps=0`` build."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")
    import torch

    t0 = time.time()
    torch.set_num_threads(NUM_THREADS)
    torch.use_deterministic_algorithms(True, warn_only=True)
    seed_everything(seed)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)

    corpus = load_corpus(max_chars)
    tokens = tokenize(corpus, base)
    model, base_record = base_stage(tokens, base=base, seed=seed, steps=steps, minutes=minutes, batch=batch, lr=lr,
                                    warmup=warmup, bf16_autocast=bf16_autocast)
    config, n_params = model.config, sum(p.numel() for p in model.parameters())
    chat = chat_stage(model, tokens, seed=seed, steps=chat_steps, batch=batch, lr=chat_lr, warmup=chat_warmup,
                      bf16_autocast=chat_bf16_autocast)
    saved = save(model, tokens, out)
    log(f"[eval] held-out chat-pair loss {saved['heldout_chat_loss']:.4f} "
        f"(first training pairs: {chat['train_chat_loss_fp32']:.4f})")
    log(f"[eval] held-out loss (saved bf16 -> fp32) {saved['heldout_loss']:.4f} "
        f"(ln V = {math.log(config.vocab_size):.3f})")

    info = build_info(seed=seed, batch=batch, chat_lr=chat_lr, chat_warmup=chat_warmup,
                      chat_bf16_autocast=chat_bf16_autocast, corpus=corpus, tokens=tokens, config=config,
                      n_params=n_params, base=base_record, chat=chat, saved=saved)
    info["build_time_s"] = round(time.time() - t0, 1)
    (out / "build_info.json").write_text(json.dumps(info, indent=2) + "\n")
    info["size_on_disk_bytes"] = dir_size(out)  # build_info.json included, so it is written twice
    (out / "build_info.json").write_text(json.dumps(info, indent=2) + "\n")
    log(
        f"[done] {out} | build {info['build_time_s']}s | {info['size_on_disk_bytes'] / 1e6:.2f} MB | "
        f"{n_params:,} params | held-out loss {saved['heldout_loss']:.4f}, chat-pair {saved['heldout_chat_loss']:.4f}"
    )
    return info


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="base-stage training steps (deterministic)")
    ap.add_argument(
        "--minutes",
        type=float,
        default=None,
        help="instead of --steps: calibrate the base stage to ~M minutes of training (recorded in build_info.json)",
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch", type=int, default=DEFAULT_BATCH)
    ap.add_argument("--lr", type=float, default=DEFAULT_LR, help="base-stage peak learning rate")
    ap.add_argument("--warmup", type=int, default=DEFAULT_WARMUP, help="base-stage warm-up steps")
    ap.add_argument("--chat-steps", type=int, default=CHAT_STEPS, help="chat-stage steps (0: save the base)")
    ap.add_argument("--chat-lr", type=float, default=CHAT_LR)
    ap.add_argument("--chat-warmup", type=int, default=CHAT_WARMUP)
    ap.add_argument("--base", type=Path, default=None,
                    help="start the chat stage from this saved base (model + tokenizer) instead of training one")
    ap.add_argument("--max-chars", type=int, default=MAX_CORPUS_CHARS)
    ap.add_argument("--no-bf16-autocast", action="store_true", help="base stage in fp32")
    # bf16 autocast is ~15x slower than fp32 on a CPU without AVX-512 BF16 (59 vs 4 s/step
    # measured on an AVX2-only EPYC): the bundled chat stage ran in fp32
    ap.add_argument("--chat-bf16-autocast", action="store_true", help="chat stage under bf16 autocast")
    args = ap.parse_args(argv)
    build(
        args.out,
        steps=args.steps,
        minutes=args.minutes,
        seed=args.seed,
        batch=args.batch,
        lr=args.lr,
        warmup=args.warmup,
        chat_steps=args.chat_steps,
        chat_lr=args.chat_lr,
        chat_warmup=args.chat_warmup,
        base=args.base,
        max_chars=args.max_chars,
        bf16_autocast=not args.no_bf16_autocast,
        chat_bf16_autocast=args.chat_bf16_autocast,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
