"""Checks on the bundled tiny target model (dflash_train/assets/tiny_target).

Everything loads offline from the package directory; no network, fast (<20 s).
"""

from __future__ import annotations

import json
import math
import os
import re
import sysconfig
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ASSET = Path(
    os.environ.get(
        "DFLASH_TINY_TARGET_DIR",  # override to check a fresh build elsewhere
        Path(__file__).resolve().parents[3] / "dflash_train" / "assets" / "tiny_target",
    )
)


@pytest.fixture(scope="module", autouse=True)
def _threads():
    prev = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(prev)


@pytest.fixture(scope="module")
def tok():
    return transformers.AutoTokenizer.from_pretrained(ASSET, local_files_only=True)


@pytest.fixture(scope="module")
def model():
    m = transformers.AutoModelForCausalLM.from_pretrained(ASSET, dtype=torch.float32, local_files_only=True)
    return m.eval()


@pytest.fixture(scope="module")
def info():
    return json.loads((ASSET / "build_info.json").read_text())


def test_asset_files_and_size():
    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json", "build_info.json"):
        assert (ASSET / name).is_file(), name
    size = sum(p.stat().st_size for p in ASSET.rglob("*") if p.is_file())
    assert size < 20 * 1024 * 1024, size


def test_config(model, tok):
    cfg = model.config
    assert cfg.model_type == "qwen3"
    assert cfg.num_hidden_layers >= 8
    assert cfg.tie_word_embeddings
    assert cfg.vocab_size % 64 == 0 and cfg.vocab_size >= len(tok)
    assert cfg.eos_token_id == tok.eos_token_id
    assert cfg.pad_token_id == tok.pad_token_id
    assert model.dtype == torch.float32
    gc = model.generation_config
    assert gc.do_sample is False
    assert gc.eos_token_id == tok.eos_token_id


def test_mask_token_is_single_in_vocab_token(tok, model):
    mask_id = tok.mask_token_id
    assert tok.mask_token == "<|MASK|>"
    assert isinstance(mask_id, int) and 0 <= mask_id < len(tok) <= model.config.vocab_size
    assert mask_id not in (tok.eos_token_id, tok.pad_token_id)
    assert tok.encode("<|MASK|>", add_special_tokens=False) == [mask_id]
    assert tok.convert_ids_to_tokens(mask_id) == "<|MASK|>"
    assert tok.eos_token == "<|endoftext|>" and tok.pad_token_id == tok.eos_token_id
    for special in ("<|im_start|>", "<|im_end|>", "<|endoftext|>"):
        ids = tok.encode(special, add_special_tokens=False)
        assert len(ids) == 1 and ids[0] != mask_id


def _stdlib_snippets() -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    out = []
    for rel in ("textwrap.py", "json/encoder.py", "collections/__init__.py", "unicodedata.py", "string.py"):
        p = root / rel
        if p.is_file():
            out.append(p.read_text(encoding="utf-8")[:4000])
    return out


ROUNDTRIP_EXTRA = [
    "def greet(name: str) -> str:\n    return f'héllo, {name} — ✓ 日本語 🐍'\n",
    "x = {'ä': 1, 'ß': 2}\t# tabs\tand  double  spaces  \r\n\r\n\n    \n",
    "s = '\\x00\\u2028'  # escapes stay text\nclass A:\n\tpass\n",
    "",
    " leading space and trailing newlines\n\n\n",
]


@pytest.mark.parametrize("idx", range(len(ROUNDTRIP_EXTRA)))
def test_tokenizer_roundtrip_literals(tok, idx):
    s = ROUNDTRIP_EXTRA[idx]
    assert tok.decode(tok.encode(s, add_special_tokens=False)) == s


def test_tokenizer_roundtrip_stdlib(tok):
    snippets = _stdlib_snippets()
    assert snippets, "no stdlib snippets found"
    for s in snippets:
        ids = tok.encode(s, add_special_tokens=False)
        assert tok.decode(ids) == s
        assert len(ids) < len(s) / 2  # BPE actually compresses Python source


def test_chat_template(tok):
    text = tok.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def test_heldout_loss_recorded(info, model):
    loss = info["heldout_loss"]
    ln_v = math.log(model.config.vocab_size)
    assert math.isfinite(loss)
    assert 0 < loss < 0.55 * ln_v, (loss, ln_v)  # see docs/tiny_target.md for the bundled build's figure
    assert info["n_params"] == sum(p.numel() for p in model.parameters())
    assert info["special_token_ids"]["mask"] != info["special_token_ids"]["eos"]


