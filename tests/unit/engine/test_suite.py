"""Suites: built-in coding suite, JSONL parsing with clear errors, fingerprints."""
import json

import pytest

from eval_worker.engine.suite import Prompt, Suite, SuiteError, builtin_suites, load_suite, parse_suite


def test_builtin_coding_suite():
    s = load_suite("builtin:coding-v1")
    names = [p.name for p in s.prompts]
    assert {"fizzbuzz", "binary_search", "linked_list_reverse"} <= set(names)
    assert len(names) >= 24 and len(set(names)) == len(names)
    assert (s.name, s.version, s.chat_template, s.max_new_tokens) == ("coding", "1", True, 128)
    assert load_suite("coding").fingerprint() == s.fingerprint() == load_suite("builtin:coding").fingerprint()
    assert "coding" in builtin_suites()
    with pytest.raises(SuiteError, match="version 1, not 2"):
        load_suite("builtin:coding-v2")
    with pytest.raises(SuiteError, match="no built-in suite 'nope'"):
        load_suite("nope")


def test_fingerprint_covers_everything_that_changes_the_ids():
    base = Suite("s", "1", [Prompt("a", prompt="hello")])
    fp = base.fingerprint()
    assert Suite("s", "1", [Prompt("a", prompt="hello")]).fingerprint() == fp
    for other in (Suite("s", "1", [Prompt("a", prompt="hello!")]), Suite("s", "2", [Prompt("a", prompt="hello")]),
                  Suite("s", "1", [Prompt("a", prompt="hello")], chat_template=False),
                  Suite("s", "1", [Prompt("a", prompt="hello")], max_new_tokens=64),
                  Suite("s", "1", [Prompt("a", prompt="hello")], chat_template_kwargs={"enable_thinking": True})):
        assert other.fingerprint() != fp
    two = Suite("s", "1", [Prompt("a", prompt="x"), Prompt("b", prompt="y")])
    assert two.head(1).fingerprint() != two.fingerprint() and len(two.head(1).prompts) == 1
    assert two.head(5) is two


def test_user_jsonl(tmp_path):
    f = tmp_path / "mine.jsonl"
    f.write_text("\n".join([
        json.dumps({"suite": "mine", "version": "3", "chat_template": False, "max_new_tokens": 32}),
        json.dumps({"name": "t", "prompt": "def f(x):"}),
        "",
        json.dumps({"name": "c", "messages": [{"role": "user", "content": "hi"}]}),
        json.dumps({"ids": [5, 6, 7]}),
    ]))
    s = load_suite(f)
    assert (s.name, s.version, s.chat_template, s.max_new_tokens) == ("mine", "3", False, 32)
    assert [p.name for p in s.prompts] == ["t", "c", "prompt_002"]
    assert Suite("ids", "1", s.prompts[2:]).encode(None)[0].ids == [5, 6, 7]  # ids need no tokenizer
    with pytest.raises(SuiteError, match="text but the target has no tokenizer"):
        s.encode(None)


@pytest.mark.parametrize("lines, match", [
    ([], "empty"),
    ([json.dumps({"suite": "x"})], "empty"),
    (["{not json"], ":1: not valid JSON"),
    ([json.dumps({"name": "a"})], "exactly one of"),
    ([json.dumps({"name": "a", "prompt": "x", "ids": [1]})], "exactly one of"),
    ([json.dumps({"name": "a", "ids": [1, -2]})], "non-negative"),
    ([json.dumps({"name": "a", "messages": [{"content": "x"}]})], "role, content"),
    ([json.dumps({"name": "a", "prompt": "x"}), json.dumps({"name": "a", "prompt": "y"})], "duplicate prompt names"),
    ([json.dumps({"name": "a", "prompt": "x"}), json.dumps({"suite": "late"})],
     ":2: the suite header must be the first line"),
    ([json.dumps({"suite": "x", "colour": "red"}), json.dumps({"prompt": "x"})], "unknown header fields"),
    ([json.dumps({"suite": "x", "max_new_tokens": 0}), json.dumps({"prompt": "x"})], "max_new_tokens must be >= 1"),
])
def test_bad_suites_name_the_problem(lines, match):
    with pytest.raises(SuiteError, match=match):
        parse_suite(lines, "f.jsonl")


def test_missing_file():
    with pytest.raises(SuiteError, match="not found"):
        load_suite("/nonexistent/suite.jsonl")


def test_encode_with_the_tiny_tokenizer(tiny_target_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_target_path, local_files_only=True)
    s = load_suite("coding").head(2)
    chat = s.encode(tok)
    plain = s.encode(tok, chat_template=False)
    assert tok.decode(chat[0].ids).startswith("<|im_start|>user\nWrite a Python function fizzbuzz")
    assert tok.decode(chat[0].ids).endswith("<|im_start|>assistant\n")
    assert tok.decode(plain[0].ids).startswith("Write a Python function fizzbuzz")


def test_suite_names_linear_at_the_prompt_limit():
    """The duplicate-name check at the documented maximum (2^20 prompts) is one pass (issue 34 D11: it was
    quadratic, >600 s); a duplicate among them is still named. The bound is 20x what one pass takes here."""
    import time

    from eval_worker.engine.options import MAX_PROMPTS
    from eval_worker.engine.suite import Prompt, Suite, SuiteError

    prompts = [Prompt(name=f"p{i}", prompt="x") for i in range(MAX_PROMPTS)]
    t0 = time.perf_counter()
    Suite("big", "1", prompts)
    took = time.perf_counter() - t0
    assert took < 30, f"{took:.1f} s for {MAX_PROMPTS} names"
    prompts[-1] = Prompt(name="p7", prompt="y")
    with pytest.raises(SuiteError, match=r"duplicate prompt names 'p7'$"):
        Suite("big", "1", prompts)
    many = [Prompt(name=f"d{i % 20}", prompt="x") for i in range(40)]
    with pytest.raises(SuiteError, match="and 10 more"):
        Suite("dups", "1", many)
