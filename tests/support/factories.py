"""Small random models built from configs, for fast tests (no files, no downloads)."""
from __future__ import annotations

import functools

import torch

from dflash_train.core.config import DrafterConfig
from dflash_train.core.model import DFlashDrafter
from dflash_train.core.target import Target

VOCAB = 96
MASK_ID = VOCAB - 1


def qwen3_target(layers: int = 6, hidden: int = 32, seed: int = 0) -> Target:
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, max_position_embeddings=512)
    return Target(Qwen3ForCausalLM(cfg).float())


def qwen3_5_vlm_target(layers: int = 4, hidden: int = 32, seed: int = 0) -> Target:
    """A tiny Qwen3.5 conditional-generation model: the text stack sits under model.language_model."""
    from transformers.models.qwen3_5 import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    torch.manual_seed(seed)
    text = dict(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4, linear_num_key_heads=2,
                linear_num_value_heads=2, linear_key_head_dim=8, linear_value_head_dim=8)
    vision = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=32, out_hidden_size=hidden)
    return Target(Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=vision)).float())


def drafter_for(target: Target, *, layers: int = 2, features: int = 3, block_size: int = 8, seed: int = 1,
                **fields) -> DFlashDrafter:
    torch.manual_seed(seed)
    cfg = DrafterConfig.for_target(target.model.config, mask_token_id=MASK_ID, num_hidden_layers=layers,
                                   num_features=features, block_size=block_size, **fields)
    return DFlashDrafter(cfg).eval()


# --- real shapes ---------------------------------------------------------------------------
# Random weights, but the shapes that break things: real vocabularies (embedding and LM head
# above 2^24 elements), >= 8 layers, a byte-level BPE tokenizer with the special tokens at
# their published ids, the Qwen3 chat template, and Qwen3.5's hybrid linear/full attention
# stack with mrope under a conditional-generation wrapper. Built offline in a few seconds.

QWEN3_VOCAB = 151936  # embedding rows (the tokenizer uses fewer; the rest is padding)
QWEN3_SPECIALS = {151643: "<|endoftext|>", 151644: "<|im_start|>", 151645: "<|im_end|>",
                  151667: "<think>", 151668: "</think>", 151669: "<|MASK|>"}
QWEN3_5_VOCAB = 248320
QWEN3_5_SPECIALS = {248044: "<|endoftext|>", 248045: "<|im_start|>", 248046: "<|im_end|>",
                    248068: "<think>", 248069: "</think>", 248070: "<|MASK|>"}

# The Qwen3 chat format (ours, written from the format): turns in <|im_start|>role ... <|im_end|>;
# with enable_thinking=False the assistant turn opens with an empty think block.
QWEN3_CHAT_TEMPLATE = (
    "{%- for m in messages -%}"
    "{{- '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- if enable_thinking is defined and enable_thinking is false -%}"
    "{{- '<think>\\n\\n</think>\\n\\n' -}}"
    "{%- endif -%}"
    "{%- endif -%}")


@functools.lru_cache(maxsize=2)
def byte_level_tokenizer(specials: tuple[tuple[int, str], ...]):
    """A Qwen2-style byte-level BPE tokenizer: 256 byte symbols, then synthetic merges up to
    the first special id (so regular ids span the real range), then the special tokens at
    their ids (gaps filled with reserved names: added tokens are numbered consecutively)."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    first_special = min(i for i, _ in specials)
    vocab = {s: i for i, s in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    common = ([chr(c) for c in range(ord("a"), ord("z") + 1)] + ["Ġ", "Ċ"]
              + [chr(c) for c in range(ord("A"), ord("Z") + 1)] + list("0123456789_.,:;()[]{}=+-*/#\"'<>|!?"))
    merges, frontier = [], list(common)
    while len(vocab) < first_special:  # "ab", "abc", ...: deterministic, every part present
        grown = [a + b for a in frontier for b in common if a + b not in vocab]
        for piece in grown[: first_special - len(vocab)]:
            vocab[piece] = len(vocab)
            merges.append((piece[:-1], piece[-1]))
        frontier = grown
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    named = dict(specials)
    tok.add_tokens([AddedToken(named.get(i, f"<|reserved_special_{i}|>"), normalized=False,
                               special=named.get(i) not in ("<think>", "</think>"))
                    for i in range(first_special, max(named) + 1)])
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   mask_token="<|MASK|>")
    fast.chat_template = QWEN3_CHAT_TEMPLATE
    for i, name in specials:
        assert fast.convert_tokens_to_ids(name) == i, (name, i)
    return fast


def qwen3_real_shape(layers: int = 8, hidden: int = 128, seed: int = 0) -> Target:
    """Qwen3 at vocab 151,936 (untied head, 19.4M-element embedding and LM head), small hidden."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=QWEN3_VOCAB, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2, head_dim=hidden // 4,
                      max_position_embeddings=40960, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                      tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151645)
    model = Qwen3ForCausalLM(cfg).float()
    model.generation_config.eos_token_id = [151645, 151643]
    return Target(model, byte_level_tokenizer(tuple(QWEN3_SPECIALS.items())))


def qwen3_5_real_shape(layers: int = 8, hidden: int = 128, seed: int = 0) -> Target:
    """A wrapped Qwen3.5 conditional-generation model at vocab 248,320: linear-attention
    (gated delta net) and full-attention layers (3:1), partial-rotary interleaved mrope."""
    from transformers.models.qwen3_5 import Qwen3_5Config, Qwen3_5ForConditionalGeneration

    torch.manual_seed(seed)
    text = dict(vocab_size=QWEN3_5_VOCAB, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
                linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
                max_position_embeddings=40960, tie_word_embeddings=False, eos_token_id=248046,
                rope_parameters={"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25,
                                 "mrope_section": [2, 1, 1], "mrope_interleaved": True})
    vision = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=32, out_hidden_size=hidden)
    model = Qwen3_5ForConditionalGeneration(Qwen3_5Config(text_config=text, vision_config=vision,
                                                          tie_word_embeddings=False)).float()
    model.generation_config.eos_token_id = [248046, 248044]
    return Target(model, byte_level_tokenizer(tuple(QWEN3_5_SPECIALS.items())))


def save_target(target: Target, directory) -> None:
    """A model directory as published: weights, config, generation config, tokenizer, template."""
    target.model.save_pretrained(directory)
    target.tokenizer.save_pretrained(directory)


def real_shape_drafter(target: Target, *, layers: int = 1, block_size: int = 8, seed: int = 1,
                       **config) -> DFlashDrafter:
    """A random drafter for a real-shape target, masking with the tokenizer's <|MASK|>."""
    torch.manual_seed(seed)
    cfg = DrafterConfig.for_target(target.model.config, mask_token_id=target.mask_token_id(),
                                   num_hidden_layers=layers, num_features=5, block_size=block_size, **config)
    return DFlashDrafter(cfg).eval()
