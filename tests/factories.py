"""Small random models built from configs, for fast tests (no files, no downloads)."""
from __future__ import annotations

import torch

from dflash_train.config import DrafterConfig
from dflash_train.model import DFlashDrafter
from dflash_train.target import Target

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


def drafter_for(target: Target, *, layers: int = 2, features: int = 3, block_size: int = 8, seed: int = 1) -> DFlashDrafter:
    torch.manual_seed(seed)
    cfg = DrafterConfig.for_target(target.model.config, mask_token_id=MASK_ID, num_hidden_layers=layers,
                                   num_features=features, block_size=block_size)
    return DFlashDrafter(cfg).eval()
