"""Target fingerprint: every weight byte and every output-shaping file, never stale."""
import json
import os
import time

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dflash_train.core.fingerprint import RACY_S, FileDigests, identity_files, tensor_digest
from dflash_train.core.target import Target
from tests.support.factories import qwen3_target


@pytest.fixture
def no_racy_window(monkeypatch):
    """Files written by the test are seconds old at most; a real model store's are older.
    (ctime cannot be set back, so the window itself is closed instead.)"""
    monkeypatch.setattr("dflash_train.core.fingerprint.RACY_S", 0.0)


def _age(directory, seconds=3 * RACY_S):
    """Old modification times: the fingerprint must not trust them (ctime still moves)."""
    old = time.time() - seconds
    for p in directory.iterdir():
        os.utime(p, (old, old))


def _saved(model, directory):
    model.save_pretrained(directory)
    return directory


def test_fingerprint_large_vocab_tensor_over_2_pow_24_elements():
    """The embedding of a vocab-151,936 model has 19.4M elements (> 2^24): the old sampled
    fingerprint crashed there (float32 linspace). Every element counts, the last one included."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen3Config(vocab_size=151936, hidden_size=128, intermediate_size=256, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=64, tie_word_embeddings=False)
    model = Qwen3ForCausalLM(cfg)
    emb = model.model.embed_tokens.weight
    assert emb.numel() > 2 ** 24
    a = Target(model).fingerprint()
    assert a == Target(model).fingerprint()
    with torch.no_grad():
        emb.view(-1)[-1] += 1  # the very last element
    assert Target(model).fingerprint() != a


def test_fingerprint_single_element_edit_in_lm_head_of_saved_large_vocab_target(tmp_path):
    """The before-stop check: one LM-head element that no sample would hold, saved, reloaded."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    model = Qwen3ForCausalLM(Qwen3Config(vocab_size=151936, hidden_size=128, intermediate_size=256,
                                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                         head_dim=64, tie_word_embeddings=False))
    d = _saved(model, tmp_path / "t")
    a = Target.load(d).fingerprint()
    with torch.no_grad():
        model.lm_head.weight[98765, 17] += 1
    model.save_pretrained(d)
    assert Target.load(d).fingerprint() != a


_SMALL = qwen3_target(layers=2, hidden=16, seed=3)
_NAMES = sorted(_SMALL.model.state_dict())


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.sampled_from(_NAMES), where=st.floats(0, 1, exclude_max=True), delta=st.sampled_from([1e-6, -1.0, 3.0]))
def test_fingerprint_single_element_edit_anywhere_in_any_weight(tmp_path_factory, no_racy_window, name, where, delta):
    d = tmp_path_factory.mktemp("fp")
    model = _SMALL.model
    _saved(model, d)
    _age(d)
    before = Target.load(d).fingerprint()
    t = model.state_dict()[name]
    i = int(where * t.numel())
    old = t.view(-1)[i].item()
    try:
        with torch.no_grad():
            t.view(-1)[i] = old + delta
        assert t.view(-1)[i].item() != old
        model.save_pretrained(d)
        _age(d)  # even with old-looking timestamps (mtime restored), the new bytes are seen
        assert Target.load(d).fingerprint() != before
        assert tensor_digest(sorted(model.state_dict().items())) != tensor_digest(
            sorted(qwen3_target(layers=2, hidden=16, seed=3).model.state_dict().items()))
    finally:
        with torch.no_grad():
            t.view(-1)[i] = old


def test_fingerprint_covers_config_tokenizer_template_and_generation_config(tmp_path):
    d = _saved(_SMALL.model, tmp_path / "t")
    (d / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 512}))
    (d / "chat_template.jinja").write_text("{{ messages[0]['content'] }}")
    (d / "README.md").write_text("docs")
    names = {p.name for p in identity_files(d)}
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer_config.json",
            "chat_template.jinja"} <= names and "README.md" not in names
    base = Target.load(d).fingerprint()
    (d / "README.md").write_text("other docs")  # documentation does not change outputs
    assert Target.load(d).fingerprint() == base
    for name, edit in [("chat_template.jinja", lambda s: s + " "),
                       ("generation_config.json", lambda s: s.replace("}", ', "top_k": 3}', 1)),
                       ("tokenizer_config.json", lambda s: s.replace("512", "513")),
                       ("config.json", lambda s: s.replace('"rms_norm_eps"', '"unused_key": 1, "rms_norm_eps"'))]:
        p = d / name
        old = p.read_text()
        p.write_text(edit(old))
        assert Target.load(d).fingerprint() != base, name
        p.write_text(old)
    assert Target.load(d).fingerprint() == base


def test_fingerprint_follows_the_loaded_dtype(tmp_path):
    d = _saved(_SMALL.model, tmp_path / "t")
    assert Target.load(d).fingerprint() != Target.load(d, dtype="float64").fingerprint()


def test_fingerprint_file_digests_are_read_once_per_file_version(tmp_path, no_racy_window):
    d = _saved(_SMALL.model, tmp_path / "t")
    size = sum(p.stat().st_size for p in identity_files(d))
    first, second = FileDigests(tmp_path / "digests"), FileDigests(tmp_path / "digests")
    a = first.directory_digest(d)
    assert first.hashed_bytes == size
    assert second.directory_digest(d) == a and second.hashed_bytes == 0  # another process: from disk
    w = d / "model.safetensors"
    data = bytearray(w.read_bytes())
    data[-1] ^= 1  # same size, and the old mtime restored: ctime still moves
    st = w.stat()
    w.write_bytes(bytes(data))
    os.utime(w, ns=(st.st_atime_ns, st.st_mtime_ns))
    third = FileDigests(tmp_path / "digests")
    assert third.directory_digest(d) != a and third.hashed_bytes == w.stat().st_size


def test_fingerprint_fresh_files_are_not_remembered(tmp_path):
    """A file written within the racy window may change again inside one timestamp tick."""
    d = _saved(_SMALL.model, tmp_path / "t")
    digests = FileDigests(tmp_path / "digests")
    digests.directory_digest(d)
    again = FileDigests(tmp_path / "digests")
    again.directory_digest(d)
    assert again.hashed_bytes > 0 and not any((tmp_path / "digests").glob("*.json"))
