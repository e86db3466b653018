"""Counting rules as others count: our walk against transcriptions of DeepSpec's eval loop and of the
serving engines' counters (vLLM `SpecDecodingStats` / `compute_acceptance_len`, SGLang's verify and
scheduler counters), on plain lists, so our number can sit next to a published table.

The transcriptions keep their sources' control flow and arithmetic (greedy: a draft is accepted when it
equals the target's token, which along the reference is `ext[start + i + 1]`):
- DeepSpec `deepspec/eval/base_evaluator.py`: `generate_decoding_sample`, `verify_draft_tokens`,
  `allreduce_response_metrics`, `build_metrics_row`;
- vLLM `vllm/v1/spec_decode/metrics.py` (`observe_draft`, `compute_acceptance_len`, per-position rates)
  with the scheduler's `num_accepted = len(generated_token_ids) - 1` before the stop check;
- SGLang `speculative/eagle_info.py` verify (accepted tokens cut at the finishing one, then
  `accept_length = (accept_index != -1).sum(dim=1) - 1`) and the scheduler's
  `spec_num_total_accepted_tokens += num_accepted_tokens + bs; spec_num_total_forward_ct += bs`.
"""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eval_worker.engine import metrics
from eval_worker.engine.drafting import AnchorDrafts
from eval_worker.engine.scoring import score_prompt


@st.composite
def prompt_case(draw, B, max_new, eos):
    """One prompt: the greedy reference (cut at eos or max_new), B-1 tokens of lookahead (eos may be
    among them) and a drafted block per offset. Few symbols, so drafts often match."""
    raw = draw(st.lists(st.integers(0, 2), min_size=max_new + B, max_size=max_new + B))
    tokens = raw[:max_new]
    if eos is not None and eos in tokens:
        tokens = tokens[:tokens.index(eos) + 1]
    ext = tokens + raw[len(tokens):len(tokens) + B - 1]
    drafts = draw(st.lists(st.lists(st.integers(0, 2), min_size=B - 1, max_size=B - 1),
                           min_size=len(tokens), max_size=len(tokens)))
    return tokens, ext, drafts


@st.composite
def suite_case(draw):
    B = draw(st.integers(2, 6))
    max_new = draw(st.integers(1, 24))
    eos = draw(st.sampled_from([None, 0]))
    prompts = draw(st.lists(prompt_case(B, max_new, eos), min_size=1, max_size=4))
    return B, max_new, eos, prompts


def streak(block, posterior):
    a = 0
    while a < len(block) and a < len(posterior) and block[a] == posterior[a]:
        a += 1
    return a


def ours(B, eos, prompts, counting):
    """Per-prompt accept lengths of our walk under `counting`, and the pooled τ over the suite."""
    per = []
    for tokens, ext, drafts in prompts:
        stop = ext.index(eos) if eos is not None and eos in ext else None
        sc = score_prompt("x", ext, len(tokens), AnchorDrafts(np.arange(len(tokens)), np.array(drafts).reshape(
            len(tokens), B - 1)), B, counting=counting, ends_with_stop=eos is not None and tokens[-1] == eos,
            stop_offset=stop)
        per.append(sc.online.accept_lengths)
    return per, metrics.macro_pooled(per)[1]


# --------------------------------------------------------------------------- DeepSpec


def deepspec_generate_like(ext, drafts, max_new, eos):
    """`generate_decoding_sample` + `verify_draft_tokens` (greedy, one stop token)."""
    B = len(drafts[0]) + 1
    stop_ids = None if eos is None else [eos]
    out = [None] * (max_new + B + 1)
    out[0] = ext[0]
    start, max_length = 0, max_new  # prompt length 0: positions are response offsets
    acceptance_lengths, proposal_lengths, accepted_draft_lengths = [], [], []
    if stop_ids and out[0] in stop_ids:
        return acceptance_lengths, proposal_lengths, accepted_draft_lengths
    while start < max_length:
        verify_input_ids = [out[start]] + list(drafts[start])
        target = [ext[i] if i < len(ext) else None for i in range(start + 1, start + B + 1)]
        accepted = streak(verify_input_ids[1:], target)
        effective, terminated = B - 1, False
        if stop_ids and accepted > 0:
            hits = [i for i, t in enumerate(verify_input_ids[1:accepted + 1]) if t in stop_ids]
            if hits:
                accepted, effective, terminated = hits[0] + 1, hits[0] + 1, True
        next_token = target[accepted]
        proposal_lengths.append(effective)
        accepted_draft_lengths.append(accepted)
        out[start:start + accepted + 1] = verify_input_ids[:accepted + 1]
        if terminated:
            acceptance_lengths.append(accepted)
            break
        out[start + accepted + 1] = next_token
        new_token_ids = out[start + 1:start + accepted + 2]
        acceptance_lengths.append(accepted + 1)
        start += accepted + 1
        if stop_ids and any(t in stop_ids for t in new_token_ids):
            break
    return acceptance_lengths, proposal_lengths, accepted_draft_lengths


