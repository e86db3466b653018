"""References: local greedy (+ lookahead past eos), and an OpenAI-compatible server asked for ids."""
import socket

import pytest

from dflash_train.checkpoints.checkpoint import save_drafter
from dflash_train.core.speculative import greedy_generate
from eval_worker.engine.acceptance import Evaluator
from eval_worker.engine.references import LocalReferences, ReferenceSourceError, ServerReferences, split_at_eos
from eval_worker.engine.suite import Prompt, Suite
from tests.support.engine_helpers import CannedServer
from tests.support.factories import drafter_for, qwen3_target

TARGET = qwen3_target(seed=6)
PROMPT = [4, 8, 15, 16, 23, 42]


def greedy_ids(body):
    """What a correct server returns: the target's greedy tokens, eos ignored."""
    return greedy_generate(TARGET, body["prompt"], body["max_tokens"])


def test_split_at_eos():
    assert split_at_eos([1, 2, 0, 5, 6], 10, 0) == ([1, 2, 0], [5, 6], "eos")
    assert split_at_eos([1, 2, 3, 4], 3, 0) == ([1, 2, 3], [4], "length")
    assert split_at_eos([1, 0, 3], 1, 0) == ([1], [0, 3], "length")  # eos after the limit does not count


def test_local_reference_is_greedy_with_lookahead_past_eos():
    full = greedy_generate(TARGET, PROMPT, 40)
    eos = full[10]
    ref = LocalReferences(TARGET).generate("x", PROMPT, 30, eos, lookahead=7)
    cut = full.index(eos) + 1
    assert ref.tokens == full[:cut] and ref.finish == "eos"
    assert ref.lookahead == full[cut:cut + 7]  # the target keeps going after eos; the real loop sees that
    plain = LocalReferences(TARGET).generate("x", PROMPT, 12, None, lookahead=5)
    assert plain.tokens == full[:12] and plain.lookahead == full[12:17] and plain.finish == "length"


@pytest.mark.parametrize("shape", ["token_ids", "logprobs_tokens", "meta_info"])
def test_server_ids_in_each_known_shape(shape):
    def respond(body):
        ids = greedy_ids(body)
        if shape == "token_ids":
            return 200, {"choices": [{"text": "...", "token_ids": ids}]}
        if shape == "meta_info":
            return 200, {"choices": [{"text": "...", "meta_info": {"output_ids": ids}}]}
        return 200, {"choices": [{"text": "...", "logprobs": {"tokens": [f"token_id:{i}" for i in ids]}}]}

    with CannedServer(respond) as srv:
        ref = ServerReferences(srv.url, model="tiny").generate("x", PROMPT, 20, None, lookahead=5)
    path, body = srv.requests[0]
    assert path == "/v1/completions" and body["prompt"] == PROMPT and body["temperature"] == 0.0
    assert body["max_tokens"] == 25 and body["model"] == "tiny" and body["ignore_eos"] is True
    full = greedy_generate(TARGET, PROMPT, 25)
    assert ref.tokens == full[:20] and ref.lookahead == full[20:]


def test_text_without_ids_is_a_clear_error():
    with CannedServer(lambda b: (200, {"choices": [{"text": "def f(): pass"}]})) as srv:
        with pytest.raises(ReferenceSourceError, match="text without token ids"):
            ServerReferences(srv.url).generate("x", PROMPT, 5, None, 2)


def test_http_error_and_server_down():
    with CannedServer(lambda b: (500, {"error": "model not loaded"})) as srv:
        with pytest.raises(ReferenceSourceError, match="HTTP 500.*model not loaded"):
            ServerReferences(srv.url).generate("x", PROMPT, 5, None, 2)
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ReferenceSourceError, match="cannot reach reference server"):
        ServerReferences(f"http://127.0.0.1:{port}", timeout=5).generate("x", PROMPT, 5, None, 2)


