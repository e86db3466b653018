"""The reference draft-verify loop is lossless and counts acceptance correctly."""
import pytest
import torch

from dflash_train.core.speculative import greedy_generate, speculative_generate
from dflash_train.core.target import VerifyCache
from tests.support.factories import drafter_for, qwen3_5_vlm_target, qwen3_target


@pytest.mark.parametrize("use_cache", [True, False])
def test_lossless_on_random_target(use_cache):
    target = qwen3_target()
    drafter = drafter_for(target)
    prompt = [3, 14, 15, 9, 26, 5]
    ref = greedy_generate(target, prompt, 50)
    res = speculative_generate(target, drafter, prompt, 50, use_cache=use_cache)
    assert res.tokens == ref
    # the first token comes from the prefill; every other one from a verify step
    assert sum(res.accept_lengths) == len(res.tokens) - 1
    assert all(1 <= n <= drafter.config.block_size for n in res.accept_lengths)


HYBRID = qwen3_5_vlm_target()  # gated-delta (recurrent) layers and full attention, under a VLM wrapper


@pytest.mark.parametrize("agree", [False, True], ids=["random_drafter", "agreeing_drafter"])
def test_hybrid_incremental_verify_equals_full_forward_step_by_step(agree):
    """On a hybrid target the loop verifies incrementally (recurrent states saved, restored and
    advanced over the accepted tokens); step for step it equals re-running the whole sequence."""
    target = qwen3_5_vlm_target(seed=1)
    drafter = drafter_for(target, features=1, block_size=4)
    if agree:  # both argmax to token 0: every draft accepted, the cache is never rewound
        with torch.no_grad():
            target.parts.final_norm.weight.fill_(-1.0)  # Qwen3.5's norm scales by (1 + weight)
            drafter.norm.weight.zero_()
    prompt = [7, 8, 9, 10, 3, 5]
    assert VerifyCache(target).recurrent and VerifyCache(target).rewindable
    fast = speculative_generate(target, drafter, prompt, 24)  # the default: incremental
    slow = speculative_generate(target, drafter, prompt, 24, use_cache=False)
    assert fast.accept_lengths == slow.accept_lengths and fast.tokens == slow.tokens
    assert fast.tokens == greedy_generate(target, prompt, 24)
    assert (max(fast.accept_lengths) == 4) == agree


@pytest.mark.parametrize("accepted", [0, 1, 3, 5])
def test_hybrid_verify_cache_rewinds_to_exactly_the_committed_tokens(accepted):
    """A verify block whose first `accepted` drafts are the target's greedy tokens and the rest
    wrong: after the rewind, the cache continues exactly as a fresh prefill of what was committed."""
    target, B = HYBRID, 6
    prompt = [4, 9, 2, 7, 7, 1, 30]
    greedy = greedy_generate(target, prompt, B)
    block = torch.tensor([[prompt[-1]] + greedy[:accepted] + [(g + 1) % 90 for g in greedy[accepted:B - 1]]])
    cache = VerifyCache(target)
    target.forward(torch.tensor([prompt[:-1]]), [1], past_key_values=cache.kv, use_cache=True)
    cache.save()
    target.forward(block, [1], past_key_values=cache.kv, use_cache=True)
    cache.rewind(len(prompt) - 1, block[:, : accepted + 1], [1])
    committed = prompt + greedy[:accepted]
    assert cache.length == len(committed)
    nxt = torch.tensor([[greedy[accepted]]])  # the bonus token goes in next
    inc = target.forward(nxt, [0, 3], past_key_values=cache.kv, use_cache=True)
    fresh = target.forward(torch.tensor([committed + [greedy[accepted]]]), [0, 3])
    torch.testing.assert_close(inc.features[:, -1], fresh.features[:, -1], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(inc.last_hidden[:, -1], fresh.last_hidden[:, -1], atol=1e-5, rtol=1e-4)


def test_drafter_that_always_agrees_is_accepted_in_full():
    """Zero the final norms: target and drafter both argmax to token 0, so every draft is right."""
    target = qwen3_target()
    drafter = drafter_for(target, block_size=8)
    with torch.no_grad():
        target.parts.final_norm.weight.zero_()
        drafter.norm.weight.zero_()
    res = speculative_generate(target, drafter, [1, 2, 3], 33)
    assert res.tokens == [0] * 33
    assert res.accept_lengths == [8, 8, 8, 8]  # 1 + 4 * 8 tokens
    assert res.tau == 8.0


def test_eos_stops_generation():
    target = qwen3_target()
    drafter = drafter_for(target)
    ref = greedy_generate(target, [1, 2, 3], 30)
    eos = ref[10]
    res = speculative_generate(target, drafter, [1, 2, 3], 30, eos_token_id=eos)
    assert res.tokens == ref[: ref.index(eos) + 1]


def test_counting_published_drafts_once_more_when_steps_sum_to_n_minus_1():
    """Every draft right, B = 8, N = 33: 1 + 4 * 8 tokens fill N exactly; z-lab's loop
    (`while start < prompt + N`) still runs a fifth step whose tokens are all cut off."""
    target = qwen3_target()
    drafter = drafter_for(target, block_size=8)
    with torch.no_grad():
        target.parts.final_norm.weight.zero_()
        drafter.norm.weight.zero_()
    ours = speculative_generate(target, drafter, [1, 2, 3], 33)
    published = speculative_generate(target, drafter, [1, 2, 3], 33, counting="published")
    assert ours.accept_lengths == [8, 8, 8, 8]
    assert published.accept_lengths == [8, 8, 8, 8, 8] and published.tokens == ours.tokens == [0] * 33
    # one token fewer to go (N = 34): both loops need the fifth step and agree
    assert speculative_generate(target, drafter, [1, 2, 3], 34, counting="published").accept_lengths == [8] * 5
    with pytest.raises(ValueError, match="counting"):
        speculative_generate(target, drafter, [1, 2, 3], 33, counting="exact")


def test_counting_published_drafts_once_after_an_eos_first_token():
    target = qwen3_target()
    drafter = drafter_for(target)
    eos = greedy_generate(target, [1, 2, 3], 1)[0]  # the prefill's token is the stop token
    ours = speculative_generate(target, drafter, [1, 2, 3], 30, eos_token_id=eos)
    published = speculative_generate(target, drafter, [1, 2, 3], 30, eos_token_id=eos, counting="published")
    assert ours.tokens == published.tokens == [eos]
    assert ours.accept_lengths == [] and len(published.accept_lengths) == 1


def test_output_tokens_equal_to_the_mask_id_are_kept():
    """z-lab 7d2ea1e: a generated token that happens to be the mask id is output like any other."""
    from dflash_train.core.config import DrafterConfig
    from dflash_train.core.model import DFlashDrafter

    target = qwen3_target()
    prompt = [3, 14, 15, 9, 26, 5]
    ref = greedy_generate(target, prompt, 30)
    torch.manual_seed(1)
    cfg = DrafterConfig.for_target(target.model.config, mask_token_id=ref[4], num_hidden_layers=1, num_features=2,
                                   block_size=4)
    res = speculative_generate(target, DFlashDrafter(cfg).eval(), prompt, 30)
    assert res.tokens == ref and ref.count(cfg.mask_token_id) >= 1