def test_heldout_file_spot_check(info, tok, model):
    """Recompute the loss on the first 256 tokens of one held-out stdlib file."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [root / f for f in info.get("heldout_files", []) if (root / f).is_file()]
    if not files:
        pytest.skip("held-out files not present in this Python's stdlib")
    ids = tok.encode(files[0].read_text(encoding="utf-8"), add_special_tokens=False)[:256]
    x = torch.tensor([ids])
    with torch.no_grad():
        loss = model(input_ids=x, labels=x).loss.item()
    assert math.isfinite(loss) and loss < 0.65 * math.log(model.config.vocab_size)


# The built-in suite asks for code in the chat template. The target must answer it with Python that
# varies from prompt to prompt: on a collapsed reference ("#\n" repeated) τ only says that a drafter
# learned to repeat it. Thresholds, over the 28 prompts at 128 new tokens at most (most
# answers end with eos after one function of 45-108 tokens, so 8 distinct lines would fail a
# complete 6-line function):
VARIED_LINES = 6  # an answer "varies" when it has at least this many distinct non-empty lines
VARIED_SHARE = 0.8  # ... for at least this share of the prompts
ENDED_SHARE = 0.5  # answers that end (eos) like a chat answer, not run on to the token limit
MAX_COLLAPSED_SHARE = 0.1  # the engine's collapse diagnostic fires on at most this share
DISTINCT_OPENINGS_SHARE = 0.8  # answers do not all open with the same line


@pytest.fixture(scope="module")
def suite_answers():
    """Greedy answers to the built-in suite, decoded exactly as the engine makes its references."""
    from dflash_train.core.target import Target
    from eval_worker.engine.references import LocalReferences
    from eval_worker.engine.suite import load_suite

    target = Target.load(ASSET)
    suite = load_suite("builtin:coding")
    refs = LocalReferences(target)
    eos = target.tokenizer.eos_token_id
    out = {}
    for p in suite.encode(target.tokenizer):
        ref = refs.generate(p.name, p.ids, suite.max_new_tokens, eos, lookahead=0)
        out[p.name] = (ref.tokens, target.tokenizer.decode(ref.tokens, skip_special_tokens=True), ref.finish)
    return out


def _lines(text: str) -> list[str]:
    return [line.rstrip() for line in text.split("\n") if line.strip()]


@pytest.mark.slow  # ~10-25 s: CI's slow pass (the default suite stays under 10 min on 2 cores)
def test_suite_answers_vary(suite_answers):
    varied = {n for n, (_, text, _) in suite_answers.items() if len(set(_lines(text))) >= VARIED_LINES}
    assert len(varied) >= VARIED_SHARE * len(suite_answers), sorted(set(suite_answers) - varied)
    openings = [(_lines(text) or [""])[0] for _, text, _ in suite_answers.values()]
    assert len(set(openings)) >= DISTINCT_OPENINGS_SHARE * len(openings), openings
    ended = [n for n, (_, _, finish) in suite_answers.items() if finish == "eos"]
    assert len(ended) >= ENDED_SHARE * len(suite_answers), ended


@pytest.mark.slow  # ~10-25 s: CI's slow pass (the default suite stays under 10 min on 2 cores)
def test_suite_answers_do_not_collapse(suite_answers):
    from eval_worker.engine.diagnostics import reference_collapse

    collapsed = {n: reference_collapse(tokens, text) for n, (tokens, text, _) in suite_answers.items()}
    collapsed = {n: why for n, why in collapsed.items() if why}
    assert len(collapsed) <= MAX_COLLAPSED_SHARE * len(suite_answers), collapsed
    # the same check does fire on the answer the raw-source target gave ("#\n" repeated)
    tokens, _, _ = next(iter(suite_answers.values()))
    assert reference_collapse([tokens[0], tokens[1]] * 64, "#\n" * 64) is not None


@pytest.mark.slow  # ~10-25 s: CI's slow pass (the default suite stays under 10 min on 2 cores)
def test_suite_answers_look_like_python(suite_answers):
    pythonish = [n for n, (_, text, _) in suite_answers.items()
                 if re.search(r"^\s*(def|class|return|if|for|import|from)\b", text, re.M)]
    assert len(pythonish) >= VARIED_SHARE * len(suite_answers), sorted(set(suite_answers) - set(pythonish))


def test_heldout_source_continues_as_python(info, tok, model):
    """Raw source stays in distribution after the chat stage: held-out files (never trained on)
    continue with indented code lines, for at least 40% of them (random weights: none)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [root / f for f in info.get("heldout_files", []) if (root / f).is_file()]
    if len(files) < 5:
        pytest.skip("held-out files not present in this Python's stdlib")
    good = []
    for f in files:
        text = f.read_text(encoding="utf-8")
        cut = text.find("\ndef ")
        prefix = text[: cut + 1 if cut > 0 else 600] + ("def " if cut > 0 else "")
        ids = tok.encode(prefix, add_special_tokens=False)[-192:]
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=48, do_sample=False, pad_token_id=tok.pad_token_id)
        completion = tok.decode(out[0, len(ids):], skip_special_tokens=True)
        if re.search(r"\n[ \t]+\S", completion) and re.search(r"\b(return|if|for|self|def|in|not)\b", completion):
            good.append(f.name)
    assert len(good) >= 0.4 * len(files), (good, [f.name for f in files])
