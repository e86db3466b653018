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
    seeded sample that the all-anchor statistics come from;
  - the LM head runs slot chunk by slot chunk (1, 2, 3, 4, 6, 8, 11, ... slots), only on the
    rows whose block has matched so far, so it stops at the first miss; rows the tree visits
    get top-k as deep as a tree of that budget can reach, rows of the sample all slots.

The walks themselves are then replayed by the same code as on the all-anchor drafts
(`scoring.score_blocks`), so every number is made by one piece of code either way.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np
import torch

from dflash_train.core.masks import BlockLayout, dense_mask
from dflash_train.core.model import DFlashDrafter, DraftCache, mask_blocks
from dflash_train.core.target import logits_rows
from eval_worker.engine import metrics
from eval_worker.engine.drafting import DEFAULT_HEAD_ROWS, _CastEmbedding, anchors_per_pass, head_topk
from eval_worker.engine.scoring import walk_labels
from eval_worker.engine.tree import DraftTree, build_tree, tree_streak

# the context keys/values a group of prompts holds at once (the rest of the suite waits its turn)
WALK_KV_BUDGET = 64 * 1024 * 1024
SLOT_BOUNDS = (1, 2, 3, 4, 6, 8, 11, 16, 23, 32, 45, 64, 91, 128)  # early-exit chunks grow ~1.4x
TREE_FIRST_DEPTHS = 2  # top-k depths a tree row starts with (doubling while its tree reads the last)


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
    blocks: int = 0  # blocks drafted (a block drafted twice counts twice)
    head_slots: int = 0  # slot rows the LM head ran on
    need: dict[int, int] = field(default_factory=dict)  # per visited offset, the fewest head slots its readers need


