"""Targets and suites as users name them: a Hub model id as --target (huggingface_hub's cache, offline
mode honoured), z-lab / DeepSpec benchmark JSONL (`{"turns": [...]}`) as suites, and dflash-train's
quick-eval knobs with --eval-suite checked at start-up."""
from __future__ import annotations

import json
import shutil

import pytest

from dflash_train.checkpoints.hub import resolve_target
from dflash_train.checkpoints.publication import CheckpointError
from dflash_train.common.settings import Settings
from dflash_train.training.cli import main as train_main
from dflash_train.training.train_config import load_config
from eval_worker.cli import main as cli
from eval_worker.engine.suite import SuiteError, check_suite_spec, load_suite
from eval_worker.redis_client import connect
from eval_worker.service.queueing.queue import get_queue
from hooks.eval_flags import eval_hook
from tests.integration.test_sidecar_worker import _target
from tests.support.sidecar_support import publish_random, tiny_target_drafter_config

COMMIT = "89abcdef0123456789abcdef0123456789abcdef"


@pytest.fixture
def hub_target(tmp_path, monkeypatch):
    """An offline Hugging Face cache holding the bundled tiny target as `org/tiny` (branch main)."""
    from huggingface_hub import constants

    cache = tmp_path / "hf-cache"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    repo = cache / "models--org--tiny"
    shutil.copytree(_target(), repo / "snapshots" / COMMIT)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    return repo / "snapshots" / COMMIT


def test_target_hub_model_id_resolved_offline_and_evaluated(hub_target, tmp_path, redis_url, capsys):
    snap = str(hub_target.resolve())
    assert resolve_target("org/tiny") == snap and resolve_target("hf://org/tiny@main") == snap
    assert resolve_target(str(tmp_path)) == str(tmp_path)  # a directory stays a directory
    with pytest.raises(CheckpointError, match="not in the Hugging Face cache"):
        resolve_target("org/absent")
    cfg, mask = tiny_target_drafter_config(_target())
    ck = publish_random(tmp_path / "ckpts", "r", 1, target_config=cfg, mask_token_id=mask, seed=3)
    # the job carries the snapshot directory (one commit): the worker reads the same bytes
    assert cli(["enqueue", str(ck), "--target", "org/tiny", "--redis-url", redis_url, "--checkpoint-root",
                str(tmp_path), "--json"]) == 0
    job = get_queue(connect(redis_url), "dflash-eval").jobs[0].args[0]
    assert job["target"] == snap
    # and `run` evaluates against it
    capsys.readouterr()
    assert cli(["run", "--checkpoint", str(ck), "--target", "org/tiny", "--num-prompts", "1", "--max-new-tokens",
                "8", "--tree-budget", "0", "--no-cache", "--no-progress", "--json", str(tmp_path / "r.json")]) == 0
    out = json.loads((tmp_path / "r.json").read_text())
    result = out["results"][0] if "results" in out else out
    assert result["target"]["path"] == snap
    assert cli(["enqueue", str(ck), "--target", "org/absent", "--redis-url", redis_url]) == 2
    assert "not in the Hugging Face cache" in capsys.readouterr().err


def test_suites_zlab_and_deepspec_jsonl_first_turn(tmp_path):
    zlab = tmp_path / "cache" / "gsm8k.jsonl"
    zlab.parent.mkdir()
    zlab.write_text("\n".join(json.dumps({"turns": [f"Question {i}: what is {i} + {i}?"]}) for i in range(3)) + "\n")
    deepspec = tmp_path / "eval_datasets" / "mt-bench.jsonl"
    deepspec.parent.mkdir()
    deepspec.write_text(json.dumps({"turns": ["Write a poem.", "Now shorten it."], "category": "writing"}) + "\n"
                        + json.dumps({"turns": ["Explain TCP.", "And UDP?"]}) + "\n")
    s = load_suite(str(zlab))
    assert s.name == "gsm8k"
    assert [p.prompt for p in s.prompts] == [f"Question {i}: what is {i} + {i}?" for i in range(3)]
    assert s.chat_template and s.chat_template_kwargs == {"enable_thinking": False}  # as their evaluators run
    d = load_suite(str(deepspec))
    assert [p.prompt for p in d.prompts] == ["Write a poem.", "Explain TCP."]  # the first turn only
    bad = tmp_path / "bad.jsonl"
    for row, message in (({"turns": []}, "'turns' must be a non-empty list"),
                         ({"turns": ["x"], "prompt": "y"}, "exactly one of")):
        bad.write_text(json.dumps(row) + "\n")
        with pytest.raises(SuiteError, match=message):
            load_suite(str(bad))


def test_train_quick_eval_knobs_and_eval_suite_checked_at_start(tmp_path, capsys):
    assert train_main(["--config", "demo", "--eval-every", "5", "--eval-num-prompts", "4",
                       "--eval-max-new-tokens", "32", "--print-config"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["eval_num_prompts"] == 4 and out["eval_max_new_tokens"] == 32
    config = load_config("demo", {"eval_every": 5, "eval_num_prompts": 4, "eval_max_new_tokens": 32})
    hook = eval_hook(config, Settings.from_env(), None)
    assert hook.request.options == {"num_prompts": 4, "max_new_tokens": 32}
    assert eval_hook(config, Settings.from_env(), None, options={"tree_budget": 0}).request.options == {
        "num_prompts": 4, "max_new_tokens": 32, "tree_budget": 0}
    assert train_main(["--config", "demo", "--eval-every", "5", "--eval-num-prompts", "0", "--print-config"]) == 2
    assert "eval_num_prompts must be >= 1" in capsys.readouterr().err
    # a misspelt suite stops the run before it trains (no target is loaded: the check comes first)
    for spec, message in (("builtin:codng", "no built-in suite 'codng'"), ("hf:gsm9k", "gsm9k")):
        assert train_main(["--config", "demo", "--eval-every", "5", "--eval-suite", spec,
                           "--checkpoint-root", str(tmp_path / "ck"), "--target", str(tmp_path / "no-target")]) == 2
        assert message in capsys.readouterr().err
    assert check_suite_spec(str(tmp_path / "only-on-the-worker.jsonl")).endswith("must be able to read it")
    assert check_suite_spec("builtin:coding-v1") is None and check_suite_spec("hf:gsm8k:n=8") is None