def _suite():
    return Suite("srv", "1", [Prompt("a", ids=tuple(PROMPT)), Prompt("b", ids=(9, 9, 2, 31))],
                 chat_template=False, max_new_tokens=16)


def test_evaluator_with_a_server_reference(tmp_path):
    save_drafter(drafter_for(TARGET, block_size=4), tmp_path / "ck")
    with CannedServer(lambda b: (200, {"choices": [{"token_ids": greedy_ids(b)}]})) as srv:
        ev = Evaluator(TARGET, tmp_path / "cache", reference_source=ServerReferences(srv.url))
        res = ev.evaluate(tmp_path / "ck", _suite(), options={"measure_speed": False, "validate": True})
    assert res.settings["reference_source"] == f"server:{srv.url}"
    assert res.validation["ok"]
    assert all(p.reference_agrees_with_target for p in res.prompts)
    assert "REFERENCE_NOT_TARGET_GREEDY" not in res.diagnostic_codes()


def _wrong_server(body):
    ids = greedy_ids(body)
    ids[5] = (ids[5] + 1) % 90
    return 200, {"choices": [{"token_ids": ids}]}


def test_a_server_that_serves_another_model_fails_the_job_and_caches_nothing(tmp_path):
    """bf16 serving, another checkpoint, a chat template applied twice, re-tokenized text: the
    reference is not the target's greedy output, so τ on it would not be the target's τ."""
    save_drafter(drafter_for(TARGET, block_size=4), tmp_path / "ck")
    with CannedServer(_wrong_server) as srv:
        ev = Evaluator(TARGET, tmp_path / "cache", reference_source=ServerReferences(srv.url))
        with pytest.raises(ReferenceSourceError, match=r"prompt 'a' .* not the target's greedy output: at response "
                                                 r"token 5 .*reference_mismatch='measure'"):
            ev.evaluate(tmp_path / "ck", _suite(), options={"measure_speed": False})
    assert not [p for p in (tmp_path / "cache").rglob("*") if p.is_file()]


def test_a_later_prompt_mismatch_removes_what_the_job_cached(tmp_path):
    save_drafter(drafter_for(TARGET, block_size=4), tmp_path / "ck")

    def respond(body):  # right for prompt a, wrong for prompt b
        return (200,
                {"choices": [{"token_ids": greedy_ids(body)}]}) if body["prompt"] == PROMPT else _wrong_server(body)

    with CannedServer(respond) as srv:
        ev = Evaluator(TARGET, tmp_path / "cache", reference_source=ServerReferences(srv.url))
        with pytest.raises(ReferenceSourceError, match="prompt 'b'"):
            ev.evaluate(tmp_path / "ck", _suite(), options={"measure_speed": False})
    assert not [p for p in (tmp_path / "cache").rglob("*") if p.is_file()]


def test_measuring_a_mismatched_reference_is_an_explicit_choice(tmp_path):
    save_drafter(drafter_for(TARGET, block_size=4), tmp_path / "ck")
    with CannedServer(_wrong_server) as srv:
        ev = Evaluator(TARGET, tmp_path / "cache", reference_source=ServerReferences(srv.url))
        res = ev.evaluate(tmp_path / "ck", _suite(), options={"measure_speed": False, "reference_mismatch": "measure"})
        # cached under the opt-in; a later run without it still checks, and fails
        with pytest.raises(ReferenceSourceError, match="not the target's greedy output"):
            ev.evaluate(tmp_path / "ck", _suite(), options={"measure_speed": False})
    assert [p.reference_agrees_with_target for p in res.prompts] == [False, False]
    diag = [d for d in res.diagnostics if d.code == "REFERENCE_NOT_TARGET_GREEDY"]
    assert diag and "a@5" in diag[0].message
    with pytest.raises(ValueError, match="reference_mismatch"):
        ev.evaluate(tmp_path / "ck", _suite(), options={"reference_mismatch": "ignore"})
