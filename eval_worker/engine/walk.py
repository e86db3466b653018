"""Walk-driven drafting: draft only the blocks the walks visit, and each only up to its first miss.

The all-anchor pass (`drafting.draft_anchors`) drafts a block at every response offset and
runs the LM head on all B-1 slots of each; the online walk then reads about n / τ of those
blocks, and of each only the slots up to its first mismatch. Here the walks drive the
drafting instead, all prompts of a group advancing together, one batched drafter pass per
step (a GPU still gets batched work):

  - each prompt's context keys/values are projected once per layer (a DFlash layer attends
    to `[k_proj(ctx) ; k_proj(block)]` of the same fused context, whatever the layer's input),
    then every step drafts one block per cursor against them (mask: context `kv < anchor`);
  - the greedy cursor moves s -> s + streak + 1 (the walk of `metrics.online_walk`, run to
    the end of the reference: a superset of what any counting rule reads), the tree cursor
    likewise with the tree's streak, and the fixed anchors are the stride blocks and the
    seeded sample that the all-anchor statistics come from; a block goes through the drafter
    layers once (a tree visit to a block the greedy cursor drafted reuses its kept slot hiddens);
  - every cursor walks as far as its blocks are drafted, then one round drafts what the waiting
    cursors need: when this drafter's steps are short, a cursor's next offsets too (`lookahead`:
    at τ ≈ 1, 16 blocks per cursor, all of them visited, so one pass and a few head calls serve
    many steps instead of each step reading every layer and the whole LM head for a few rows; at
    τ 1.5 two, from τ 1.7 none: the blocks no walk visits stay within a quarter of the visited ones).
    Only the visited blocks count as what the answer needs (`WalkBlocks.need`; the others:
    `WalkBlocks.lookahead`), and they change no number: a walk reads only the blocks it visits;
  - the LM head runs slot chunk by slot chunk, only on the rows whose block has matched so far,
    so it stops at the first miss: a block's first chunk as deep as this drafter's blocks needed
    on average so far, each next one doubling (at high τ a block costs one or two head calls);
    rows the tree visits get top-k as deep as their tree reads, rows of the sample all slots;
    each round of chunks is one head call over every row of the step (at most `HEAD_CALL_ROWS`),
    by the all-anchor pass's rule over vocabulary tiles (`drafting.head_topk`), so its rows are
    set by a tile's logits, not the vocabulary's; a head too large for any cache (read from memory
    by every call, `HEAD_STREAM_BYTES`) gets deeper slots per call rather than another call later;
  - memory is sized from the all-anchor pass's at the same context length (`all_anchor_peak`, a
    floor under it): a group's context keys take at most half (`group_kv_budget`), stacked once per
    layer as the group forms (`GroupKV`); a pass attends to views of them, each layer's block keys
    written right after the context (`model.join_kv`), so the context is never copied; passes and
    head calls are sized to what the keys leave (`Walker._pass_bytes`). So the walk's peak is no
    higher than that pass's (tests/unit/engine/test_walk_memory.py).

The walks themselves are then replayed by the same code as on the all-anchor drafts
(`scoring.score_blocks`), so every number is made by one piece of code either way.
"""
from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass, field
from typing import cast

import numpy as np
import torch

from dflash_train.core.masks import BlockLayout, dense_mask
from dflash_train.core.model import DFlashDrafter, DraftCache, DrafterLayer, mask_blocks
from dflash_train.core.target import logits_rows
from eval_worker.engine import metrics
from eval_worker.engine.drafting import DEFAULT_HEAD_ROWS, VOCAB_TILE, _CastEmbedding, anchors_per_pass, head_topk
from eval_worker.engine.scoring import walk_labels
from eval_worker.engine.tree import DraftTree, build_tree, tree_streak

# the context keys/values a group of prompts holds at once (the rest of the suite waits its turn), at most
WALK_KV_BUDGET = 64 * 1024 * 1024
# rows per head call at most: enough to spread the head's read, most of a small call's cost (at vocab 151,936
# a 16-row product takes what a 4-row one does; at hidden 1024 up to ~60 rows); a call's logits are one
# vocabulary tile at a time, so more rows cost a tile's row each (and what `Walker._draft` leaves them)
HEAD_CALL_ROWS = 256
# an LM head whose weight is larger than this is read from memory by every call (no cache holds it), which costs
# as much as the product of tens of rows (here at hidden 1024: 16 rows 125 ms, 32 rows 152 ms, 64 rows 206 ms; on
# a GPU's HBM at Qwen3-8B's head, ~100 rows): its rounds fill a call with deeper slots rather than make another
# call later (`Walker._fill`) ...
HEAD_STREAM_BYTES = 32 << 20
HEAD_FILL_ROWS = 48  # ... up to this many (row, slot) pairs (measured here: 32-75 alike, 16 slower)
# blocks per prompt a group's buffers have room for after the longest context (`GroupKV`): a walk step's
# (the greedy and the tree cursor's) join their context in place; a pass with more copies the context
ROOM_BLOCKS = 2
TREE_FIRST_DEPTHS = 2  # top-k depths a tree row starts with at least (doubling while its tree reads the last)
# lookahead: a cursor that needs a block also drafts the next offsets, up to this many blocks in all ...
LOOKAHEAD = 16
# ... as many as keep the blocks drafted per block its walk visits within 1 + LOOKAHEAD_EXTRA (`lookahead`)
LOOKAHEAD_EXTRA = 0.25

