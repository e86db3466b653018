"""End to end at real shapes: Qwen3 at vocab 151,936 and a wrapped hybrid Qwen3.5 at 248,320.

Random weights, real vocabularies (embedding and LM head above 2^24 elements), 8 layers
(so the 5-feature layer formula applies), a byte-level BPE tokenizer with the special
tokens at their published ids and the Qwen3 chat template, saved and loaded as a user's
model directory through `dflash-eval run`.
"""
import json
import shutil
from types import SimpleNamespace

import pytest
import torch

from dflash_train.checkpoints.checkpoint import save_drafter
from dflash_train.core.speculative import greedy_generate
from dflash_train.core.target import Target
from eval_worker.cli import main
from tests.support.engine_helpers import CannedServer
from tests.support.factories import (
    QWEN3_5_SPECIALS,
    QWEN3_SPECIALS,
    qwen3_5_real_shape,
    qwen3_real_shape,
    real_shape_drafter,
    save_target,
)

SHAPES = {"qwen3": (qwen3_real_shape, QWEN3_SPECIALS), "qwen3_5": (qwen3_5_real_shape, QWEN3_5_SPECIALS)}
PROMPTS = [("fib", "Write fib(n) in Python."), ("sort", "Sort a list of tuples by the second item.")]
MAX_NEW = 20


@pytest.fixture(scope="module", params=sorted(SHAPES))
def shape(request, tmp_path_factory):
    make, specials = SHAPES[request.param]
    tmp = tmp_path_factory.mktemp(f"real_shape_{request.param}")
    target = make()
    save_target(target, tmp / "target")
    save_drafter(real_shape_drafter(target, layers=1, block_size=8), tmp / "drafter")
    suite = tmp / "suite.jsonl"
    lines = [{"suite": "real", "version": "1", "chat_template": True, "max_new_tokens": MAX_NEW}]
    suite.write_text("\n".join(json.dumps(x) for x in lines + [{"name": n, "prompt": p} for n, p in PROMPTS]) + "\n")
    return SimpleNamespace(name=request.param, target=target, specials=specials, dir=tmp / "target",
                           drafter=tmp / "drafter", suite=suite, tmp=tmp)


def run(shape, out, *extra, target=None):
    rc = main(["run", "--checkpoint", str(shape.drafter), "--target", str(target or shape.dir), "--suite",
               str(shape.suite), "--json", str(out), "--no-progress", "--tree-budget", "4", *extra])
    return rc, (json.loads(out.read_text()) if out.exists() else None)


def test_real_shape_target_loads_with_its_tokenizer_and_template(shape):
    loaded = Target.load(shape.dir)
    assert loaded.vocab_size == shape.target.vocab_size > 2 ** 17 and loaded.num_layers == 8
    assert loaded.parts.lm_head.weight.numel() > 2 ** 24
    ids = {v: k for k, v in shape.specials.items()}
    assert loaded.mask_token_id() == ids["<|MASK|>"]
    text = loaded.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                                add_generation_prompt=True, enable_thinking=False)
    enc = loaded.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert enc[0] == ids["<|im_start|>"] and ids["<|im_end|>"] in enc
    assert enc[-4:-2] == [ids["<think>"], enc[-1]] or ids["</think>"] in enc  # the empty think block
    thinking = loaded.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False,
                                                    add_generation_prompt=True, enable_thinking=True)
    assert "<think>" not in thinking and thinking.endswith("<|im_start|>assistant\n")


def test_real_shape_run_validates_and_a_random_drafter_has_tau_about_one(shape):
    rc, r = run(shape, shape.tmp / "run.json", "--validate", "--cache-dir", str(shape.tmp / "cache"))
    assert rc == 0, r and r["diagnostics"]
    v = r["validation"]
    assert v["ok"] and v["steps_checked"] == r["tau"]["num_steps"] > 0 and not v["reference_differs_from_loop"]
    assert 1.0 <= r["tau"]["macro"] <= 1.25  # a random drafter almost never guesses a 150k+ vocabulary
    assert r["settings"]["layer_ids"] == [1, 2, 3, 4, 5]  # 8 layers, 5 features: spread over 1..L-3
    assert r["speedup"]["estimated"] is not None  # measured on the hybrid target too
    assert all(p["reference_agrees_with_target"] for p in r["prompts"])