def deepspec_metrics_row(responses, max_proposal_tokens):
    """`allreduce_response_metrics` (one rank) + `build_metrics_row`: acceptance_length, accept_rate@i."""
    count = acc_sum = 0
    at_pos, acc_at_pos = [0] * max_proposal_tokens, [0] * max_proposal_tokens
    for acceptance_lengths, proposal_lengths, accepted_draft_lengths in responses:
        for a, p, d in zip(acceptance_lengths, proposal_lengths, accepted_draft_lengths, strict=False):
            count += 1
            acc_sum += int(a)
            for i in range(max_proposal_tokens):
                at_pos[i] += p > i
                acc_at_pos[i] += d > i
    if count == 0:
        return 0.0, [None] * max_proposal_tokens
    return acc_sum / count, [acc_at_pos[i] / at_pos[i] if at_pos[i] else None for i in range(max_proposal_tokens)]


@settings(max_examples=300, deadline=None)
@given(suite_case())
def test_counting_deepspec_equals_deepspec_eval(case):
    B, max_new, eos, prompts = case
    theirs = [deepspec_generate_like(ext, drafts, max_new, eos) for _, ext, drafts in prompts]
    per, pooled = ours(B, eos, prompts, "deepspec")
    assert per == [t[0] for t in theirs]  # step by step, the stop-token round without its bonus
    length, _ = deepspec_metrics_row(theirs, B - 1)
    if any(per):
        assert pooled == length  # their acceptance_length is our pooled τ under this rule
    else:
        assert pooled is None and length == 0.0  # they print 0 for no proposal; we have no τ


def test_counting_deepspec_worked_example():
    """N = 6, eos at offset 4: the round at 2 accepts the drafts through eos (2 of them), adds 2, not 3."""
    streaks = {0: 1, 2: 3}
    walk = lambda counting: metrics.online_walk(streaks.get, 5, counting=counting,  # noqa: E731
                                                ends_with_stop=True).accept_lengths
    assert walk("response") == walk("vllm") == [2, 4]
    assert walk("deepspec") == [2, 2]
    assert walk("sglang") == [2, 2]  # SGLang cuts at eos too, but counts the bonus when it is the eos
    assert metrics.online_walk(lambda s: 0, 1, counting="deepspec", ends_with_stop=True).accept_lengths == []


# --------------------------------------------------------------------------- the serving engines


class SpecDecodingStats:
    """vLLM `SpecDecodingStats` + `compute_acceptance_len` (per-position rates as its logger prints)."""

    def __init__(self, num_spec_tokens):
        self.num_spec_tokens = num_spec_tokens
        self.num_drafts, self.num_draft_tokens, self.num_accepted_tokens = 0, 0, 0
        self.num_accepted_tokens_per_pos = [0] * num_spec_tokens

    def observe_draft(self, num_draft_tokens, num_accepted_tokens):
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted_tokens
        assert num_accepted_tokens <= self.num_spec_tokens
        for i in range(num_accepted_tokens):
            self.num_accepted_tokens_per_pos[i] += 1

    def acceptance_len(self):
        return 1 if self.num_drafts == 0 else 1 + self.num_accepted_tokens / self.num_drafts

    def rates(self):
        return [c / self.num_drafts for c in self.num_accepted_tokens_per_pos]


def vllm_serve_like(ext, drafts, max_new, eos, stats):
    """vLLM's scheduler over one request: the prefill token, then a verify per step whose
    `len(generated_token_ids) - 1` accepted tokens are counted before the stop check trims them."""
    B = len(drafts[0]) + 1
    output = [ext[0]]
    finished = output[-1] == eos or len(output) >= max_new
    while not finished:
        s = len(output) - 1
        target = [ext[i] if i < len(ext) else None for i in range(s + 1, s + B + 1)]
        n = streak(list(drafts[s]), target)
        generated = list(drafts[s][:n]) + [target[n]]
        stats.observe_draft(num_draft_tokens=B - 1, num_accepted_tokens=len(generated) - 1)
        for t in generated:  # _update_request_with_output: append, then check_stop
            output.append(t)
            if t == eos or len(output) >= max_new:
                finished = True
                break
    return output