# `drafting="auto"`: the path a drafter shape starts with, by device. On a GPU the all-anchor pass is a few large
# batched passes while the walk is many small launch-bound rounds: at τ ≈ 1 on an H200 (Qwen3-8B shape) `all`
# drafted 4-6x faster than `walk`; on a CPU the walk, which drafts about n / τ blocks, is the cheaper one.
AUTO_FIRST = {"cuda": "all"}
# after both paths are timed, the dearer one is timed again every this many evaluations of the shape (τ moves
# during training and the walk's cost with it), so timing costs at most one slower evaluation in eight
AUTO_RETIME_EVERY = 8


def auto_path(device_type: str, costs: dict[str, float | None], runs: int) -> str:
    """The drafting path `auto` takes for the `runs`-th evaluation (0-based) of one drafter shape on one device,
    given each path's measured drafting seconds per response token so far (None: not measured)."""
    first = AUTO_FIRST.get(device_type, "walk")
    other = "walk" if first == "all" else "all"
    if costs.get(first) is None:
        return first
    if costs.get(other) is None:
        return other
    cheaper, dearer = sorted((first, other), key=lambda p: costs[p])  # type: ignore[arg-type, return-value]
    return dearer if runs % AUTO_RETIME_EVERY == 0 else cheaper


@dataclass
class WalkSeq:
    """One reference to walk: prompt + response ids, its target features, its labels."""

    ids: torch.Tensor  # [S]
    prompt_len: int
    num_tokens: int
    ext: np.ndarray  # response + lookahead (the labels)
    full: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # offsets drafted on every slot
    max_blocks: int | None = None  # steps of the tree walk and blocks of the stride walk
    greedy_steps: int | None = None  # steps of the greedy walk (None: to the end, for the validation replay)


@dataclass
class WalkBlocks:
    """What the walks read of one reference, per visited offset."""

    streak: dict[int, int] = field(default_factory=dict)  # top-1 streak
    argmax: dict[int, np.ndarray] = field(default_factory=dict)  # [B-1] for the `full` offsets
    tree_streaks: dict[int, int] = field(default_factory=dict)  # the tree walk's streak, where it drafted top-k
    blocks: int = 0  # blocks drafted (a block drafted twice counts twice), lookahead ones included
    head_slots: int = 0  # slot rows the LM head ran on
    need: dict[int, int] = field(default_factory=dict)  # per visited offset, the fewest head slots its readers need
    lookahead: int = 0  # blocks drafted ahead of a cursor that no walk visited (work the answer did not need)
    steps: list[int] = field(default_factory=lambda: [0, 0])  # steps of the greedy and the tree walk


