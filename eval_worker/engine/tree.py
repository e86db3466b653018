"""DDTree-style draft trees from one block's per-position top-k, and the greedy walk through them.

Construction (DDTree, arXiv 2604.12989): nodes are prefixes; a prefix's score is the sum
of the drafter's log-probabilities of its tokens, each depth treated as independent. A
best-first heap pops the highest-scoring prefix, adds it as a node, and pushes its
next-rank sibling and its rank-0 child. After `budget` pops the tree holds the `budget`
best prefixes (prefix-closed because scores only fall with depth).

The walk: from the root (the anchor), follow the child whose token equals the target's
token at that depth; the accepted streak is the depth reached.

A plain best-first tree does not always contain the drafter's top-1 chain: when depth 1
is flat, the budget can go to depth-1 siblings. With `spine=True` the top-1 chain is
added first (outside the budget), which makes the tree at least as good as the chain on
every block.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np


@dataclass
class DraftTree:
    tokens: list[int] = field(default_factory=list)  # node i's token
    parents: list[int] = field(default_factory=list)  # node i's parent (-1 = root)
    depths: list[int] = field(default_factory=list)  # 1-based depth (slot) of node i
    children: dict[tuple[int, int], int] = field(default_factory=dict)  # (parent, token) -> node
    spine_depth: int = 0  # how deep the drafter's top-1 chain goes inside the tree
    read_depth: int = 0  # depths of the top-k the best-first construction popped from (1 + deepest index)

    def __len__(self) -> int:
        return len(self.tokens)

    def _add(self, parent: int, depth: int, token: int) -> int:
        key = (parent, token)
        if key in self.children:
            return self.children[key]
        self.tokens.append(token)
        self.parents.append(parent)
        self.depths.append(depth)
        self.children[key] = len(self.tokens) - 1
        return self.children[key]


def build_tree(topk_logp: np.ndarray, topk_ids: np.ndarray, budget: int, *, spine: bool = False,
               spine_ids=None) -> DraftTree:
    """Tree over `[D, K]` per-depth top-k (log-probs sorted descending, their token ids).

    `spine_ids`: the top-1 token at every depth (may be deeper than D); default ids[:, 0].
    """
    if budget < 0:
        raise ValueError("tree budget must be >= 0")
    logp = np.asarray(topk_logp, dtype=np.float64)
    ids = np.asarray(topk_ids)
    D, K = logp.shape
    tree = DraftTree()
    chain = [int(t) for t in (ids[:, 0] if spine_ids is None else spine_ids)]
    node = -1
    if spine:
        for d, tok in enumerate(chain):
            node = tree._add(node, d + 1, tok)
    if D == 0 or K == 0 or budget == 0:
        tree.spine_depth = len(chain) if spine else 0
        return tree
    # heap entries: (-score, tie, parent node, parent score, depth index, rank)
    heap = [(-logp[0, 0], 0, -1, 0.0, 0, 0)]
    tie, popped = 1, 0
    while heap and popped < budget:
        neg, _, parent, pscore, d, r = heapq.heappop(heap)
        score = -neg
        tree.read_depth = max(tree.read_depth, d + 1)
        before = len(tree)
        node = tree._add(parent, d + 1, int(ids[d, r]))
        popped += len(tree) > before  # a spine node popped again costs nothing
        if r + 1 < K:
            heapq.heappush(heap, (-(pscore + logp[d, r + 1]), tie, parent, pscore, d, r + 1))
            tie += 1
        if d + 1 < D:
            heapq.heappush(heap, (-(score + logp[d + 1, 0]), tie, node, score, d + 1, 0))
            tie += 1
    tree.spine_depth = _chain_depth(tree, chain)
    return tree


def _chain_depth(tree: DraftTree, chain: list[int]) -> int:
    node, d = -1, 0
    while d < len(chain) and (node, chain[d]) in tree.children:
        node = tree.children[(node, chain[d])]
        d += 1
    return d


def tree_streak(tree: DraftTree, labels) -> int:
    """Depth reached following `labels[d]` (the target's token at depth d+1) from the root.

    A label < 0 means unknown (past the reference end) and stops the walk.
    """
    node, d = -1, 0
    for lab in labels:
        lab = int(lab)
        if lab < 0 or (node, lab) not in tree.children:
            break
        node = tree.children[(node, lab)]
        d += 1
    return d
