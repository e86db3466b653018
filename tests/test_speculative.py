"""The reference draft-verify loop is lossless and counts acceptance correctly."""
import pytest
import torch

from dflash_train.speculative import greedy_generate, speculative_generate

from .factories import drafter_for, qwen3_5_vlm_target, qwen3_target


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


def test_lossless_on_wrapped_linear_attention_target():
    target = qwen3_5_vlm_target()  # recurrent layers: the loop falls back to full re-verification
    drafter = drafter_for(target, features=1)
    prompt = [7, 8, 9, 10]
    assert speculative_generate(target, drafter, prompt, 20).tokens == greedy_generate(target, prompt, 20)


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
