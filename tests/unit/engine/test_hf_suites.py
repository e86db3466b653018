"""Standard benchmark suites (`hf:`) from local dataset copies, read by `datasets` offline."""
from __future__ import annotations

import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from eval_worker.engine.suite import (
    HF_MAX_NEW_TOKENS,
    HF_SUITES,
    SuiteError,
    load_suite,
    parse_hf_spec,
    request_fingerprint,
)
from tests.support.hf_fixture import ROWS, write_all, write_repo


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    return write_all(tmp_path_factory.mktemp("hf-datasets"))


def test_gsm8k_rows_formatted_as_the_published_benchmark(hf_dir):
    s = load_suite("hf:gsm8k", hf_datasets_dir=hf_dir)
    rows = ROWS["openai/gsm8k"]
    assert s.name == "gsm8k" and len(s.prompts) == len(rows)  # every row of the test split, main config
    assert [p.prompt for p in s.prompts] == [
        r["question"] + "\nPlease reason step by step, and put your final answer within \\boxed{}." for r in rows]
    assert (s.chat_template, s.chat_template_kwargs, s.max_new_tokens) == (True, {"enable_thinking": False},
                                                                            HF_MAX_NEW_TOKENS)
    o = s.to_dict()["origin"]
    assert (o["dataset"], o["config"], o["split"], o["rows"], o["local"]) == ("openai/gsm8k", "main", "test",
                                                                              len(rows), True)
    assert o["data_fingerprint"]


@pytest.mark.parametrize("name, first", [
    ("math500", "Compute $0^2 + 0$.\nPlease reason step by step, and put your final answer within \\boxed{}."),
    ("humaneval", "Write a solution to the following problem and make sure that it passes the tests:\n```python\n"
                  "def f0(x):\n    \"\"\"Return x + 0.\"\"\"\n\n```"),
    ("mbpp", "Write a function adding 0."),
    ("mt-bench", "Write a haiku about rain."),  # the first turn
    ("alpaca", "Give three tips for staying healthy."),
])
def test_every_benchmark_reads_its_split(hf_dir, name, first):
    s = load_suite(f"hf:{name}", hf_datasets_dir=hf_dir)
    assert s.prompts[0].prompt == first and len(s.prompts) == len(ROWS[HF_SUITES[name].repo])
    if name == "alpaca":  # the input follows the instruction
        assert s.prompts[1].prompt == "Translate to French.\n\nGood morning"


@settings(max_examples=25, deadline=None)
@given(n=st.integers(1, 15), seed=st.integers(0, 2 ** 32 - 1))
def test_selection_is_the_published_shuffle(hf_dir, n, seed):
    spec = f"hf:gsm8k:n={n}:seed={seed}"
    s = load_suite(spec, hf_datasets_dir=hf_dir)
    order = list(range(len(ROWS["openai/gsm8k"])))
    if n < len(order):
        random.Random(seed).shuffle(order)
    want = [f"gsm8k-{i:05d}" for i in order[:n]]
    assert [p.name for p in s.prompts] == want  # distinct rows, the script's order, n at most the split
    assert load_suite(spec, hf_datasets_dir=hf_dir).fingerprint() == s.fingerprint()  # deterministic
    assert s.name == f"gsm8k-n{n}" + (f"-s{seed}" if seed else "")


def test_fingerprint_covers_data_selection_and_thinking(tmp_path, hf_dir):
    fps = {spec: load_suite(spec, hf_datasets_dir=hf_dir).fingerprint()
           for spec in ("hf:gsm8k", "hf:gsm8k:n=4", "hf:gsm8k:n=4:seed=1", "hf:gsm8k:thinking=on")}
    assert len(set(fps.values())) == 4
    # an identical copy elsewhere: the same suite; a changed copy: another one (not datasets' stale cache),
    # even when the change is in a row the selection leaves out
    write_repo(tmp_path, "openai/gsm8k")
    assert load_suite("hf:gsm8k", hf_datasets_dir=tmp_path).fingerprint() == fps["hf:gsm8k"]
    first = load_suite("hf:gsm8k:n=4", hf_datasets_dir=hf_dir)
    left_out = next(i for i in range(len(ROWS["openai/gsm8k"])) if f"gsm8k-{i:05d}" not in
                    {p.name for p in first.prompts})
    edited = [dict(r) for r in ROWS["openai/gsm8k"]]
    edited[left_out]["question"] = "An edited row the selection leaves out?"
    write_repo(tmp_path / "c", "openai/gsm8k", edited)
    picked = load_suite("hf:gsm8k:n=4", hf_datasets_dir=tmp_path / "c")
    assert picked.prompts == first.prompts and picked.fingerprint() != first.fingerprint()
    changed = [dict(r) for r in ROWS["openai/gsm8k"]]
    changed[3]["question"] += " Explain."
    write_repo(tmp_path / "b", "openai/gsm8k", changed)
    other = load_suite("hf:gsm8k", hf_datasets_dir=tmp_path / "b")
    assert other.prompts[3].prompt.startswith(changed[3]["question"]) and other.fingerprint() != fps["hf:gsm8k"]
    # the job-id part needs no data, and differs with the selection
    assert request_fingerprint("hf:gsm8k:n=4") != request_fingerprint("hf:gsm8k:n=5")
    assert request_fingerprint("hf:gsm8k:n=4:seed=0") == request_fingerprint("hf:gsm8k:n=4")