def context_kv(drafter: DFlashDrafter, features: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer, the rotated context keys and values `[kv_heads, S, head_dim]` of `features [S, n*H]`
    (what `DFlashDrafter.forward` computes from the context, once for every anchor)."""
    ctx = drafter.hidden_norm(drafter.fc(features[None].to(drafter.fc.weight.dtype)))
    cos, sin = drafter.rotary_emb(ctx, torch.arange(features.shape[0], device=ctx.device)[None])
    return [tuple(t[0] for t in layer.self_attn.key_value(ctx, cos, sin)) for layer in drafter.layers]


def kv_bytes(drafter: DFlashDrafter, length: int) -> int:
    cfg = drafter.config
    return (2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * length
            * drafter.fc.weight.element_size())


class Walker:
    """Walk-driven drafting for one drafter over a group of references."""

    def __init__(self, drafter: DFlashDrafter, embed, head, *, topk: int = 0, tree_budget: int = 0,
                 tree_spine: bool = False, head_rows: int | None = DEFAULT_HEAD_ROWS):
        self.drafter, self.head = drafter, head
        self.emb = _CastEmbedding(embed, drafter.fc.weight.dtype)
        self.B = drafter.config.block_size
        self.topk, self.D = topk, (min(tree_budget, self.B - 1) if topk else 0)  # top-k depths at most
        self.budget, self.spine = tree_budget, tree_spine
        # the argmax chunks get the top-k chunks' rows (half the logits budget): the walk's peak stays at or
        # below the all-anchor pass's with a tree (measured: 113 MB -> see bench/README.md at vocab 151,936)
        self.head_rows = head_rows or max(1, logits_rows(head.weight.shape[0]) // 2)
        self.dev = next(drafter.parameters()).device

    @torch.no_grad()
    def run(self, seqs: list[WalkSeq], kvs: list) -> list[WalkBlocks]:
        """`kvs[i]`: `context_kv` of seqs[i]'s features (computed as each prompt's features arrive)."""
        out = [WalkBlocks() for _ in seqs]
        tree_on = self.topk > 0 and self.D > 0
        # fixed anchors first: the stride blocks (streak, tree) and the sample (every slot)
        fixed = []
        for i, s in enumerate(seqs):
            stride = list(range(0, max(s.num_tokens - 1, 0), self.B))
            stride = stride if tree_on else stride[: s.max_blocks]  # the tree's stride streaks are all counted
            full = set(int(x) for x in s.full)
            for off in sorted(set(stride) | full):
                fixed.append((i, off, tree_on and off in stride, off in full))
        self._draft(seqs, kvs, out, fixed)
        # then the walks, every prompt one step per pass
        greedy = [0 if s.num_tokens > 0 else None for s in seqs]
        tree = [0 if tree_on and s.num_tokens > 0 else None for s in seqs]
        g_steps, t_steps = [0] * len(seqs), [0] * len(seqs)
        while True:
            need: dict[tuple[int, int], list[bool]] = {}
            for i in range(len(seqs)):
                for cur, is_tree in ((greedy[i], False), (tree[i], True)):
                    if cur is None:
                        continue
                    known = cur in out[i].tree_streaks if is_tree else cur in out[i].streak
                    if not known:
                        want = need.setdefault((i, cur), [False, False])
                        want[0] = want[0] or is_tree
            if not need:
                # advance every cursor whose block is known; stop when none moves
                moved = False
                for i, s in enumerate(seqs):
                    if greedy[i] is not None:
                        greedy[i], g_steps[i] = greedy[i] + out[i].streak[greedy[i]] + 1, g_steps[i] + 1
                        if greedy[i] >= s.num_tokens or (s.greedy_steps is not None and g_steps[i] >= s.greedy_steps):
                            greedy[i] = None
                        moved = True
                    if tree[i] is not None:
                        t = out[i].tree_streaks[tree[i]]
                        tree[i], t_steps[i] = tree[i] + t + 1, t_steps[i] + 1
                        if tree[i] >= s.num_tokens or (s.max_blocks is not None and t_steps[i] >= s.max_blocks):
                            tree[i] = None
                        moved = True
                if not moved:
                    break
                continue
            self._draft(seqs, kvs, out, [(i, off, want[0], False) for (i, off), want in need.items()])
        return out

    def _draft(self, seqs, kvs, out, rows: list[tuple[int, int, bool, bool]]) -> None:
        """Draft (prompt, offset, with tree top-k, every slot) rows, in passes of at most
        `anchors_per_pass` blocks per prompt (the all-anchor pass's dense-mask sizing)."""
        passes: list[list] = []
        seen: dict[int, int] = {}
        for row in rows:
            i = row[0]
            cap = anchors_per_pass(self.B, context_len=seqs[i].prompt_len + seqs[i].num_tokens,
                                   heads=self.drafter.config.num_attention_heads, dense=True)
            k = seen.get(i, 0) // cap
            seen[i] = seen.get(i, 0) + 1
            passes += [[] for _ in range(k + 1 - len(passes))]
            passes[k].append(row)
        for chunk in passes:
            slots = self._blocks(seqs, kvs, [(i, off) for i, off, _, _ in chunk])
            labels = np.stack([walk_labels(seqs[i].ext, off, self.B) for i, off, _, _ in chunk])
            tree = np.array([t for _, _, t, _ in chunk], dtype=bool)
            full = np.array([f or (t and self.spine) for _, _, t, f in chunk], dtype=bool)
            arg, trees, computed = self._head(slots, labels, tree, full)
            streak = _streaks(arg, labels)
            for r, (i, off, t, f) in enumerate(chunk):
                o = out[i]
                o.blocks += 1
                o.head_slots += int(computed[r])
                o.streak.setdefault(off, int(streak[r]))
                least = self.B - 1 if full[r] else max(trees[r].read_depth if t else 0,
                                                       min(int(streak[r]) + 1, self.B - 1))
                o.need[off] = max(o.need.get(off, 0), least)
                if f:
                    o.argmax.setdefault(off, arg[r].copy())
                if t:
                    o.tree_streaks.setdefault(off, tree_streak(trees[r], labels[r]))

    def _blocks(self, seqs, kvs, rows: list[tuple[int, int]]) -> torch.Tensor:
        """Final hiddens of slots 1..B-1 `[rows, B-1, H]`, one block per (prompt, offset): one
        batch row per prompt, its blocks in the multi-block layout (`masks.BlockLayout`) over
        its cached context keys, so a prompt's context is held once however many blocks it drafts."""
        B, dev, drafter = self.B, self.dev, self.drafter
        prompts = list(dict.fromkeys(i for i, _ in rows))
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
        for r, (i, off) in enumerate(rows):
            anchors[where[r]], valid[where[r]] = seqs[i].prompt_len + off, True
        anchors, valid = anchors.to(dev), valid.to(dev)
        L = int(anchors.max())  # context keys beyond the last anchor are never visible
        cache = DraftCache(len(drafter.layers))
        for layer in range(len(drafter.layers)):
            for which, store in ((0, cache.keys), (1, cache.values)):
                store[layer] = torch.stack([_fit(kvs[i][layer][which], L) for i in prompts])
        first = torch.stack([torch.stack([seqs[i].ids[a] for a in anchors[b].tolist()]) for b, i in enumerate(prompts)])
        block = mask_blocks(first.to(dev), B, drafter.config.mask_token_id).reshape(len(prompts), N * B)
        layout = BlockLayout(anchors=anchors, valid=valid, context_len=L, block_size=B)
        built = {}
        for spec in drafter.config.attention():
            if spec not in built:
                built[spec] = dense_mask(dataclasses.replace(layout, window=spec[0], causal=spec[1]))
        masks = [built[spec] for spec in drafter.config.attention()]
        hidden = drafter(self.emb(block), layout.block_positions(), None, None, mask=masks, cache=cache)
        hidden = hidden.view(len(prompts), N, B, -1)
        return torch.stack([hidden[b, j, 1:] for b, j in where])

    def _head(self, slots: torch.Tensor, labels: np.ndarray, tree: np.ndarray, full: np.ndarray):
        """Argmax per slot (-1: not computed) and, for `tree` rows, the draft tree; each row's head
        runs only as deep as its readers need. Returns (argmax, {row: DraftTree}, slots computed)."""
        R, W, H = slots.shape
        arg = np.full((R, W), -1, dtype=np.int64)
        done = np.zeros(R, dtype=np.int64)  # slots computed per row (a prefix)
        trees, ids, logp = self._topk(slots, np.flatnonzero(tree), arg, done)
        for lo in sorted(set(done[full].tolist())):  # every slot of the sample's rows (and spine trees')
            rows = np.flatnonzero(full & (done == lo))
            if lo < W:
                arg[rows, lo:] = self._argmax(slots, rows, lo, W)
            done[rows] = W
        if self.spine:  # the top-1 chain is part of the tree: built once the whole argmax is known
            trees = {r: build_tree(logp[r], ids[r], self.budget, spine=True, spine_ids=arg[r])
                     for r in np.flatnonzero(tree).tolist()}
        bounds = sorted({0, W, *(b for b in SLOT_BOUNDS if b < W), *set(done.tolist())})
        for lo, hi in zip(bounds, bounds[1:], strict=False):  # the rest: slot chunks up to each block's first miss
            rows = np.flatnonzero((done == lo) & (_streaks(arg, labels) >= lo))
            if rows.size:
                arg[rows, lo:hi] = self._argmax(slots, rows, lo, hi)
                done[rows] = hi
        return arg, trees, done

    def _argmax(self, slots, rows, lo, hi) -> np.ndarray:
        a, _, _ = head_topk(self.head, slots[torch.as_tensor(rows), lo:hi].reshape(-1, slots.shape[-1]), 0,
                            self.head_rows)
        return a.view(len(rows), hi - lo).numpy()

    def _topk(self, slots, rows: np.ndarray, arg, done):
        """Top-k of the tree rows, as deep as each row's tree reads: a best-first tree built on the
        first k depths is the tree of all D depths unless it popped a node at depth k
        (`DraftTree.read_depth == k`); those rows get the next depths (k doubling) and are built
        again. A spine tree is built later (its chain is the whole argmax): all D depths at once."""
        ids = np.zeros((len(arg), self.D, self.topk), dtype=np.int64)
        logp = np.zeros((len(arg), self.D, self.topk), dtype=np.float32)
        trees: dict[int, DraftTree] = {}
        lo, hi = 0, self.D if self.spine else min(TREE_FIRST_DEPTHS, self.D)
        while rows.size and hi > lo:
            a, tids, tlogp = head_topk(self.head, slots[torch.as_tensor(rows), lo:hi].reshape(-1, slots.shape[-1]),
                                       self.topk, self.head_rows)
            n, K = len(rows), tids.shape[1]
            arg[rows, lo:hi] = a.view(n, hi - lo).numpy()
            ids[rows, lo:hi, :K] = tids.view(n, hi - lo, K).numpy()
            logp[rows, lo:hi, :K] = tlogp.view(n, hi - lo, K).numpy()
            done[rows] = hi
            if self.spine:
                break
            deeper = []
            for r in rows.tolist():
                trees[r] = build_tree(logp[r, :hi], ids[r, :hi], self.budget)
                if trees[r].read_depth == hi and hi < self.D:
                    deeper.append(r)
            rows, lo, hi = np.array(deeper, dtype=np.int64), hi, min(2 * hi, self.D)
        return trees, ids, logp


def _streaks(arg: np.ndarray, labels: np.ndarray) -> np.ndarray:
    """Leading slots whose draft equals the label (as `metrics.matches`: -1 labels never match)."""
    return metrics.leading_true((arg == labels) & (labels >= 0))


def _fit(x: torch.Tensor, length: int) -> torch.Tensor:
    """`[kv_heads, length, head_dim]`: x's first `length` positions, zero-padded (never attended)."""
    if x.shape[1] >= length:
        return x[:, :length]
    return torch.cat([x, x.new_zeros((x.shape[0], length - x.shape[1], x.shape[2]))], dim=1)
