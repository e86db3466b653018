"""The Hugging Face `TrainerCallback` adapter inside a real `transformers.Trainer` run."""
from __future__ import annotations

import torch
from torch import nn

from dflash_train.checkpoints.checkpoint import load_drafter
from dflash_train.checkpoints.publication import list_checkpoints, read_manifest, verify_checkpoint
from eval_worker.redis_client import connect
from eval_worker.service.queueing.queue import get_queue
from hooks import DFlashEvalCallback
from tests.support.factories import drafter_for, qwen3_target
from tests.support.sidecar_support import publish_random


class DrafterWrapper(nn.Module):
    """Stands for a user's HF training model that holds the drafter as `.drafter`."""

    def __init__(self, drafter):
        super().__init__()
        self.drafter = drafter

    def forward(self, x=None, labels=None):
        w = self.drafter.fc.weight
        loss = ((w.sum(dim=1)[: x.shape[1]] * x).mean() - 1.0) ** 2
        return {"loss": loss}


class Rows(torch.utils.data.Dataset):
    def __len__(self):
        return 64

    def __getitem__(self, i):
        g = torch.Generator().manual_seed(i)
        return {"x": torch.randn(8, generator=g)}


def test_on_save_publishes_the_drafter_and_queues_its_eval(tmp_path, redis_url, capfd):
    from transformers import Trainer, TrainingArguments

    drafter = drafter_for(qwen3_target(layers=6, hidden=32), layers=1, features=2)
    model = DrafterWrapper(drafter)
    cb = DFlashEvalCallback(tmp_path / "ckpts", run_id="hf-run", every_n_steps=2, suite="builtin:coding-v1",
                            redis_url=redis_url)
    args = TrainingArguments(output_dir=str(tmp_path / "hf"), max_steps=5, save_strategy="steps", save_steps=2,
                             per_device_train_batch_size=2, learning_rate=1e-2, report_to=[], use_cpu=True,
                             logging_steps=1, disable_tqdm=True, dataloader_num_workers=0)
    Trainer(model=model, args=args, train_dataset=Rows(), callbacks=[cb]).train()

    published = list_checkpoints(tmp_path / "ckpts" / "hf-run")
    assert [read_manifest(p)["step"] for p in published] == [2, 4]
    for p in published:
        verify_checkpoint(p)  # complete, digests match
    assert "loss" in read_manifest(published[-1])["train_metrics"]
    # the step-4 checkpoint is the drafter as it was at step 4 (the snapshot, not later weights)
    saved = load_drafter(published[-1])
    assert saved.config.to_dict() == drafter.config.to_dict()
    assert not torch.equal(saved.fc.weight, drafter.fc.weight)  # training went on to step 5 afterwards
    conn = connect(redis_url)
    jobs = get_queue(conn, "dflash-eval").jobs
    assert sorted(j.args[0]["step"] for j in jobs) == [2, 4]
    assert {j.args[0]["requested_by"] for j in jobs} == {"hook"} and not cb.errors and not cb.hook.errors
    conn.close()
    queued = [line for line in capfd.readouterr().out.splitlines() if line.startswith("[dflash-eval] step")]
    assert [line.split(":")[0] for line in queued] == ["[dflash-eval] step 2", "[dflash-eval] step 4"]  # one each


class SpecForgeStyleDraft(nn.Module):
    """Another trainer's drafter module: our tensor names, a transformers config, not our class."""

    def __init__(self, drafter):
        super().__init__()
        import copy

        from transformers import Qwen3Config

        self.config = Qwen3Config(**drafter.config.to_dict())
        for name in ("layers", "fc", "hidden_norm", "norm"):
            setattr(self, name, copy.deepcopy(getattr(drafter, name)))


class SpecForgeStyleModel(nn.Module):
    def __init__(self, drafter):
        super().__init__()
        self.draft_model = SpecForgeStyleDraft(drafter)

    def forward(self, x=None, labels=None):
        w = self.draft_model.fc.weight
        return {"loss": ((w.sum(dim=1)[: x.shape[1]] * x).mean() - 1.0) ** 2}


def _hf_args(tmp_path, **kw):
    from transformers import TrainingArguments

    return TrainingArguments(**{**dict(output_dir=str(tmp_path / "hf"), max_steps=4, save_strategy="steps",
                                       save_steps=2, per_device_train_batch_size=2, learning_rate=1e-2, report_to=[],
                                       use_cpu=True, logging_steps=1, disable_tqdm=True, dataloader_num_workers=0),
                                **kw})