@pytest.mark.slow  # ~10-25 s: CI's slow pass (the default suite stays under 10 min on 2 cores)
def test_real_shape_one_weight_edit_rebuilds_the_caches(shape):
    d = shape.tmp / "edited"
    shutil.copytree(shape.dir, d)
    cache = str(shape.tmp / "edit-cache")
    quick = ("--cost-ratio", "0.1", "--cache-dir", cache)  # no speed measurement: not what this test is about
    rc, first = run(shape, shape.tmp / "a.json", *quick, target=d)
    rc2, warm = run(shape, shape.tmp / "b.json", *quick, target=d)
    assert rc == rc2 == 0 and warm["cache"]["references"] == "hit" and warm["cache"]["features"] == "hit"
    model = Target.load(d).model
    with torch.no_grad():
        model.get_output_embeddings().weight[98765, 17] += 1  # one LM-head element no sample held
    model.save_pretrained(d)
    rc3, edited = run(shape, shape.tmp / "c.json", *quick, target=d)
    assert rc3 == 0 and edited["cache"]["references"] == "rebuilt" and edited["cache"]["features"] == "rebuilt"
    assert edited["target"]["fingerprint"] != first["target"]["fingerprint"]


@pytest.mark.slow  # ~10-25 s: CI's slow pass (the default suite stays under 10 min on 2 cores)
def test_real_shape_server_references(shape):
    """A server answering with the target's greedy ids is used; one that re-tokenizes its text fails the job."""
    tok, target = shape.target.tokenizer, shape.target

    def right(body):
        return 200, {"choices": [{"token_ids": greedy_generate(target, body["prompt"], body["max_tokens"])}]}

    def retokenized(body):  # decodes its output and encodes the text again: not the target's ids
        ids = greedy_generate(target, body["prompt"], body["max_tokens"])
        return 200, {"choices": [{"token_ids": tok(tok.decode(ids), add_special_tokens=False)["input_ids"]}]}

    with CannedServer(right) as srv:
        rc, r = run(shape, shape.tmp / "srv.json", "--reference-server", srv.url, "--validate", "--no-cache",
                    "--cost-ratio", "0.1")
    assert rc == 0 and r["validation"]["ok"] and r["settings"]["reference_source"] == f"server:{srv.url}"
    ids = greedy_generate(target, [1, 2, 3], MAX_NEW)
    assert tok(tok.decode(ids), add_special_tokens=False)["input_ids"] != ids  # the premise: text loses the ids
    cache = shape.tmp / "srv-cache"
    with CannedServer(retokenized) as srv:
        rc, r = run(shape, shape.tmp / "bad.json", "--reference-server", srv.url, "--cache-dir", str(cache),
                    "--cost-ratio", "0.1")
    assert rc == 2 and r is None
    assert not [p for p in cache.rglob("*") if p.is_file()]  # nothing cached from the failed job


def test_large_vocab_references_never_build_sequence_by_vocab_logits(shape):
    """The LM head only ever sees a last position while references are made (memory flat in vocab)."""
    from eval_worker.engine.references import LocalReferences

    rows = []
    hook = shape.target.parts.lm_head.register_forward_hook(
        lambda _m, inputs, _o: rows.append(inputs[0].reshape(-1, inputs[0].shape[-1]).shape[0]))
    try:
        ref = LocalReferences(shape.target).generate("p", list(range(1000, 1300)), 6, None, lookahead=7)
    finally:
        hook.remove()
    assert len(ref.tokens) == 6 and len(ref.lookahead) == 7
    assert rows and max(rows) == 1  # 300-token prompt: [300, vocab] logits would be 180-300 MB here