def test_thinking_switch_reaches_the_chat_template(hf_dir):
    from tests.support.factories import QWEN3_SPECIALS, byte_level_tokenizer

    tok = byte_level_tokenizer(tuple(QWEN3_SPECIALS.items()))
    off = load_suite("hf:gsm8k:n=1", hf_datasets_dir=hf_dir).encode(tok)[0].ids
    on = load_suite("hf:gsm8k:n=1:thinking=on", hf_datasets_dir=hf_dir).encode(tok)[0].ids
    assert "<think>\n\n</think>" in tok.decode(off) and "<think>" not in tok.decode(on)
    assert tok.decode(on).startswith("<|im_start|>user\nTom has")


def test_missing_dataset_offline_is_a_clear_error(tmp_path):
    with pytest.raises(SuiteError) as e:
        load_suite("hf:math500", hf_datasets_dir=tmp_path)  # no local copy, Hub offline, empty cache
    msg = str(e.value)
    assert "HuggingFaceH4/MATH-500" in msg and "not available offline" in msg
    assert "DFLASH_HF_DATASETS_DIR" in msg and f"no local copy at {tmp_path}" in msg


@pytest.mark.parametrize("spec, match", [
    ("hf:gsm9k", "no standard benchmark 'gsm9k'"), ("hf:gsm8k:n=0", "n must be an integer >= 1"),
    ("hf:gsm8k:n=x", "n must be"), ("hf:gsm8k:seed=3", "give n too"), ("hf:gsm8k:size=3", "KEY=VALUE"),
    ("hf:gsm8k:n=2:n=3", "given twice"), ("hf:gsm8k:thinking=maybe", "on or off"),
    ("hf:gsm8k:revision=../x", "revision must be"),
])
def test_bad_specs_are_named(spec, match):
    with pytest.raises(SuiteError, match=match):
        parse_hf_spec(spec)
    with pytest.raises(SuiteError, match=match):
        request_fingerprint(spec)


def test_canonical_spec_round_trips():
    for spec in ("hf:gsm8k", "hf:mt-bench:n=3", "hf:mbpp:n=3:seed=9:thinking=on", "hf:alpaca:revision=abc123"):
        req = parse_hf_spec(spec)
        assert parse_hf_spec(req.canonical) == req and req.canonical == spec


def test_run_evaluates_several_suites_side_by_side(tiny_target_path, hf_dir, tmp_path, monkeypatch, capsys):
    """`run --suite coding --suite hf:gsm8k:n=2`: one target load, τ per suite in the JSON and a table."""
    import json

    import torch

    from dflash_train.checkpoints.checkpoint import save_drafter
    from dflash_train.core.config import DrafterConfig
    from dflash_train.core.model import DFlashDrafter
    from dflash_train.core.target import Target
    from eval_worker.cli import main

    tiny = Target.load(tiny_target_path)
    torch.manual_seed(0)
    cfg = DrafterConfig.for_target(tiny.model.config, mask_token_id=tiny.mask_token_id(), num_hidden_layers=1,
                                   num_features=3, block_size=8)
    save_drafter(DFlashDrafter(cfg).eval(), tmp_path / "ck")
    monkeypatch.setenv("DFLASH_HF_DATASETS_DIR", str(hf_dir))
    out = tmp_path / "res.json"
    argv = ["run", "--checkpoint", str(tmp_path / "ck"), "--target", str(tiny_target_path), "--suite", "coding",
            "--suite", "hf:gsm8k:n=2", "--num-prompts", "2", "--max-new-tokens", "12", "--json", str(out),
            "--cache-dir", str(tmp_path / "c"), "--no-progress", "--tree-budget", "0"]
    assert main(argv) == 0
    doc = json.loads(out.read_text())
    assert doc["schema"] == "dflash-eval-suites/1" and list(doc["tau"]) == ["coding", "gsm8k-n2"]
    by_name = {r["suite"]["name"]: r for r in doc["results"]}
    assert all(doc["tau"][n] == by_name[n]["tau"]["macro"] for n in doc["tau"])
    g = by_name["gsm8k-n2"]
    assert g["suite"]["origin"]["dataset"] == "openai/gsm8k" and g["suite"]["num_prompts"] == 2
    assert [p["name"] for p in g["prompts"]] == [p.name for p in load_suite("hf:gsm8k:n=2",
                                                                            hf_datasets_dir=hf_dir).prompts]
    text = capsys.readouterr().out
    table = text[text.rindex("suite "):].splitlines()  # the side-by-side table closes the output
    assert [line.split()[0] for line in table[1:]] == ["coding", "gsm8k-n2"]
    assert [float(line.split()[2]) for line in table[1:]] == [pytest.approx(doc["tau"][n], abs=5e-4)
                                                              for n in ("coding", "gsm8k-n2")]
    # a dataset that is not there is refused before the target loads
    monkeypatch.setenv("DFLASH_HF_DATASETS_DIR", str(tmp_path / "empty"))
    assert main(argv[:5] + ["--suite", "hf:math500", "--no-progress"]) == 2
    assert "not available offline" in capsys.readouterr().err