def test_a_model_without_our_drafter_fails_before_training(tmp_path, redis_url):
    import pytest
    from transformers import Trainer

    from hooks.hf_callback import DrafterNotFound

    model = SpecForgeStyleModel(drafter_for(qwen3_target(layers=6, hidden=32), layers=1, features=2))
    before = model.draft_model.fc.weight.detach().clone()
    cb = DFlashEvalCallback(tmp_path / "ckpts", run_id="sf", every_n_steps=2, redis_url=redis_url)
    trainer = Trainer(model=model, args=_hf_args(tmp_path), train_dataset=Rows(), callbacks=[cb])
    with pytest.raises(DrafterNotFound, match="drafter_getter"):
        trainer.train()
    assert trainer.state.global_step == 0 and torch.equal(model.draft_model.fc.weight, before)  # not one step
    assert not (tmp_path / "ckpts" / "sf").exists()
    # the first on_save raises too (a callback that missed on_train_begin), not a logged warning
    with pytest.raises(DrafterNotFound, match="drafter_getter"):
        cb.on_save(trainer.args, type("S", (), {"global_step": 2, "is_world_process_zero": True})(), None,
                   model=model)
    assert not cb.errors
    bad = DFlashEvalCallback(tmp_path / "ckpts", run_id="sf", drafter_getter=lambda m: m.draft_model,
                             redis_url=redis_url)
    with pytest.raises(DrafterNotFound, match="SpecForgeStyleDraft, not a dflash_train.core.model.DFlashDrafter"):
        Trainer(model=model, args=_hf_args(tmp_path), train_dataset=Rows(), callbacks=[bad]).train()


def test_another_trainers_module_is_published_through_drafter_from_module(tmp_path, redis_url):
    from transformers import Trainer

    from hooks.hf_callback import drafter_from_module

    model = SpecForgeStyleModel(drafter_for(qwen3_target(layers=6, hidden=32), layers=1, features=2))
    cb = DFlashEvalCallback(tmp_path / "ckpts", run_id="sf", every_n_steps=2, redis_url=redis_url,
                            drafter_getter=lambda m: drafter_from_module(m.draft_model))
    Trainer(model=model, args=_hf_args(tmp_path, max_steps=2), train_dataset=Rows(), callbacks=[cb]).train()
    [published] = list_checkpoints(tmp_path / "ckpts" / "sf")
    saved = load_drafter(published)
    theirs = model.draft_model.state_dict()
    assert saved.state_dict().keys() == theirs.keys()
    assert all(torch.equal(saved.state_dict()[k], v) for k, v in theirs.items())  # step 2 = the last step
    assert not cb.errors and not cb.hook.errors


def test_evals_join_the_hf_wandb_run(tmp_path, redis_url, wandb_offline):
    import wandb

    drafter = drafter_for(qwen3_target(layers=6, hidden=32), layers=1, features=2)
    run = wandb.init(project="hf-proj", group="exp-7", mode="offline", dir=str(tmp_path))
    try:
        cb = DFlashEvalCallback(tmp_path / "ckpts", every_n_steps=1, redis_url=redis_url)
        state = type("S", (), {"global_step": 0, "is_world_process_zero": True})()
        cb.on_train_begin(_hf_args(tmp_path, report_to=["wandb"], run_name="my-run"), state, None,
                          model=DrafterWrapper(drafter))
        assert cb.run_id == "my-run"
        assert cb.hook.request.wandb == {"project": "hf-proj", "entity": None, "mode": "offline", "group": "exp-7"}
        job = cb.hook.make_job(publish_random(tmp_path / "ckpts", "my-run", 1), suite="builtin:coding-v1")
        assert job.wandb is not None and (job.wandb.group, job.wandb.project) == ("exp-7", "hf-proj")
    finally:
        run.finish()
    # no W&B in report_to: the job's W&B settings are left alone
    cb = DFlashEvalCallback(tmp_path / "ckpts", every_n_steps=1, redis_url=redis_url)
    cb.on_train_begin(_hf_args(tmp_path), state, None, model=DrafterWrapper(drafter))
    assert cb.hook.request.wandb is None


