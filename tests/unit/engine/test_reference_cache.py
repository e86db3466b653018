"""The reference cache (issues 35 item 11, 37 item 4): keyed by what a reference depends on (target,
prompt, source, sampling), so a longer entry serves a shorter request, a shorter one is extended, and
`run`, the demo and the worker share one cache per DFLASH_HOME; and `run --drafting`."""
import json
import logging
from functools import cache

import pytest

from dflash_train.checkpoints.checkpoint import save_drafter
from dflash_train.common.settings import Settings
from dflash_train.core.target import Target
from eval_worker.cli import main
from eval_worker.commands.demo import worker_cache_dir
from eval_worker.engine.acceptance import Evaluator
from eval_worker.engine.suite import Prompt, Suite
from eval_worker.service.worker.evaluators import WorkerSettings, _new_evaluator
from tests.support.factories import drafter_for

TINY = "dflash_train/assets/tiny_target"
OPTS = {"measure_speed": False, "leak_probe_anchors": 0, "tree_budget": 0}


@cache
def tiny() -> Target:
    return Target.load(TINY)


def suite() -> Suite:
    tok = tiny().tokenizer
    return Suite("cachesuite", "1", [Prompt("a", ids=tuple(tok("def add(a, b):")["input_ids"])),
                                     Prompt("b", ids=tuple(tok("import os\n")["input_ids"]))],
                 chat_template=False, max_new_tokens=12)


@pytest.fixture
def ck(tmp_path):
    save_drafter(drafter_for(tiny(), block_size=4), tmp_path / "ck")
    return tmp_path / "ck"


def texts(res):
    return [(p.reference_text, p.finish, p.num_tokens) for p in res.prompts]


def test_reference_cache_prefix(tmp_path, ck):
    """Alternating --max-new-tokens N+1 and N: the longer entry serves the shorter request, nothing is rebuilt."""
    ev = Evaluator(tiny(), tmp_path / "cache")
    first = ev.evaluate(ck, suite(), options={**OPTS, "max_new_tokens": 12})
    shorter = ev.evaluate(ck, suite(), options={**OPTS, "max_new_tokens": 11})
    again = ev.evaluate(ck, suite(), options={**OPTS, "max_new_tokens": 12})
    assert first.cache["references"] == "built"
    assert shorter.cache["references"] == "hit" and again.cache["references"] == "hit"
    assert shorter.cache["notes"] == [] and again.cache["notes"] == []
    fresh = Evaluator(tiny(), None).evaluate(ck, suite(), options={**OPTS, "max_new_tokens": 11})
    assert texts(shorter) == texts(fresh) and texts(again) == texts(first)


def test_suffix_references(tmp_path, ck, caplog):
    """A longer request (more tokens, a longer lookahead) extends the stored continuation from its end: the
    same references as decoded from scratch, and the log says so."""
    ev = Evaluator(tiny(), tmp_path / "cache")
    ev.evaluate(ck, suite(), options={**OPTS, "max_new_tokens": 5})
    save_drafter(drafter_for(tiny(), block_size=8), tmp_path / "ck8")  # lookahead 3 -> 7
    with caplog.at_level(logging.INFO, logger="eval_worker.engine.acceptance"):
        longer = ev.evaluate(tmp_path / "ck8", suite(), options={**OPTS, "max_new_tokens": 12, "validate": True})
    assert longer.cache["references"] == "extended" and longer.cache["notes"] == []
    assert "CACHE_REBUILT" not in longer.diagnostic_codes()
    assert longer.validation["ok"]  # the extended lookahead is what the real loop's last step sees
    assert "extended" in caplog.text
    fresh = Evaluator(tiny(), None).evaluate(tmp_path / "ck8", suite(), options={**OPTS, "max_new_tokens": 12})
    assert texts(longer) == texts(fresh)


def test_reference_cache_shared(tmp_path, ck, monkeypatch):
    """`run`, the worker and the demo's worker read one cache per DFLASH_HOME: what `run` decoded serves the
    worker's shorter request as a hit."""
    for name in ("DFLASH_CACHE_DIR", "XDG_CACHE_HOME"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("DFLASH_HOME", str(tmp_path / "home"))
    settings = Settings.from_env()
    lines = [{"suite": "cachesuite", "version": "1", "chat_template": False, "max_new_tokens": 12}]
    lines += [{"name": p.name, "ids": list(p.ids)} for p in suite().prompts]
    (tmp_path / "suite.jsonl").write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    rc = main(["run", "--checkpoint", str(ck), "--target", TINY, "--suite", str(tmp_path / "suite.jsonl"),
               "--json", str(tmp_path / "run.json"), "--no-progress", "--tree-budget", "0", "--cost-ratio", "0.1"])
    assert rc == 0 and json.loads((tmp_path / "run.json").read_text())["cache"]["references"] == "built"
    worker = WorkerSettings.from_settings(settings)
    assert worker.cache_dir == settings.cache_dir == worker_cache_dir(settings)  # the demo's worker: the same
    ev = _new_evaluator(str(tiny().source), worker)
    res = ev.evaluate(ck, str(tmp_path / "suite.jsonl"), options={**OPTS, "max_new_tokens": 10})
    assert res.cache["references"] == "hit"


def test_run_drafting_flag(tmp_path, ck):
    out = {}
    for path in ("all", "walk"):
        rc = main(["run", "--checkpoint", str(ck), "--target", TINY, "--num-prompts", "1", "--max-new-tokens", "6",
                   "--no-cache", "--json", str(tmp_path / f"{path}.json"), "--no-progress", "--tree-budget", "0",
                   "--cost-ratio", "0.1", "--drafting", path, "--reference-drafter", "none"])
        assert rc == 0
        out[path] = json.loads((tmp_path / f"{path}.json").read_text())
        drafting = out[path]["provenance"]["drafting"]
        assert drafting["path"] == path and drafting["chosen"] == "given"
        assert out[path]["provenance"]["references"]["decoding"] == "plain"
    assert out["all"]["tau"] == out["walk"]["tau"]
    with pytest.raises(SystemExit):
        main(["run", "--checkpoint", str(ck), "--target", TINY, "--drafting", "sometimes"])
