"""The DFlash drafter: one implementation, used by the trainer and the eval worker alike.

A block-diffusion drafter that proposes a whole block at once. Its input is a block of
token ids `[anchor, MASK x (B-1)]` embedded by the (frozen, borrowed) target embedding,
plus "context features": target hidden states from a few layers, concatenated and
projected once by `hidden_norm(fc(.))`. Every decoder layer attends from the block to
keys/values `[k_proj(context) ; k_proj(block)]`. Outputs go through the final `norm` and
the target's LM head. Positions are absolute: context position p, block slot k at
`anchor + k`.

Parameter names match the published checkpoints (`layers.{i}.self_attn.q_proj.weight`,
`fc.weight`, `hidden_norm.weight`, `norm.weight`, ...), so `state_dict()` is the
checkpoint layout.
"""
from __future__ import annotations

import dataclasses
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3MLP,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
)

from .config import ConfigError, DrafterConfig
from .masks import BlockLayout, build_attention_mask, cached_block_mask, choose_backend


class DraftCache:
    """Per-layer context keys/values of a drafter, for incremental drafting.

    Only context K/V persist between drafts; block K/V never enter the cache (the
    equivalent of cropping the draft cache back to the anchor after each draft).
    """

    def __init__(self, num_layers: int):
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers

    @property
    def length(self) -> int:
        return 0 if self.keys[0] is None else self.keys[0].shape[2]

    def extend(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        prev_k, prev_v = self.keys[layer], self.values[layer]
        if prev_k is not None and prev_v is not None:  # set together, below
            k = torch.cat([prev_k, k], dim=2)
            v = torch.cat([prev_v, v], dim=2)
        self.keys[layer], self.values[layer] = k, v
        return k, v

    def context(self, layer: int):
        """The layer's cached context keys and values, what its blocks attend to before their own."""
        return self.keys[layer], self.values[layer]


def join_kv(ctx_kv, k_blk: torch.Tensor, v_blk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`[context ; block]` keys and values along the sequence. A context that has a `join` method (the
    eval walk's group buffers, `walk.GroupKV`) writes the block's right after its own and returns views:
    the same values, without a copy of the context's."""
    join = getattr(ctx_kv, "join", None)
    if join is not None:
        return join(k_blk, v_blk)
    return torch.cat([ctx_kv[0], k_blk], dim=2), torch.cat([ctx_kv[1], v_blk], dim=2)


def _attend(q, k, v, mask) -> torch.Tensor:
    """Attention over [context ; block] keys with one of three mask kinds."""
    if mask is None:  # a single block drafted right after all of its context
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    if isinstance(mask, torch.Tensor):
        # SDPA gives NaN on rows that may see nothing (padding blocks); flex gives 0.
        # Let such rows see everything, then zero them, so both backends agree exactly.
        empty = ~mask.any(dim=-1, keepdim=True)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask | empty, enable_gqa=True)
        return out.masked_fill(empty, 0.0)
    return _flex(q, k, v, mask)


_compiled_flex = None


def _flex(q, k, v, block_mask):
    from torch.nn.attention.flex_attention import flex_attention

    global _compiled_flex
    if q.device.type == "cuda":
        if _compiled_flex is None:
            _compiled_flex = torch.compile(flex_attention, dynamic=False)
        return _compiled_flex(q, k, v, block_mask=block_mask, enable_gqa=True)
    return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=True)


class DrafterAttention(nn.Module):
    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = cfg.head_dim
        H = cfg.hidden_size
        self.q_proj = nn.Linear(H, self.num_heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(H, self.num_kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(H, self.num_kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, H, bias=False)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=cfg.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=cfg.rms_norm_eps)

    def _heads(self, x: torch.Tensor, n: int) -> torch.Tensor:
        return x.view(*x.shape[:2], n, self.head_dim)

    def key_value(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """Rotated keys and values `[batch, kv_heads, len, head_dim]` for inputs x."""
        k = self.k_norm(self._heads(self.k_proj(x), self.num_kv_heads)).transpose(1, 2)
        v = self._heads(self.v_proj(x), self.num_kv_heads).transpose(1, 2)
        return _rope(k, cos, sin), v

    def forward(self, h, rope_block, ctx_kv, mask):
        cos, sin = rope_block
        q = self.q_norm(self._heads(self.q_proj(h), self.num_heads)).transpose(1, 2)
        q = _rope(q, cos, sin)
        k_blk, v_blk = self.key_value(h, cos, sin)
        k, v = join_kv(ctx_kv, k_blk, v_blk)
        out = _attend(q, k, v, mask)
        return self.o_proj(out.transpose(1, 2).reshape(*h.shape[:2], -1))


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding of `[batch, heads, len, dim]` (same formula as the Qwen3 target)."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos.unsqueeze(1) + torch.cat((-x2, x1), dim=-1) * sin.unsqueeze(1)


class DrafterLayer(nn.Module):
    def __init__(self, cfg: DrafterConfig, qcfg):
        super().__init__()
        self.self_attn = DrafterAttention(cfg)
        self.mlp = Qwen3MLP(qcfg)
        self.input_layernorm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def forward(self, h, rope_block, ctx_kv, mask):
        h = h + self.self_attn(self.input_layernorm(h), rope_block, ctx_kv, mask)
        return h + self.mlp(self.post_attention_layernorm(h))


class DFlashDrafter(nn.Module):
    """The drafter network (no embedding, no LM head: both are the target's)."""

    stored_dtype: str = ""  # a loaded drafter's file dtype(s), named in results (it computes in the target's)
    # a loaded drafter's own embedding / LM head copies (checkpoint.drafter_from_tensors), until
    # checkpoint.check_own_vocab compares them with the target's and drops them; declared only (no default)
    own_vocab: dict[str, torch.Tensor]

    def __init__(self, cfg: DrafterConfig):
        super().__init__()
        self.config = cfg
        qcfg = cfg.qwen3_config()
        self.layers = nn.ModuleList(DrafterLayer(cfg, qcfg) for _ in range(cfg.num_hidden_layers))
        assert cfg.target_hidden_size is not None  # DrafterConfig.__post_init__ defaults it to hidden_size
        self.fc = nn.Linear(cfg.num_features * cfg.target_hidden_size, cfg.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.norm = Qwen3RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(qcfg)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(m: nn.Module) -> None:
        if isinstance(m, nn.Linear):
            nn.init.normal_(m.weight, std=0.02)

    def forward(self, block_embeds: torch.Tensor, block_positions: torch.Tensor,
                context_features: torch.Tensor | None, context_positions: torch.Tensor | None,
                mask=None, cache: DraftCache | None = None) -> torch.Tensor:
        """Final-normed hidden states of the block slots, `[batch, Q, hidden]`.

        block_embeds: target embeddings of the block tokens, `[batch, Q, hidden]`.
        context_features: concatenated target features `[batch, S, n*H]` (with a cache:
            only the new context positions; may be None when nothing is new).
        mask: None (one block right after all of its context: each layer masks by its own
            window/causality, `masks.cached_block_mask`), or one mask per layer (dense bool
            tensors or flex BlockMasks, as `forward_blocks` builds them).
        """
        h = block_embeds
        rope_block = self.rotary_emb(h, block_positions)
        ctx = None
        if context_features is not None and context_features.shape[1] > 0:
            ctx = self.hidden_norm(self.fc(context_features.to(self.fc.weight.dtype)))
            cos_c, sin_c = self.rotary_emb(ctx, context_positions)
        for i, (layer, (window, causal)) in enumerate(zip(self.layers, self.config.attention(), strict=False)):
            if ctx is not None:
                kv = cast(DrafterLayer, layer).self_attn.key_value(ctx, cos_c, sin_c)
            else:
                shape = (h.shape[0], self.config.num_key_value_heads, 0, self.config.head_dim)
                kv = (h.new_zeros(shape), h.new_zeros(shape))
            if cache is not None:
                kv = cache.extend(i, *kv) if ctx is not None else cache.context(i)
                if kv[0] is None:
                    raise ValueError("drafting with an empty cache and no context")
            if mask is None:  # the cache holds context positions 0..len-1
                ctx_pos = (torch.arange(kv[0].shape[2], device=h.device)[None] if cache is not None or ctx is None
                           else context_positions)
                assert ctx_pos is not None  # context features come with their positions (rotated above)
                layer_mask = cached_block_mask(block_positions, ctx_pos, window, causal)
            else:
                layer_mask = mask[i]
            h = layer(h, rope_block, kv, layer_mask)
        return self.norm(h)

    def forward_blocks(self, embed_tokens: nn.Module, input_ids: torch.Tensor, context_features: torch.Tensor,
                       anchors: torch.Tensor, valid: torch.Tensor | None = None, backend: str = "auto",
                       see_anchor_state: bool = False) -> torch.Tensor:
        """Draft N blocks per row at once in the multi-block layout (training and eval).

        input_ids `[batch, S]`, context_features `[batch, S, n*H]`, anchors `[batch, N]`.
        Block j is `[input_ids[anchor_j], MASK x (B-1)]` at positions `anchor_j + k`.
        Returns hidden states `[batch, N*B, hidden]`; slot k of block j predicts the
        token at `anchor_j + k`.
        see_anchor_state: context `kv <= anchor` instead of `kv < anchor`, the inclusive-anchor
        leak. Never for training or drafting: only the eval worker's leak probe asks for it.
        backend: auto | flex | sdpa, resolved by `masks.choose_backend` (auto falls back to SDPA where
        flex cannot run this drafter; an explicit flex there raises).
        """
        B = self.config.block_size
        backend, _ = choose_backend(backend, self.config, input_ids.device, backward=torch.is_grad_enabled())
        if valid is None:
            valid = torch.ones_like(anchors, dtype=torch.bool)
        layout = BlockLayout(anchors=anchors, valid=valid, context_len=input_ids.shape[1], block_size=B,
                             see_anchor_state=see_anchor_state)
        block_ids = block_token_ids(input_ids, anchors, B, self.config.mask_token_id)
        ctx_pos = torch.arange(input_ids.shape[1], device=input_ids.device).expand(input_ids.shape[0], -1)
        built: dict = {}  # one mask per distinct (window, causal) among the layers
        for spec in self.config.attention():
            if spec not in built:
                built[spec] = build_attention_mask(dataclasses.replace(layout, window=spec[0], causal=spec[1]), backend)
        masks = [built[spec] for spec in self.config.attention()]
        return self(embed_tokens(block_ids), layout.block_positions(), context_features, ctx_pos, masks)


def mask_blocks(first: torch.Tensor, block_size: int, mask_token_id: int | None) -> torch.Tensor:
    """`[..., B]` ids: one block `[first, MASK x (B-1)]` per anchor token in `first` (any shape).

    The one place a draft block is built: training, the engine, the reference loop and the
    speed estimate all draft from it. `mask_token_id` is a config's, None until
    `DrafterConfig.resolve_mask_token` resolved its `mask_token`: drafting before that is an error.
    """
    if mask_token_id is None:
        raise ConfigError("the drafter's mask_token is not resolved to an id (DrafterConfig.resolve_mask_token)")
    ids = torch.full((*first.shape, block_size), mask_token_id, dtype=first.dtype, device=first.device)
    ids[..., 0] = first
    return ids


def block_token_ids(input_ids: torch.Tensor, anchors: torch.Tensor, block_size: int,
                    mask_token_id: int | None) -> torch.Tensor:
    """`[batch, N*B]` ids: each block is `[token at anchor, MASK x (B-1)]`."""
    first = torch.gather(input_ids, 1, anchors.clamp(0, input_ids.shape[1] - 1))
    return mask_blocks(first, block_size, mask_token_id).reshape(anchors.shape[0], -1)