class SGLangScheduler:
    def __init__(self):
        self.spec_num_total_accepted_tokens = self.spec_num_total_forward_ct = 0

    def update_spec_metrics(self, bs, num_accepted_tokens):
        self.spec_num_total_accepted_tokens += num_accepted_tokens + bs
        self.spec_num_total_forward_ct += bs

    def avg_spec_accept_length(self):
        return self.spec_num_total_accepted_tokens / self.spec_num_total_forward_ct


def sglang_serve_like(ext, drafts, max_new, eos, scheduler):
    """SGLang's verify over one request (batch of one): accepted tokens appended one by one with
    `check_finished`, the rest set to -1; `accept_length = (accept_index != -1).sum() - 1`."""
    B = len(drafts[0]) + 1
    output_ids = [ext[0]]
    finished = output_ids[-1] == eos or len(output_ids) >= max_new
    while not finished:
        s = len(output_ids) - 1
        target = [ext[i] if i < len(ext) else None for i in range(s + 1, s + B + 1)]
        n = streak(list(drafts[s]), target)
        accept_index = list(range(n + 1)) + [-1] * (B - 1 - n)
        predict = list(drafts[s][:n]) + [target[n]]
        for j, idx in enumerate(accept_index):
            if idx == -1:
                break
            output_ids.append(predict[idx])
            if output_ids[-1] == eos or len(output_ids) >= max_new:  # req.check_finished()
                finished = True
                accept_index[j + 1:] = [-1] * len(accept_index[j + 1:])
                break
        accept_length = sum(i != -1 for i in accept_index) - 1
        scheduler.update_spec_metrics(1, accept_length)
    return output_ids


@settings(max_examples=300, deadline=None)
@given(suite_case())
def test_counting_engine_vllm_equals_its_counters(case):
    B, max_new, eos, prompts = case
    stats = SpecDecodingStats(B - 1)
    for tokens, ext, drafts in prompts:
        assert vllm_serve_like(ext, drafts, max_new, eos, stats) == tokens  # same tokens served
    per, pooled = ours(B, eos, prompts, "vllm")
    assert sum(map(len, per)) == stats.num_drafts
    assert (pooled if pooled is not None else 1) == pytest.approx(stats.acceptance_len(), rel=1e-12)  # 1 + a/d vs Σ/d
    assert per == ours(B, eos, prompts, "response")[0]  # vLLM counts the steps and lengths of "response"


@settings(max_examples=300, deadline=None)
@given(suite_case())
def test_counting_engine_sglang_equals_its_counters(case):
    B, max_new, eos, prompts = case
    sched = SGLangScheduler()
    for tokens, ext, drafts in prompts:
        assert sglang_serve_like(ext, drafts, max_new, eos, sched) == tokens
    per, pooled = ours(B, eos, prompts, "sglang")
    assert sum(map(len, per)) == sched.spec_num_total_forward_ct
    if pooled is not None:
        assert pooled == pytest.approx(sched.avg_spec_accept_length(), rel=1e-12)
    # per request SGLang's meta_info spec_accept_length = completion_tokens / spec_verify_ct: the
    # prefill's token over the steps, i.e. (1 + Σ committed) / steps
    for (tokens, _, _), lengths in zip(prompts, per, strict=True):
        assert 1 + sum(lengths) == len(tokens)


def test_counting_engine_run_table_names_the_pooled_figure():
    """`dflash-eval run` under another project's rule says which of its numbers is theirs."""
    from eval_worker.commands.run import format_table
    from tests.support.eval_results import make_result

    r = make_result("r", 1)
    assert "pooled τ (" not in format_table(r)
    for counting, name in (("deepspec", "DeepSpec's accept_length"), ("vllm", "vLLM's mean acceptance length"),
                           ("sglang", "SGLang's avg_spec_accept_length")):
        r["settings"]["counting"] = counting
        assert f"--counting {counting}: its figure is the pooled τ ({name})" in format_table(r)
