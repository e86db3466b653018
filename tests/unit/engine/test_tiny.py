"""The engine on the bundled tiny target (a real Qwen3 LM with a real tokenizer and chat template)."""
import json

import pytest
import torch

from dflash_train.checkpoints.checkpoint import save_drafter
from dflash_train.core.config import DrafterConfig
from dflash_train.core.model import DFlashDrafter
from dflash_train.core.speculative import speculative_generate
from dflash_train.core.target import Target
from eval_worker.engine.acceptance import Evaluator
from eval_worker.engine.suite import Prompt, Suite, load_suite
from tests.support.engine_helpers import fit_drafter

MAX_NEW = 40


@pytest.fixture(scope="module")
def tiny():
    from tests.conftest import TINY_TARGET

    if not (TINY_TARGET / "config.json").is_file():
        pytest.skip(f"bundled tiny target missing: {TINY_TARGET}")
    return Target.load(TINY_TARGET)  # loaded once for the module


def new_drafter(target, block_size=16, seed=0):
    torch.manual_seed(seed)
    cfg = DrafterConfig.for_target(target.model.config, mask_token_id=target.mask_token_id(), num_hidden_layers=1,
                                   num_features=3, block_size=block_size)
    return DFlashDrafter(cfg).eval()


def test_random_drafter_gives_tau_near_one(tiny, tmp_path):
    save_drafter(new_drafter(tiny), tmp_path / "ck")
    suite = load_suite("coding").head(3)
    res = Evaluator(tiny, tmp_path / "cache").evaluate(tmp_path / "ck", suite, options={
        "max_new_tokens": MAX_NEW, "validate": True, "measure_speed": False})
    assert 1.0 <= res.tau["macro"] < 1.1
    assert "TAU_NEAR_ONE" in res.diagnostic_codes()
    assert res.validation["ok"] and res.validation["reference_differs_from_loop"] == []
    assert [p.name for p in res.prompts] == ["fizzbuzz", "binary_search", "linked_list_reverse"]
    assert all(p.reference_agrees_with_target for p in res.prompts)
    assert res.prompts[0].reference_text and res.settings["chat_template"] is True


CODE_PREFIXES = [
    "def fizzbuzz(n):\n    result = []\n    for i in range(1, n + 1):\n",
    "def binary_search(items, target):\n    lo, hi = 0, len(items) - 1\n",
    "class Node:\n    def __init__(self, value, next=None):\n",
    "import os\n\ndef walk_files(root):\n    for dirpath, dirnames, filenames in os.walk(root):\n",
]


def test_replay_equals_real_loop_on_the_tiny_target(tiny, tmp_path):
    """Prompt by prompt, step by step, with a drafter good enough for long acceptances.

    Raw code prefixes (the tiny target was trained on stdlib code) give varied references.
    """
    suite = Suite("code", "1", [Prompt(f"c{i}", prompt=t) for i, t in enumerate(CODE_PREFIXES)],
                  chat_template=False, max_new_tokens=MAX_NEW)
    prompts = suite.encode(tiny.tokenizer)
    eos = tiny.tokenizer.eos_token_id
    from dflash_train.core.speculative import greedy_generate

    seqs = [p.ids + greedy_generate(tiny, p.ids, MAX_NEW, eos_token_id=eos) for p in prompts[:2]]
    drafter = fit_drafter(tiny, new_drafter(tiny, block_size=8), seqs, [len(p.ids) for p in prompts[:2]], steps=25)
    save_drafter(drafter, tmp_path / "ck")
    res = Evaluator(tiny, tmp_path / "cache").evaluate(tmp_path / "ck", suite, options={
        "max_new_tokens": MAX_NEW, "validate": True, "measure_speed": False})
    seen = set()
    for p, pr in zip(prompts, res.prompts, strict=False):
        real = speculative_generate(tiny, drafter, p.ids, MAX_NEW, eos_token_id=eos)
        assert pr.accept_lengths == real.accept_lengths, pr.name
        seen |= set(real.accept_lengths)
    assert res.validation["ok"]
    assert max(seen) > 1 and res.tau["macro"] > 1.0  # not vacuous: some drafts do get accepted


def test_cli_run_end_to_end(tiny_target_path, tiny, tmp_path, capsys):
    from eval_worker.cli import main

    save_drafter(new_drafter(tiny), tmp_path / "ck")
    out = tmp_path / "res.json"
    argv = ["run", "--checkpoint", str(tmp_path / "ck"), "--target", str(tiny_target_path), "--suite", "coding",
            "--num-prompts", "2", "--max-new-tokens", "24", "--json", str(out), "--cache-dir", str(tmp_path / "c"),
            "--no-progress", "--baseline", str(tmp_path / "ck")]
    assert main(argv) == 0
    text = capsys.readouterr().out
    assert "τ (macro)" in text and "fizzbuzz" in text and "Δτ 0.000" in text
    d = json.loads(out.read_text())
    assert d["schema"] == "dflash-eval-result/1" and d["suite"]["num_prompts"] == 2
    assert d["baseline"]["delta_tau"] == 0
    assert main(argv) == 0  # second run: warm cache
    assert json.loads(out.read_text())["cache"] == {"references": "hit", "features": "hit", "notes": []}
    capsys.readouterr()
    assert main(argv + ["--counting", "published"]) == 0  # the counting rule: recorded, caches still serve
    d = json.loads(out.read_text())
    assert d["settings"]["counting"] == "published" and "counting=published" in capsys.readouterr().out
    assert d["cache"]["references"] == "hit"