def test_eval_points_carry_the_hf_step_axis():
    from eval_worker.results.sinks.wandb_payload import HF_STEP_KEY, STEP_KEY, log_dict
    from tests.support.eval_results import make_result

    payload = log_dict(make_result(step=1234))
    assert payload[STEP_KEY] == payload[HF_STEP_KEY] == 1234


def test_hf_callback_publishes_to_an_s3_store(tmp_path, redis_url, s3_server):
    """`publish_to`: the HF adapter uploads each checkpoint (real S3 API, moto) and queues the URL."""
    import uuid

    from transformers import Trainer

    bucket = f"b-{uuid.uuid4().hex[:12]}"
    s3_server.make_bucket(bucket)
    drafter = drafter_for(qwen3_target(layers=6, hidden=32), layers=1, features=2)
    cb = DFlashEvalCallback(tmp_path / "ckpts", run_id="hf-s3", every_n_steps=2, suite="builtin:coding-v1",
                            redis_url=redis_url, publish_to=f"s3://{bucket}/runs", queue="dflash-eval-s3")
    Trainer(model=DrafterWrapper(drafter), args=_hf_args(tmp_path), train_dataset=Rows(), callbacks=[cb]).train()
    urls = list_checkpoints(f"s3://{bucket}/runs/hf-s3")
    assert urls == [f"s3://{bucket}/runs/hf-s3/step-0000000{s}" for s in (2, 4)]
    local = list_checkpoints(tmp_path / "ckpts" / "hf-s3")
    assert [read_manifest(u) for u in urls] == [read_manifest(p) for p in local]
    conn = connect(redis_url)
    jobs = get_queue(conn, "dflash-eval-s3").jobs
    assert sorted(j.args[0]["checkpoint"] for j in jobs) == urls and not cb.errors and not cb.hook.errors
    conn.close()


def test_mlflow_sink_nests_the_eval_run_under_the_hf_trainer_run(tmp_path, redis_url, monkeypatch):
    """A real `Trainer` with report_to=["mlflow"] (HF's MLflowCallback, a local sqlite store): the jobs
    carry the HF MLflow run as `mlflow.parent_run_id`, and the MLflow sink puts the eval run under it."""
    import pytest

    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient
    from transformers import Trainer

    from dflash_train.common.settings import Settings
    from eval_worker.results.ledger import read_record
    from eval_worker.results.sinks import publish_result
    from tests.support.eval_results import make_result, write_ledger

    monkeypatch.chdir(tmp_path)  # HF's experiment keeps its artifacts in ./mlruns (MLflow's default for sqlite)
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)  # HF's MLflowCallback and the sink: one store
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "hf-train")
    drafter = drafter_for(qwen3_target(layers=6, hidden=32), layers=1, features=2)
    cb = DFlashEvalCallback(tmp_path / "ckpts", run_id="hf-ml", every_n_steps=2, suite="builtin:coding-v1",
                            redis_url=redis_url)
    Trainer(model=DrafterWrapper(drafter), args=_hf_args(tmp_path, report_to=["mlflow"]), train_dataset=Rows(),
            callbacks=[cb]).train()
    assert not cb.errors and not cb.hook.errors
    client = MlflowClient(tracking_uri=uri)
    (hf_run,) = client.search_runs([client.get_experiment_by_name("hf-train").experiment_id])
    job = get_queue(connect(redis_url), "dflash-eval").jobs[0].args[0]
    assert job["mlflow"] == {"parent_run_id": hf_run.info.run_id}

    monkeypatch.setenv("DFLASH_SINKS", "mlflow")
    monkeypatch.setenv("DFLASH_RESULTS_DIR", str(tmp_path / "results"))
    res = make_result("hf-ml", job["step"], block_size=4)
    record = read_record(write_ledger(tmp_path / "results", res))
    outcome = publish_result(record, job, Settings.from_env())
    assert outcome["mlflow"]["ok"], outcome
    (ev,) = client.search_runs([hf_run.info.experiment_id], filter_string="tags.`dflash.train_run` = 'hf-ml'")
    assert ev.data.tags["mlflow.parentRunId"] == hf_run.info.run_id
    assert {m.step for m in client.get_metric_history(ev.info.run_id, "eval/tau")} == {job["step"]}
    assert (tmp_path / "mlruns").is_dir()  # the parent experiment's artifact root, not the repository's