def test_worker_job_on_a_standard_benchmark(hf_dir, tmp_path, monkeypatch, worker_evaluators):
    """A queued `hf:` job: canonical spec in the job, the worker reads its own dataset copy, the
    record carries the suite's dataset identity; a bad spec is refused at enqueue."""
    from dflash_train.common.settings import Settings
    from eval_worker.results.ledger import read_record
    from eval_worker.service.jobs.builder import make_job
    from eval_worker.service.jobs.confinement import check_suite
    from eval_worker.service.jobs.ids import job_fingerprint
    from eval_worker.service.jobs.schema import JobError
    from eval_worker.service.worker.eval_job import run_eval_job
    from eval_worker.service.worker.evaluators import WorkerSettings
    from tests.integration.test_sidecar_worker import _target
    from tests.support.sidecar_support import publish_random, tiny_target_drafter_config

    target = _target()
    cfg, mask = tiny_target_drafter_config(target)
    ck = publish_random(tmp_path / "ckpts", "run-h", 1, target_config=cfg, mask_token_id=mask, seed=1)
    settings = WorkerSettings(results_dir=tmp_path / "results", roots=[tmp_path / "ckpts"],
                              cache_dir=tmp_path / "cache", default_target=str(target),
                              env=Settings.from_env().replace(hf_datasets_dir=hf_dir))
    worker_evaluators(settings)
    opts = {"max_new_tokens": 8, "tree_budget": 0, "measure_speed": False}
    job = make_job(ck, suite="hf:gsm8k:n=2:seed=0", options=opts)
    assert job.suite == "hf:gsm8k:n=2"  # one spelling, one job id
    assert job_fingerprint(job) == job_fingerprint(make_job(ck, suite="hf:gsm8k:n=2", options=opts))
    assert job_fingerprint(job) != job_fingerprint(make_job(ck, suite="hf:gsm8k:n=3", options=opts))
    out = run_eval_job(job.to_json())
    suite = read_record(out["ledger_path"])["result"]["suite"]
    want = load_suite("hf:gsm8k:n=2", hf_datasets_dir=hf_dir)
    assert (suite["name"], suite["num_prompts"], suite["fingerprint"]) == ("gsm8k-n2", 2, want.fingerprint())
    assert suite["origin"]["dataset"] == "openai/gsm8k" and suite["origin"]["local"] is True
    with pytest.raises(JobError, match="no standard benchmark 'gsm9k'"):
        make_job(ck, suite="hf:gsm9k")
    with pytest.raises(JobError, match="n must be"):
        check_suite("hf:gsm8k:n=-1", None, [tmp_path])


def test_suites_command_lists_and_loads(hf_dir, tmp_path, monkeypatch, capsys):
    import json

    from eval_worker.cli import main

    assert main(["suites"]) == 0
    listing = capsys.readouterr().out
    assert all(f"hf:{n}" in listing for n in HF_SUITES) and "builtin:coding" in listing
    monkeypatch.setenv("DFLASH_HF_DATASETS_DIR", str(hf_dir))
    assert main(["suites", "hf:gsm8k:n=3", "builtin:coding", "--show", "1", "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert [d["name"] for d in shown] == ["gsm8k-n3", "coding"]
    assert shown[0]["fingerprint"] == load_suite("hf:gsm8k:n=3", hf_datasets_dir=hf_dir).fingerprint()
    assert shown[0]["origin"]["dataset"] == "openai/gsm8k" and len(shown[0]["prompts"]) == 1
    assert main(["suites", "hf:math500", "hf:gsm8k"]) == 0  # both copies are there
    monkeypatch.setenv("DFLASH_HF_DATASETS_DIR", str(tmp_path / "none"))
    assert main(["suites", "hf:gsm8k"]) == 2 and "not available offline" in capsys.readouterr().err
