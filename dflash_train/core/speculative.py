"""Reference DFlash speculative decoding: draft a block, verify it in one target pass.

Lossless: the committed tokens are exactly the target's greedy decode, or with a
`sampler` (`dflash_train.core.sampling`) exactly the target's own keyed samples; what the
drafter changes is only how many tokens each verify step commits (its acceptance
length, 1..B, bonus token included). Batch size 1, written to be read, not to be fast.

One round, with `start` the position of the last committed token (the anchor):
  1. draft: block `[seq[start], MASK x (B-1)]` at positions start..start+B-1, context =
     target features of positions < start;
  2. verify: the target runs over the block tokens `[seq[start], d_1 .. d_{B-1}]`,
     giving its choice p_i for position start+i+1 (greedy: argmax; sampling: the token
     drawn with the key of position start+i+1, the draft d_i playing no part in it);
  3. accept the longest prefix with d_i == p_{i-1}, then the bonus p_n; the target's
     features for positions start..start+n become context, and its cache is rewound to
     start+n+1 (`VerifyCache`: attention layers cropped; the recurrent states of hybrid
     targets such as Qwen3.5/3.6 restored and advanced over the accepted tokens).

When to stop (`counting`, docs/design.md "Counting rules"): "response" runs steps until
max_new_tokens tokens (or eos) are committed; "published" repeats z-lab's
`dflash_generate`, which loops while fewer than max_new_tokens + 1 tokens are committed
and looks for eos only after a step, so it can run one step whose tokens are all cut
off (when the steps so far sum to max_new_tokens - 1) and one step after an eos first
token. "deepspec" loops as "published" but not past an eos first token, and a step whose
accepted drafts hold eos adds the drafts through it, no bonus; "vllm" counts as "response";
"sglang" adds what a step commits (cut at eos / max_new_tokens). All commit the same tokens;
only the counted steps and what each adds differ.

Sampling (DFlash's reference loop at temperature > 0): the drafter still proposes its
top-1 block; the target samples a token at every block position and the drafts are
accepted while they equal those samples, the first differing sample being the bonus.
Each committed token is the target's sample at its position given the committed prefix,
so the output is a plain sample from the target, and with keyed draws it is the very
sample the engine's sampled reference holds (docs/design.md, "Sampling").
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .model import DFlashDrafter, DraftCache, mask_blocks
from .sampling import Sampler
from .target import Target, VerifyCache
from .tau import check_counting, tau


@dataclass
class SpecResult:
    tokens: list[int]  # generated tokens (prompt excluded)
    accept_lengths: list[int] = field(default_factory=list)  # per verify step, bonus included

    @property
    def tau(self) -> float | None:
        return tau(self.accept_lengths)


@torch.no_grad()
def greedy_generate(target: Target, prompt_ids: list[int], max_new_tokens: int,
                    eos_token_id: int | None = None) -> list[int]:
    """Plain greedy decoding with the target (the reference that spec decoding must equal)."""
    ids = torch.tensor([prompt_ids], device=target.device)
    out = target.model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                do_sample=False, eos_token_id=eos_token_id, pad_token_id=eos_token_id or 0)
    return out[0, len(prompt_ids):].tolist()


def _more_steps(result: SpecResult, max_new_tokens: int, eos_token_id: int | None, counting: str) -> bool:
    if counting in ("published", "deepspec"):  # `while start < prompt + N`; stop checked after a step
        stopped = (bool(result.accept_lengths) or counting == "deepspec") and eos_token_id in result.tokens
        return len(result.tokens) - 1 < max_new_tokens and not stopped
    return len(result.tokens) < max_new_tokens and result.tokens[-1] != eos_token_id


@torch.no_grad()
def speculative_generate(target: Target, drafter: DFlashDrafter, prompt_ids: list[int], max_new_tokens: int,
                         eos_token_id: int | None = None, use_cache: bool | None = None,
                         counting: str = "response", sampler: Sampler | None = None) -> SpecResult:
    """`use_cache=False` re-runs the target over the whole sequence at every verify step
    (the slow path the tests hold the cached one equal to). `sampler`: the target samples
    with keyed draws instead of taking its argmax (None: greedy)."""
    check_counting(counting)
    cfg = drafter.config
    B, layer_ids = cfg.block_size, cfg.layer_ids
    dev = target.device
    embed, head = target.parts.embed_tokens, target.parts.lm_head
    cache = VerifyCache(target)
    if use_cache is None:
        use_cache = cache.rewindable

    seq = list(prompt_ids)
    out = target.forward(torch.tensor([seq], device=dev), layer_ids, past_key_values=cache.kv if use_cache else None,
                         use_cache=use_cache)
    ctx_feats = out.features  # features of positions [draft_cache.length, start)

    def choose(last_hidden: torch.Tensor, first_position: int) -> torch.Tensor:
        """The target's tokens for `[n, H]` final hiddens predicting positions first_position.."""
        logits = head(last_hidden)
        return logits.argmax(-1) if sampler is None else sampler.tokens(logits, first_position)

    seq.append(int(choose(out.last_hidden[0, -1:], len(seq))[0]))
    result = SpecResult(tokens=[seq[-1]])
    dcache = DraftCache(cfg.num_hidden_layers)
    # drafter weights may be bf16 while the target runs fp32 (or vice versa)
    ddtype = drafter.fc.weight.dtype

    while _more_steps(result, max_new_tokens, eos_token_id, counting):
        start = len(seq) - 1
        block = mask_blocks(torch.tensor([seq[start]], device=dev), B, cfg.mask_token_id)
        positions = torch.arange(start, start + B, device=dev)[None]
        ctx_pos = torch.arange(dcache.length, start, device=dev)[None]
        hidden = drafter(embed(block).to(ddtype), positions, ctx_feats, ctx_pos, mask=None, cache=dcache)
        drafts = head(hidden[:, 1:].to(head.weight.dtype)).argmax(-1)[0]

        block[0, 1:] = drafts
        if use_cache:
            cache.save()
            vout = target.forward(block, layer_ids, past_key_values=cache.kv, use_cache=True)
            feats, last = vout.features, vout.last_hidden
        else:
            full = torch.tensor([seq[:start]], device=dev)
            vout = target.forward(torch.cat([full, block], dim=1), layer_ids)
            feats, last = vout.features[:, start:], vout.last_hidden[:, start:]
        posterior = choose(last[0], start + 1)  # posterior[i]: target's token for position start+i+1
        n = int(torch.cumprod((drafts == posterior[:-1]).int(), 0).sum())
        new = drafts[:n].tolist() + [int(posterior[n])]
        if use_cache:
            cache.rewind(start, block[:, : n + 1], layer_ids)
        ctx_feats = feats[:, : n + 1]
        length = n + 1
        if eos_token_id is not None and eos_token_id in new:
            new = new[: new.index(eos_token_id) + 1]
            if counting == "deepspec" and len(new) <= n:  # eos among the accepted drafts: no bonus
                length = len(new)
        if counting == "sglang":  # what the step commits, cut at eos and at max_new_tokens
            length = min(len(new), max_new_tokens - len(result.tokens))
        seq.extend(new)
        result.tokens.extend(new)
        result.accept_lengths.append(length)
    result.tokens = result.tokens[:max_new_tokens]
    if eos_token_id in result.tokens:  # "published" can draft past an eos first token
        result.tokens = result.tokens[: result.tokens.index(eos_token_id) + 1]
    return result
