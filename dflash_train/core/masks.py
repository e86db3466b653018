"""The DFlash multi-block attention mask, defined once.

Layout: queries are N blocks of B slots, `[block_0 | ... | block_{N-1}]`; keys/values are
`[context (S positions) | block_0 | ... | block_{N-1}]`. A query in block j may see

  1. context keys strictly before its anchor (`kv < anchor_j`): the anchor's own target
     state is not available at inference, and seeing it is the "shortcut" leak that makes
     training accuracy look great while real acceptance is ~1;
  2. every key of its own block (bidirectional);
  3. nothing else. Invalid (padding) blocks see nothing.

Per drafter layer, published configs may narrow this (`DrafterConfig.attention`):
  - a sliding window W: only keys less than W positions away (`sliding_attention` layers;
    symmetric, as flash-attention's non-causal window, so within a block it only bites
    when W < B);
  - causal: a block slot sees only the slots of its block up to itself (what SGLang and
    vLLM do in sliding layers unless the config says otherwise).
`visible` states both on absolute positions, once, for every layout.

`mask_mod` is the single definition of the multi-block mask. On CUDA it is compiled into a
flex_attention BlockMask; elsewhere (or where the compiled kernel refuses the drafter's shape:
`choose_backend`) the same function is evaluated on an index grid to give a dense boolean mask
for SDPA. Tests hold the two equal. Cached drafting (one block right
after its whole context) is the same layout with one block at anchor = context length:
`cached_block_mask` gives its mask from `visible` alone (rules 1-2 hold trivially there).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)


@dataclass
class BlockLayout:
    """Where the blocks sit: `anchors[b, j]` is block j's anchor position in row b."""

    anchors: torch.Tensor  # [batch, N] long
    valid: torch.Tensor  # [batch, N] bool
    context_len: int  # S
    block_size: int  # B
    window: int | None = None  # sliding-window layers: keys less than `window` positions away
    causal: bool = False  # a block slot sees its own block only up to itself
    see_anchor_state: bool = False  # context kv <= anchor: the leak, shown only to the eval leak probe

    @property
    def num_blocks(self) -> int:
        return self.anchors.shape[1]

    @property
    def q_len(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def kv_len(self) -> int:
        return self.context_len + self.q_len

    def block_positions(self) -> torch.Tensor:
        """Absolute positions of block slots: slot k of block j sits at `anchor_j + k`."""
        k = torch.arange(self.block_size, device=self.anchors.device)
        return (self.anchors[:, :, None] + k).reshape(self.anchors.shape[0], -1)


def visible(q_pos, kv_pos, window: int | None, causal: bool):
    """The per-layer narrowing on absolute positions (broadcasting tensors)."""
    ok = torch.ones_like(q_pos - kv_pos, dtype=torch.bool)
    if window is not None:
        ok = ok & (q_pos - kv_pos < window) & (kv_pos - q_pos < window)
    if causal:
        ok = ok & (kv_pos <= q_pos)
    return ok


def make_mask_mod(layout: BlockLayout):
    """The mask as a flex_attention `mask_mod(b, h, q_idx, kv_idx) -> bool`.

    Written with tensor ops only, so it broadcasts over index grids too.
    """
    anchors, valid = layout.anchors, layout.valid
    S, B, window, causal = layout.context_len, layout.block_size, layout.window, layout.causal

    def mask_mod(b, h, q_idx, kv_idx):
        blk = q_idx // B
        in_context = kv_idx < S
        sees_context = in_context & (kv_idx < anchors[b, blk] + int(layout.see_anchor_state))
        sees_own_block = (~in_context) & (torch.div(kv_idx - S, B, rounding_mode="floor") == blk)
        ok = valid[b, blk] & (sees_context | sees_own_block)
        if window is None and not causal:
            return ok
        q_pos = anchors[b, blk] + q_idx % B  # slot k of block j sits at anchor_j + k
        kv_pos = torch.where(in_context, kv_idx, anchors[b, blk] + (kv_idx - S) % B)
        return ok & visible(q_pos, kv_pos, window, causal)

    return mask_mod


def cached_block_mask(block_positions: torch.Tensor, context_positions: torch.Tensor, window: int | None,
                      causal: bool) -> torch.Tensor | None:
    """Mask for one block drafted right after its context (every context position is before
    the anchor): `[batch, 1, B, S + B]` over keys `[context ; block]`, or None when every key
    is visible (full, non-causal layers)."""
    if window is None and not causal:
        return None
    kv_pos = torch.cat([context_positions.expand(block_positions.shape[0], -1), block_positions], dim=1)
    return visible(block_positions[:, None, :, None], kv_pos[:, None, None, :], window, causal)


def dense_mask(layout: BlockLayout) -> torch.Tensor:
    """`[batch, 1, N*B, S+N*B]` bool mask (True = may attend), from `make_mask_mod`."""
    dev = layout.anchors.device
    b = torch.arange(layout.anchors.shape[0], device=dev)[:, None, None, None]
    h = torch.zeros(1, 1, 1, 1, dtype=torch.long, device=dev)
    q = torch.arange(layout.q_len, device=dev)[None, None, :, None]
    kv = torch.arange(layout.kv_len, device=dev)[None, None, None, :]
    return make_mask_mod(layout)(b, h, q, kv)


def flex_block_mask(layout: BlockLayout, *, compile: bool | None = None):
    """The same mask as a flex_attention BlockMask (sparse: fully masked tiles are skipped)."""
    from torch.nn.attention.flex_attention import create_block_mask

    dev = layout.anchors.device
    if compile is None:
        compile = dev.type == "cuda"
    return create_block_mask(make_mask_mod(layout), B=layout.anchors.shape[0], H=None,
                             Q_LEN=layout.q_len, KV_LEN=layout.kv_len, device=dev, _compile=compile)


BACKENDS = ("auto", "flex", "sdpa")
# The compiled (Triton) flex_attention kernel on CUDA refuses query/key/value head dims below 16
# (`tl.dot` needs K >= 16): torch/_inductor/kernel/flex/flex_attention.py raises "NYI: embedding
# dimension ... must be at least 16" (torch 2.11, met on an H200, through 2.13).
FLEX_MIN_HEAD_DIM = 16


class AttentionBackendError(ValueError):
    """`backend=flex` asked for where flex_attention cannot run: raised before any work."""


def flex_unavailable(config, device, *, backward: bool = False, triton: bool | None = None) -> str | None:
    """Why flex_attention cannot run drafter `config` (anything with `head_dim`) on `device`, or None
    when it can. `backward`: gradients will flow (training). `triton`: whether Triton is importable
    (default: asked of this machine; pass it to ask about another machine, e.g. a CUDA one from a CPU).

    The one home of the rule: the trainer, the drafter's multi-block forward and the engine's drafting
    all ask here (through `choose_backend`)."""
    kind = torch.device(device).type
    if kind == "cuda":
        if config.head_dim < FLEX_MIN_HEAD_DIM:
            return (f"head_dim {config.head_dim} < {FLEX_MIN_HEAD_DIM}: the compiled flex_attention kernel on CUDA "
                    f"needs query/key/value head dims of at least {FLEX_MIN_HEAD_DIM}")
        if triton is None:
            from torch.utils._triton import has_triton_package

            triton = has_triton_package()
        if not triton:
            return "Triton is not installed: flex_attention cannot be compiled for CUDA"
        return None
    if backward and kind in ("cpu", "mps"):
        return f"flex_attention has no backward pass on {kind} (torch refuses it)"
    return None


_announced: set[str] = set()


def choose_backend(requested: str, config, device, *, backward: bool = False, triton: bool | None = None,
                   announce: bool = True) -> tuple[str, str | None]:
    """The attention backend that runs: `(backend, why flex was not taken)`.

    auto: flex on CUDA where `flex_unavailable` finds nothing, else the SDPA twin (the same mask,
    dense); off CUDA always SDPA (flex is only compiled there). A CUDA fallback is logged once per
    reason and process (`announce=False`: the caller logs it).
    flex: flex, or `AttentionBackendError` naming why it cannot run. sdpa: SDPA."""
    if requested not in BACKENDS:
        raise AttentionBackendError(f"unknown attention backend {requested!r} ({', '.join(BACKENDS)})")
    if requested == "sdpa":
        return "sdpa", None
    why = flex_unavailable(config, device, backward=backward, triton=triton)
    if requested == "flex":
        if why:
            raise AttentionBackendError(f"backend=flex cannot run on {torch.device(device).type}: {why}; "
                                        "use backend=auto (falls back to SDPA) or backend=sdpa")
        return "flex", None
    if torch.device(device).type != "cuda":
        return "sdpa", None
    if why is None:
        return "flex", None
    if announce and why not in _announced:
        _announced.add(why)
        log.warning("attention: SDPA instead of flex_attention (%s)", why)
    return "sdpa", why


def build_attention_mask(layout: BlockLayout, backend: str):
    """Mask object for `DFlashDrafter`: a BlockMask for flex, a dense tensor for SDPA (`backend` as
    `choose_backend` resolved it)."""
    if backend == "flex":
        return flex_block_mask(layout)
    if backend == "sdpa":
        return dense_mask(layout)
    raise ValueError(f"attention backend {backend!r} is not resolved (flex, sdpa): see choose_backend")
