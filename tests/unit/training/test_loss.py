"""Loss weights, chunked CE, D-PACE, rank-split normalisation, and no leak through the training mask."""
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_train.training.anchors import block_labels, sample_anchors
from dflash_train.training.loss import block_loss, default_gamma, dpace_weights, slot_weights, summarize_stats, token_ce
from tests.support.factories import drafter_for
from tests.support.train_helpers import target_and_examples


@pytest.mark.parametrize("B,gamma", [(16, 7.0), (10, 5.0), (8, 4.0)])
def test_published_decay(B, gamma):
    assert default_gamma(B) == gamma
    w = slot_weights(B)
    assert w[0] == 0 and w[1] == 1
    for k in range(1, B):
        assert math.isclose(float(w[k]), math.exp(-(k - 1) / gamma), rel_tol=1e-6)


def _head(H=8, V=11, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Linear(H, V, bias=False)


def _case(b=2, N=3, B=5, H=8, V=11, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, N * B, H, generator=g, requires_grad=True)
    labels = torch.randint(0, V, (b, N, B), generator=g)
    mask = torch.rand(b, N, B, generator=g) > 0.3
    mask[..., 0] = False
    return hidden, labels, mask


def test_loss_is_weight_normalised_mean_of_ce():
    hidden, labels, mask = _case()
    head = _head()
    out = block_loss(hidden, head, labels, mask, gamma=2.0)
    ce, _ = token_ce(hidden, head, labels, mask)
    w = slot_weights(5, 2.0) * mask
    torch.testing.assert_close(out.loss, (w * ce).sum() / w.sum())
    # masked slots carry no gradient and no loss
    out.loss.backward()
    g = hidden.grad.view(2, 3, 5, 8)
    assert torch.all(g[~mask] == 0) and torch.any(g[mask] != 0)


@settings(max_examples=20, deadline=None)
@given(st.integers(1, 40), st.integers(0, 1000))
def test_chunked_ce_equals_whole(chunk, seed):
    hidden, labels, mask = _case(seed=seed)
    head = _head(seed=seed)
    whole = block_loss(hidden, head, labels, mask)
    (gw,) = torch.autograd.grad(whole.loss, hidden)
    chunked = block_loss(hidden, head, labels, mask, chunk_size=chunk)
    (gc,) = torch.autograd.grad(chunked.loss, hidden)
    torch.testing.assert_close(chunked.loss, whole.loss)
    torch.testing.assert_close(gc, gw)
    torch.testing.assert_close(chunked.stats, whole.stats)


def test_dpace_weights_by_hand():
    ce = torch.tensor([[[9.0, 0.1, 0.5, 2.0]]])
    mask = torch.tensor([[[False, True, True, True]]])
    a = 0.5
    q = [(1 - a) * math.exp(-c) + a for c in (0.1, 0.5, 2.0)]
    P = [q[0], q[0] * q[1], q[0] * q[1] * q[2]]
    want = [0.0, P[0] + P[1] + P[2], P[1] + P[2], P[2]]
    torch.testing.assert_close(dpace_weights(ce, mask, a)[0, 0], torch.tensor(want))
    # a masked slot ends the chain: nothing after it is weighted
    mask2 = torch.tensor([[[False, True, False, True]]])
    w2 = dpace_weights(ce, mask2, a)[0, 0]
    assert w2[2] == 0 and w2[3] == 0 and math.isclose(float(w2[1]), q[0], rel_tol=1e-6)


@pytest.mark.parametrize("loss_type", ["dflash", "dpace"])
def test_rank_split_with_summed_stats_equals_whole_batch(loss_type):
    """Two 'ranks' dividing by the global weight sum (loss_scale=2, DDP averages) give the whole-batch gradient."""
    hidden, labels, mask = _case(b=4)
    head = _head()
    whole = block_loss(hidden, head, labels, mask, loss_type=loss_type)
    (gw,) = torch.autograd.grad(whole.loss, hidden)
    halves = [block_loss(hidden[i:i + 2], head, labels[i:i + 2], mask[i:i + 2], loss_type=loss_type) for i in (0, 2)]
    total = halves[0].stats + halves[1].stats
    grads = []
    for i in (0, 2):
        out = block_loss(hidden[i:i + 2], head, labels[i:i + 2], mask[i:i + 2], loss_type=loss_type,
                         reduce_stats=lambda t: total, loss_scale=2.0)
        (g,) = torch.autograd.grad(out.loss, hidden)
        grads.append(g)
    torch.testing.assert_close((grads[0] + grads[1]) / 2, gw)
    assert math.isclose(summarize_stats(total, 5)["loss"], float(whole.loss.detach()), rel_tol=1e-5)


def test_streak_and_accuracy_metrics():
    B = 4
    labels = torch.tensor([[[0, 1, 2, 3], [0, 1, 2, 3]]])
    mask = torch.ones(1, 2, B, dtype=torch.bool)
    mask[..., 0] = False
    head = torch.nn.Linear(4, 4, bias=False)
    head.weight.data = torch.eye(4)
    # block 0 predicts 1, 2, 0 (two right then wrong); block 1 predicts 0, 2, 3 (wrong first)
    preds = torch.tensor([[0, 1, 2, 0], [0, 0, 2, 3]])
    hidden = torch.nn.functional.one_hot(preds, 4).float().view(1, 2 * B, 4) * 10
    m = summarize_stats(block_loss(hidden, head, labels, mask).stats, B)
    assert math.isclose(m["accuracy"], 4 / 6)
    assert math.isclose(m["streak"], 1 + (2 + 0) / 2)
    assert m["per_slot_accuracy"] == [0.5, 1.0, 0.5]


def test_no_leak_through_the_training_mask():
    """A block's training loss has zero gradient w.r.t. target features at or after its anchor
    (the strict-context rule, pitfall 2.7.2), through the real drafter + LM head + loss."""
    target, examples = target_and_examples()
    drafter = drafter_for(target, layers=2, features=2, block_size=8).train()
    ex = examples[1]
    ids = torch.tensor([ex.ids])
    out = target.forward(ids, drafter.config.target_layer_ids)
    pred = target.greedy_tokens(out.last_hidden)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    mask[0, ex.prompt_len:] = True
    anchors, valid = sample_anchors(mask, 5, [3])
    labels, lmask = block_labels(pred, anchors, valid, mask, 8)
    checked = 0
    for j in range(anchors.shape[1]):
        feats = out.features.clone().requires_grad_(True)
        hidden = drafter.forward_blocks(target.parts.embed_tokens, ids, feats, anchors, valid, backend="sdpa")
        only_j = lmask.clone()
        only_j[:, [i for i in range(anchors.shape[1]) if i != j]] = False
        loss = block_loss(hidden, target.parts.lm_head, labels, only_j).loss
        (g,) = torch.autograd.grad(loss, feats)
        a = int(anchors[0, j])
        assert torch.all(g[0, a:] == 0), f"block {j} (anchor {a}) reads features at/after its anchor"
        assert torch.any(g[0, :a] != 0)
        checked += 1
    assert checked == 5