@torch.no_grad()  # with autograd on, each prompt's keys would keep the graph's activations alive while it waits
def context_kv(drafter: DFlashDrafter, features: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the rotated context keys and values `[kv_heads, S, head_dim]` of `features [S, n*H]`
    (what `DFlashDrafter.forward` computes from the context, once for every anchor)."""
    ctx = drafter.hidden_norm(drafter.fc(features[None].to(drafter.fc.weight.dtype)))
    cos, sin = drafter.rotary_emb(ctx, torch.arange(features.shape[0], device=ctx.device)[None])
    return [tuple(t[0] for t in cast(DrafterLayer, layer).self_attn.key_value(ctx, cos, sin))
            for layer in drafter.layers]


def all_anchor_peak(drafter: DFlashDrafter, prompt_len: int, num_tokens: int, vocab: int,
                    tree_depths: int = 0) -> int:
    """A floor under the all-anchor pass's peak on one reference (`drafting.draft_anchors` at its
    `num_tokens` anchors, in chunks of `anchors_per_pass`), the larger of what it surely holds at once
    in its LM head and in a drafter layer's attention: a head call's tile of logits (`drafting.TiledHead`),
    twice for the call on the `tree_depths` top-k slots (the log-sum-exp's temporary); or, in its last
    full chunk, the projected context, that layer's context keys/values and their concatenation with
    the blocks', the blocks' residual stream, layer input, queries, keys and values, and one mask
    (its dense attention scores are not counted: the CPU kernel does not hold them)."""
    cfg = drafter.config
    B, tile, e = cfg.block_size, min(vocab, VOCAB_TILE), drafter.fc.weight.element_size()
    n = max(num_tokens, 1)
    chunk = min(n, anchors_per_pass(B, context_len=prompt_len + n, heads=cfg.num_attention_heads, dense=True))
    D = min(tree_depths, B - 1)
    rows = logits_rows(tile)  # a head call's rows at most (`head_topk`), half of them with top-k
    head = max(2 * min(chunk * D, rows // 2), min(chunk * (B - 1 - D), rows)) * tile * 4
    S, T = prompt_len + n // chunk * chunk, chunk * B
    H, q, kv = cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    layer = e * (S * H + 2 * kv * (2 * S + T) + T * (2 * H + q + 2 * kv)) + T * (S + T)
    return max(head, layer)


def group_kv_budget(drafter: DFlashDrafter, refs: list[tuple[int, int]], vocab: int, tree_depths: int = 0) -> int:
    """Bytes of context keys/values a group of prompts may hold while it walks (`group_bytes`): half of
    the largest `all_anchor_peak` over the references `(prompt_len, num_tokens)`; a walk pass and a head
    call take what the group's keys leave (`Walker._draft`, `Walker.run`), so the walk's peak stays
    within the all-anchor pass's."""
    peak = max((all_anchor_peak(drafter, P, n, vocab, tree_depths) for P, n in refs), default=0)
    return min(WALK_KV_BUDGET, peak // 2)


def kv_bytes(drafter: DFlashDrafter, length: int) -> int:
    """Bytes of one prompt's row in a group's buffers (`GroupKV`) when the group's longest context is `length`."""
    cfg = drafter.config
    return (2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * (length + ROOM_BLOCKS * cfg.block_size)
            * drafter.fc.weight.element_size())


def group_bytes(drafter: DFlashDrafter, lengths: list[int]) -> int:
    """Bytes of a group's `GroupKV`: one row per prompt, each as long as the longest context."""
    return len(lengths) * kv_bytes(drafter, max(lengths, default=1))


def walk_groups(drafter: DFlashDrafter, lengths: list[int], budget: int) -> list[list[int]]:
    """Prompt indices in order, cut into groups whose `group_bytes` fit `budget` (a prompt alone always fits)."""
    groups: list[list[int]] = [[]]
    for j, n in enumerate(lengths):
        if groups[-1] and group_bytes(drafter, [lengths[i] for i in groups[-1]] + [n]) > budget:
            groups.append([])
        groups[-1].append(j)
    return groups if groups[0] else []


class GroupKV:
    """A group's context keys and values, stacked once per layer as its prompts arrive: `keys[l]`, `values[l]`
    `[prompts, kv_heads, longest + ROOM_BLOCKS * B, head_dim]` (a row is zero past its own context: never
    attended). A pass over a run of rows attends to views of them, and each layer's block keys/values go
    right after the pass's context (`join`: the positions they cover are saved and put back), so the
    context is never copied: not stacked per pass, not concatenated with the blocks."""

    def __init__(self, drafter: DFlashDrafter, lengths: list[int]):
        cfg, w = drafter.config, drafter.fc.weight
        self.size = max(lengths, default=1) + ROOM_BLOCKS * cfg.block_size
        shape = (len(lengths), cfg.num_key_value_heads, self.size, cfg.head_dim)
        self.keys = [w.new_zeros(shape) for _ in drafter.layers]
        self.values = [w.new_zeros(shape) for _ in drafter.layers]

    @classmethod
    def of(cls, drafter: DFlashDrafter, kvs: list) -> GroupKV:
        """From per-prompt `context_kv` results."""
        group = cls(drafter, [kv[0][0].shape[1] for kv in kvs])
        for j, kv in enumerate(kvs):
            group.add(j, kv)
        return group

    def add(self, row: int, kv: list) -> None:
        """Store one prompt's `context_kv` in its row."""
        for layer, (k, v) in enumerate(kv):
            n = min(k.shape[1], self.size)
            self.keys[layer][row, :, :n] = k[:, :n]
            self.values[layer][row, :, :n] = v[:, :n]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.keys + self.values)


class _GroupCache(DraftCache):
    """A pass's view of a `GroupKV`: rows `first .. first + span - 1`, context positions `..length`."""

    def __init__(self, group: GroupKV, first: int, span: int, length: int):
        super().__init__(len(group.keys))
        self.group, self.rows, self.length_ = group, slice(first, first + span), length
        self.saved: list = []  # (keys view, values view, saved keys, saved values) to put back

    def context(self, layer: int):
        self.restore()  # the previous layer's attention is done with its block keys
        kv = _LayerKV((self.group.keys[layer][self.rows, :, :self.length_],
                       self.group.values[layer][self.rows, :, :self.length_]))
        kv.cache, kv.layer = self, layer
        return kv

    def restore(self) -> None:
        for k, v, sk, sv in self.saved:
            k.copy_(sk)
            v.copy_(sv)
        self.saved.clear()


class _LayerKV(tuple):
    """One layer's context (keys, values) views with `join` (`model.join_kv`)."""

    cache: _GroupCache
    layer: int

    def join(self, k_blk: torch.Tensor, v_blk: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c, L, Q = self.cache, self.cache.length_, k_blk.shape[2]
        if L + Q > c.group.size:  # no room after this context: copy it, as `torch.cat` would
            return torch.cat([self[0], k_blk], dim=2), torch.cat([self[1], v_blk], dim=2)
        k = c.group.keys[self.layer][c.rows, :, :L + Q]
        v = c.group.values[self.layer][c.rows, :, :L + Q]
        c.saved.append((k[:, :, L:], v[:, :, L:], k[:, :, L:].clone(), v[:, :, L:].clone()))
        k[:, :, L:] = k_blk
        v[:, :, L:] = v_blk
        return k, v


class Walker:
    """Walk-driven drafting for one drafter over a group of references."""

    def __init__(self, drafter: DFlashDrafter, embed, head, *, topk: int = 0, tree_budget: int = 0,
                 tree_spine: bool = False, head_rows: int | None = DEFAULT_HEAD_ROWS):
        self.drafter, self.head = drafter, head
        self.emb = _CastEmbedding(embed, drafter.fc.weight.dtype)
        self.B = drafter.config.block_size
        self.topk, self.D = topk, (min(tree_budget, self.B - 1) if topk else 0)  # top-k depths at most
        self.budget, self.spine = tree_budget, tree_spine
        self.tile = min(head.weight.shape[0], VOCAB_TILE)  # a head call's logits: one tile at a time (`TiledHead`)
        # rows per head call, top-k rows and argmax rows alike: half the logits budget (a top-k row's
        # log-softmax takes a second temporary), so a call's peak is the all-anchor pass's top-k chunk's
        self.head_rows = head_rows or max(1, logits_rows(self.tile) // 2)
        self.dev = next(drafter.parameters()).device
        self.call_rows = self.head_rows
        self.streamed = head.weight.numel() * head.weight.element_size() >= HEAD_STREAM_BYTES
        # what this drafter's blocks needed so far (sum, count): head slots up to the first miss, and
        # the top-k depths its trees read. A block's first head round covers the mean, so at high τ
        # a block costs one or two head calls instead of one per growing chunk
        self.seen_need, self.seen_read = [0, 0], [0, 0]
        # and the walks' steps (streak + 1, the greedy one's and the tree's): their lookahead
        self.seen_step, self.seen_tree = [0, 0], [0, 0]

    @torch.no_grad()
    def run(self, seqs: list[WalkSeq], kvs: list | GroupKV) -> list[WalkBlocks]:  # noqa: C901 - the loop in one sitting
        """`kvs`: the group's `GroupKV` (row i: seqs[i]'s context, stored as each prompt's features arrive),
        or `context_kv` of each seq's features."""
        kvs = kvs if isinstance(kvs, GroupKV) else GroupKV.of(self.drafter, kvs)
        out = [WalkBlocks() for _ in seqs]
        tree_on = self.topk > 0 and self.D > 0
        # head rows per call: half the all-anchor pass's logits rows (a top-k row's log-softmax doubles its)
        S = max((s.prompt_len + s.num_tokens for s in seqs), default=1)
        cap = anchors_per_pass(self.B, context_len=S, heads=self.drafter.config.num_attention_heads, dense=True)
        self.call_rows = min(HEAD_CALL_ROWS, max(1, min(self.head_rows, cap * (self.B - 1)) // 2))
        # what a pass or a head call may hold besides the group's keys: the rest of the all-anchor pass's peak
        V = self.head.weight.shape[0]
        peak = max((all_anchor_peak(self.drafter, s.prompt_len, s.num_tokens, V, self.D) for s in seqs), default=0)
        self.pass_budget = peak - kvs.nbytes()
        # per call row: its logits (a top-k row's log-softmax takes a second temporary) and, in a head
        # round over several passes (`_draft`), one more block's slot hiddens, and their kept copies
        # (held into the next round); besides one pass's own slots. Set per round: `_draft`
        slot_bytes = (self.B - 1) * self.drafter.config.hidden_size * self.drafter.fc.weight.element_size()
        logits = self.tile * 4 * (2 if tree_on else 1)  # a call row's tile of logits, and the top-k temporary
        self.row_bytes, self.pass_slots = logits + 2 * slot_bytes, cap * slot_bytes
        # what one (row, slot) pair of a head call holds: its logits and its gathered slot hidden (`_call`);
        # the blocks' slot hiddens are counted per block (`_draft`)
        self.pair_bytes = logits + slot_bytes // (self.B - 1)
        self.most_call_rows = self.call_rows
        # fixed anchors first: the stride blocks (streak, tree) and the sample (every slot); with a tree
        # all of them get its top-k too, so a tree visit to one of them drafts nothing
        fixed = []
        for i, s in enumerate(seqs):
            stride = list(range(0, max(s.num_tokens - 1, 0), self.B))
            stride = stride if tree_on else stride[: s.max_blocks]  # the tree's stride streaks are all counted
            full = set(int(x) for x in s.full)
            for off in sorted(set(stride) | full):
                fixed.append((i, off, tree_on, off in full))
        kept: dict[tuple[int, int], tuple] = {}
        reads: dict[tuple[int, int], list[int]] = {}  # per drafted block: head slots a greedy, a tree visit needs
        self._draft(seqs, kvs, out, fixed, kept, [None] * len(seqs), reads)
        for i, off, with_tree, f in fixed:  # every fixed block is read
            out[i].need[off] = self.B - 1 if f else reads[(i, off)][1 if with_tree else 0]
        # then the walks, all prompts together: every cursor walks as far as its blocks are drafted, then
        # one round drafts the block each waiting cursor needs (one pass where they fit), and the next
        # ones when this drafter's steps are short (`lookahead`: at τ ≈ 1 one pass serves many steps).
        # The greedy cursor is usually the faster one: the slot hiddens of its blocks ahead of the tree
        # cursor are kept (`kept`), so a tree visit there runs the head's top-k only; it waits while a
        # block ahead of the tree cursor, which bounds what is kept to about one block's span (and its
        # lookahead) per prompt
        greedy: list[int | None] = [0 if s.num_tokens > 0 else None for s in seqs]
        tree: list[int | None] = [0 if tree_on and s.num_tokens > 0 else None for s in seqs]
        while True:
            for i, s in enumerate(seqs):
                greedy[i] = self._walk(out[i], greedy[i], out[i].streak, reads, i, 0, s.num_tokens, s.greedy_steps)
                tree[i] = self._walk(out[i], tree[i], out[i].tree_streaks, reads, i, 1, s.num_tokens, s.max_blocks)
            for key in [k for k in kept if (at := tree[k[0]]) is None or k[1] < at]:  # behind the tree cursor
                del kept[key]
            k_greedy, k_tree = lookahead(_mean(self.seen_step)), lookahead(_mean(self.seen_tree))
            need: dict[tuple[int, int], bool] = {}  # (prompt, offset) -> with the tree's top-k
            for i, s in enumerate(seqs):
                g, t, o = greedy[i], tree[i], out[i]
                # a walk with r steps left visits at most r more blocks, and at τ ≈ 1 exactly the next r
                k_g = k_greedy if s.greedy_steps is None else min(k_greedy, s.greedy_steps - o.steps[0])
                k_t = k_tree if s.max_blocks is None else min(k_tree, s.max_blocks - o.steps[1])
                if t is not None:
                    for off in range(t, min(t + max(k_t, 1), s.num_tokens)):
                        if off not in o.tree_streaks:
                            need[(i, off)] = True
                if g is not None and (t is None or g <= t + self.B):
                    for off in range(g, min(g + max(k_g, 1), s.num_tokens)):
                        if off not in out[i].streak:
                            need.setdefault((i, off), False)
            if not need:  # every cursor is done
                break
            self._draft(seqs, kvs, out, [(i, off, top, False) for (i, off), top in need.items()], kept, tree, reads)
        drafted = Counter(i for i, _ in reads)
        for i, o in enumerate(out):
            o.lookahead = drafted[i] - len(o.need)
        return out

    def _walk(self, o: WalkBlocks, at: int | None, streaks: dict[int, int], reads: dict, i: int, which: int,
              n: int, steps: int | None) -> int | None:
        """Move a cursor (greedy: which 0, tree: 1) as far as its blocks are drafted, noting what each
        visit reads in `o.need`. Returns where it waits (None: done, at the end or after `steps` steps,
        counted in `o.steps`)."""
        while at is not None and at in streaks:
            o.need[at] = max(o.need.get(at, 0), reads[(i, at)][which])
            o.steps[which] += 1
            at += streaks[at] + 1
            if at >= n or (steps is not None and o.steps[which] >= steps):
                return None
        return at

    def _draft(self, seqs, kvs, out, rows: list[tuple[int, int, bool, bool]], kept: dict, tree_at: list,
               reads: dict) -> None:
        """Draft (prompt, offset, with tree top-k, every slot) rows, and note in `reads[(prompt, offset)]`
        the head slots a greedy and a tree visit to each would need: the ones whose slot hiddens are kept
        run the head only; the others go through the drafter in passes of at most the all-anchor pass's
        blocks and half its dense scores (prompts x blocks per prompt, padding included, over the longest
        context; `anchors_per_pass`), each holding (`_pass_bytes`) no more than the group's keys, the
        kept slot hiddens and one head round's slot hiddens leave of the all-anchor pass's peak
        (`all_anchor_peak`)."""
        heads_only = [row for row in rows if (row[0], row[1]) in kept]
        drafted = [row for row in rows if (row[0], row[1]) not in kept]
        B = self.B
        passes: list[list[tuple[int, int, bool, bool]]] = [[]]
        counts: dict[int, int] = {}  # blocks per prompt in the pass being filled
        limit = (0, 0, 0)  # its (blocks, score elements, longest context): the all-anchor pass's, half its scores
        # the head runs on several passes' rows at once (a head call reads the whole head, most of its
        # cost at a large vocabulary and a few rows: lookahead makes many small passes): as many as one
        # head call takes, their slot hiddens at most one call's logits (and held while the next passes run)
        slot_bytes = (B - 1) * self.drafter.config.hidden_size * self.drafter.fc.weight.element_size()
        free = self.pass_budget - sum(t.numel() * t.element_size() for t, _, _ in kept.values())
        self.call_rows = max(1, min(self.most_call_rows, (free - self.pass_slots) // self.row_bytes))
        merge = max(1, min(self.call_rows, self.call_rows * self.tile * 4 // slot_bytes))  # logits: a tile per row
        room = free - min(merge, len(drafted)) * slot_bytes  # a head round holds at most the round's rows
        # a head call's pairs: what the round's slot hiddens (and their concatenation) leave, no fewer than the
        # call rows above (which reserved a block's slots per pair)
        self.call_rows = max(self.call_rows, min(self.most_call_rows, (
            free - self.pass_slots - 2 * min(merge, len(drafted)) * slot_bytes) // self.pair_bytes))
        top = 0  # the last anchor of the pass being filled
        for row in sorted(drafted, key=lambda r: r[:2]):
            S = seqs[row[0]].prompt_len + seqs[row[0]].num_tokens
            c = anchors_per_pass(B, context_len=S, heads=self.drafter.config.num_attention_heads, dense=True)
            mine = (c, c * B * (S + c * B) // 2, S)
            trial = {**counts, row[0]: counts.get(row[0], 0) + 1}
            both = (min(limit[0], c), min(limit[1], mine[1]), max(limit[2], S)) if passes[-1] else mine
            # a pass's batch rows are the run of the group's rows from its first prompt to its last
            p, n = max(trial) - min(trial) + 1, max(trial.values())
            L = max(top, seqs[row[0]].prompt_len + row[1])  # the pass's context: its last anchor
            if passes[-1] and (p * n > both[0] or p * n * B * (both[2] + n * B) > both[1]
                               or self._pass_bytes(p, n, L, kvs.size) > room):
                passes.append([])
                counts, limit, top = {row[0]: 1}, mine, seqs[row[0]].prompt_len + row[1]
            else:
                counts, limit, top = trial, both, L
            passes[-1].append(row)
        groups: list[list] = [[]]
        for chunk in passes:
            if groups[-1] and sum(map(len, groups[-1])) + len(chunk) > merge:
                groups.append([])
            groups[-1].append(chunk)
        for n, group in enumerate(groups):
            extra = heads_only if n == 0 else []
            chunk = [row for c in group for row in c]
            if not chunk and not extra:
                continue
            parts = [self._blocks(seqs, kvs, [(i, off) for i, off, _, _ in c]) for c in group if c]
            parts += [kept[(i, off)][0][None] for i, off, _, _ in extra]
            slots = torch.cat(parts) if len(parts) > 1 else parts[0]
            del parts
            rows_n = chunk + extra
            labels = np.stack([walk_labels(seqs[i].ext, off, self.B) for i, off, _, _ in rows_n])
            tree = np.array([t for _, _, t, _ in rows_n], dtype=bool)
            full = np.array([f or (t and self.spine) for _, _, t, f in rows_n], dtype=bool)
            arg = np.full((len(rows_n), self.B - 1), -1, dtype=np.int64)
            done = np.zeros(len(rows_n), dtype=np.int64)
            for r, (i, off, _, _) in enumerate(extra, start=len(chunk)):
                arg[r], done[r] = kept.pop((i, off))[1:]
            before = done.copy()
            trees, computed = self._head(slots, labels, tree, full, arg, done)
            streak = _streaks(arg, labels)
            for r, (i, off, t, f) in enumerate(rows_n):
                o = out[i]
                o.blocks += r < len(chunk)
                o.head_slots += int(computed[r] - before[r])
                if off not in o.streak:
                    o.streak[off] = int(streak[r])
                    self.seen_step[0] += o.streak[off] + 1
                    self.seen_step[1] += 1
                seen = reads.setdefault((i, off), [0, 0])
                seen[0] = max(seen[0], min(int(streak[r]) + 1, self.B - 1))
                if f:
                    o.argmax.setdefault(off, arg[r].copy())
                if t:
                    seen[1] = max(seen[1], self.B - 1 if full[r] else max(trees[r].read_depth, seen[0]))
                    if off not in o.tree_streaks:
                        o.tree_streaks[off] = tree_streak(trees[r], labels[r])
                        self.seen_tree[0] += o.tree_streaks[off] + 1
                        self.seen_tree[1] += 1
                elif tree_at[i] is not None and off > tree_at[i] and r < len(chunk):
                    kept[(i, off)] = (slots[r].clone(), arg[r].copy(), int(computed[r]))  # the tree may come here
            del slots  # before the next round's passes, which hold their own (`room`)

    def _pass_bytes(self, span: int, n: int, L: int, size: int) -> int:
        """What a drafter pass of `span` batch rows x `n` blocks at context `L` holds besides the group's
        keys, at most: its activations (at a layer's attention or its MLP, whichever holds more per
        block token), its masks (and `_attend`'s widened copy), and the join's (`GroupKV`) saved block
        positions, or the context copied where the buffers have no room after it."""
        cfg, e, B = self.drafter.config, self.drafter.fc.weight.element_size(), self.B
        T, H, q, kv = span * n * B, cfg.hidden_size, cfg.num_attention_heads * cfg.head_dim, \
            cfg.num_key_value_heads * cfg.head_dim
        act = e * T * max(8 * H + 3 * q + 4 * kv, 4 * H + 3 * cfg.intermediate_size)
        masks = (len(set(cfg.attention())) + 1) * T * (L + n * B)
        join = 2 * e * T * kv if L + n * B <= size else 2 * e * span * kv * (L + n * B)
        return act + masks + join

    @torch.no_grad()  # block keys are written into the group's buffers
    def _blocks(self, seqs, kvs: GroupKV, rows: list[tuple[int, int]]) -> torch.Tensor:
        """Final hiddens of slots 1..B-1 `[rows, B-1, H]`, one block per (prompt, offset): one
        batch row per prompt of the run from the first prompt to the last (a prompt in between
        with no block is a row of padding blocks), its blocks in the multi-block layout
        (`masks.BlockLayout`) over views of the group's context keys (`GroupKV`), so a prompt's
        context is held once however many blocks it drafts."""
        B, dev, drafter = self.B, self.dev, self.drafter
        lo = min(i for i, _ in rows)
        prompts = list(range(lo, max(i for i, _ in rows) + 1))
        batch_row = {i: b for b, i in enumerate(prompts)}
        count = [0] * len(prompts)
        where = []  # per row: (batch row, block)
        for i, _ in rows:
            b = batch_row[i]
            where.append((b, count[b]))
            count[b] += 1
        N = max(count)
        anchors = torch.zeros(len(prompts), N, dtype=torch.long)
        valid = torch.zeros(len(prompts), N, dtype=torch.bool)
        first = torch.zeros(len(prompts), N, dtype=torch.long)
        for r, (i, off) in enumerate(rows):
            a = seqs[i].prompt_len + off
            anchors[where[r]], valid[where[r]], first[where[r]] = a, True, seqs[i].ids[a]
        anchors, valid = anchors.to(dev), valid.to(dev)
        L = max(seqs[i].prompt_len + off for i, off in rows)  # context keys beyond the last anchor are never visible
        cache = _GroupCache(kvs, lo, len(prompts), L)
        block = mask_blocks(first.to(dev), B, drafter.config.mask_token_id).reshape(len(prompts), N * B)
        layout = BlockLayout(anchors=anchors, valid=valid, context_len=L, block_size=B)
        built = {}
        for spec in drafter.config.attention():
            if spec not in built:
                built[spec] = dense_mask(dataclasses.replace(layout, window=spec[0], causal=spec[1]))
        masks = [built[spec] for spec in drafter.config.attention()]
        try:
            hidden = drafter(self.emb(block), layout.block_positions(), None, None, mask=masks, cache=cache)
        finally:
            cache.restore()  # the last layer's block positions: the context's again
        hidden = hidden.view(len(prompts), N, B, -1)[:, :, 1:]
        b_idx = torch.tensor([b for b, _ in where], device=dev)
        j_idx = torch.tensor([j for _, j in where], device=dev)
        return hidden[b_idx, j_idx]

    def _head(self, slots: torch.Tensor, labels: np.ndarray, tree: np.ndarray, full: np.ndarray,
              arg: np.ndarray, done: np.ndarray):
        """Fill `arg` (argmax per slot, -1: not computed; `done`: its computed prefix per row, both
        updated in place) as deep as each row's readers need, and for `tree` rows build the draft
        tree. Each round is one head call over every row that still needs slots: the argmax up to
        the first miss (every slot for `full` rows), a row's first chunk as deep as this drafter's
        blocks needed on average so far, each next one doubling what it has; and the tree rows'
        top-k as deep as their tree reads: a best-first tree built on the first k depths is the tree
        of all D depths unless it popped a node at depth k (`DraftTree.read_depth == k`); those rows
        get the next depths (k doubling), the first k again the mean so far. A spine tree (its chain
        is the whole argmax) is built last, on all D depths. Returns ({row: DraftTree}, slots
        computed per row)."""
        R, W, _ = slots.shape
        ids = np.zeros((R, self.D, self.topk), dtype=np.int64)
        logp = np.zeros((R, self.D, self.topk), dtype=np.float32)
        tk_done = np.zeros(R, dtype=np.int64)
        first = -(-self.seen_need[0] // self.seen_need[1]) if self.seen_need[1] else 1
        depths = -(-self.seen_read[0] // self.seen_read[1]) if self.seen_read[1] else TREE_FIRST_DEPTHS
        tk_want = np.where(tree, self.D if self.spine else min(max(TREE_FIRST_DEPTHS, depths), self.D), 0)
        trees: dict[int, DraftTree] = {}
        while True:
            streak = _streaks(arg, labels)
            want_arg = (done < W) & (full | (streak >= done))
            want_tk = tk_done < tk_want
            rows = np.flatnonzero(want_arg | want_tk)
            if not rows.size:
                break
            a_hi = np.where(want_arg, np.where(full, W, np.minimum(np.maximum(first, 2 * done), W)), done)
            t_hi = np.where(want_tk, tk_want, tk_done)
            if self.streamed:
                a_hi, t_hi = self._fill(rows, want_arg, want_tk, done, tk_done, a_hi, t_hi, W)
            # (row, slot) pairs: the top-k ones first, then argmax only
            lo = np.maximum(done, t_hi)
            tk_r, tk_s = _pairs(rows, tk_done[rows], t_hi[rows])
            ar_r, ar_s = _pairs(rows, lo[rows], np.maximum(a_hi, lo)[rows])
            pr, ps = np.concatenate([tk_r, ar_r]), np.concatenate([tk_s, ar_s])
            a, tids, tlogp = self._call(slots, pr, ps, len(tk_r))
            if len(tk_r):
                K = tids.shape[1]
                ids[tk_r, tk_s, :K], logp[tk_r, tk_s, :K] = tids, tlogp
            arg[pr, ps] = a
            done[rows] = np.maximum(done, np.maximum(a_hi, t_hi))[rows]
            grown = np.flatnonzero(want_tk)
            tk_done[grown] = t_hi[grown]
            if not self.spine:
                for r in grown.tolist():
                    hi = int(tk_done[r])
                    trees[r] = build_tree(logp[r, :hi], ids[r, :hi], self.budget)
                    if trees[r].read_depth == hi and hi < self.D:
                        tk_want[r] = min(2 * hi, self.D)
        if self.spine:  # the top-1 chain is part of the tree: built once the whole argmax is known
            trees = {r: build_tree(logp[r], ids[r], self.budget, spine=True, spine_ids=arg[r])
                     for r in np.flatnonzero(tree).tolist()}
        need = np.minimum(_streaks(arg, labels) + 1, W)[~full]
        self.seen_need[0] += int(need.sum())
        self.seen_need[1] += len(need)
        for t in trees.values() if not self.spine else ():
            self.seen_read[0] += t.read_depth
            self.seen_read[1] += 1
        return trees, done

    def _fill(self, rows, want_arg, want_tk, done, tk_done, a_hi, t_hi, W: int):
        """A streamed head's round (`HEAD_STREAM_BYTES`): a call costs the read of the head's weight up to
        about one call's rows, so the round's rows get deeper slots (argmax and top-k alike, the same depth
        for every row that still wants them) as far as one call's rows hold, instead of a later call each."""
        def pairs(a, t):
            lo = np.maximum(done, t)
            return int((t - tk_done)[rows].sum() + (np.maximum(a, lo) - lo)[rows].sum())

        fill = min(self.call_rows, HEAD_FILL_ROWS)
        if pairs(a_hi, t_hi) >= fill:
            return a_hi, t_hi
        for d in range(W, 0, -1):
            a2 = np.where(want_arg, np.maximum(a_hi, d), a_hi)
            t2 = np.where(want_tk, np.maximum(t_hi, min(d, self.D)), t_hi)
            if pairs(a2, t2) <= fill:
                return a2, t2
        return a_hi, t_hi

    def _call(self, slots: torch.Tensor, rows: np.ndarray, cols: np.ndarray, k: int):
        """One head call on the (row, slot) pairs, `call_rows` at a time: argmax of each, and the
        top-k log-probs of the first k (`drafting.head_topk`, the all-anchor pass's rule). Returns
        (argmax [M], top-k ids [k, K], log-probs [k, K])."""
        hidden = slots[torch.as_tensor(rows), torch.as_tensor(cols)]
        arg, ids, logp = head_topk(self.head, hidden, self.topk, self.call_rows, topk_rows=k)
        if ids is None:
            return arg.numpy(), np.zeros((0, 0), dtype=np.int64), np.zeros((0, 0), dtype=np.float32)
        return arg.numpy(), ids.numpy(), logp.numpy()


def lookahead(tau: float | None, limit: int = LOOKAHEAD, extra: float = LOOKAHEAD_EXTRA) -> int:
    """Blocks a waiting cursor drafts (its own and the next offsets') when its walk's steps have
    averaged `tau` offsets (None: nothing measured yet, one). A walk visits about one offset in τ,
    so K blocks from a visited one hold about 1 + (K-1)/τ visited ones: K is the largest (at most
    `limit`) whose blocks per visited block, K / (1 + (K-1)/τ), stay within 1 + `extra`: `limit`
    while τ <= 1 + extra, then 7 at τ 1.3, 3 at τ 1.4, 2 at τ 1.5, 1 from τ 1.7 (one block per step).
    The blocks no walk visits cost their drafting only: the walks' answers never read them. `extra`
    is small because a wasted block costs its FLOPs in full where the drafter is large (Qwen3-8B's
    on a CPU), while the passes it saves are worth most at τ ≈ 1 (one pass per token otherwise)."""
    if tau is None:
        return 1
    if tau <= 1 + extra:
        return limit
    return max(1, min(limit, int((1 + extra) * (tau - 1) / (tau - 1 - extra))))


def _mean(seen: list[int]) -> float | None:
    return seen[0] / seen[1] if seen[1] else None


def _pairs(rows: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(row, slot) for slots lo..hi-1 of each row, flat."""
    n = np.maximum(hi - lo, 0)
    r = np.repeat(rows, n)
    start = np.repeat(lo - np.cumsum(n) + n, n)  # each pair's slot: its index in the flat list, shifted
    return r, (np.arange(int(n.sum())) + start).astype(np.int64)


def _streaks(arg: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Leading slots whose draft equals the label (as `metrics.matches`: -1 labels never match)."""
    return metrics.leading_true((arg == labels) & (labels >= 0))
