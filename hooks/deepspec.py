"""A drop-in for DeepSpec's empty `BaseTrainer._launch_eval` (rank 0, after each save):

    from hooks.deepspec import launch_eval
    def _launch_eval(self, *args): return launch_eval(*args)      # in DeepSpec's trainer/base_trainer.py

It converts `checkpoint_dir` (DeepSpec's `step_N/`: save_pretrained output, DSpark config read as a
DFlash drafter) into a checkpoint under `$DFLASH_CHECKPOINT_ROOTS` (so DeepSpec's own retention may
delete `step_N/` before the eval runs) and posts its eval through the `JobClient`, run id = `exp_name`:
written to the run's outbox first, then queued on `$REDIS_URL`. Redis away: the job waits in the
outbox and goes out with the next checkpoint's (or `dflash-eval enqueue --outbox DIR`).
It never raises into training: a failure is printed and returned.
"""
from __future__ import annotations

from pathlib import Path


def launch_eval(target_model_name_or_path, checkpoint_dir, step, tensorboard_dir=None, exp_name=None, *,
                into: str | None = None, suite: str = "builtin:coding-v1", redis_url: str | None = None,
                queue: str = "dflash-eval") -> str:
    """Import `checkpoint_dir` and queue its eval; returns the line it printed."""
    try:
        from dflash_train.checkpoints.hub import resolve_target
        from dflash_train.checkpoints.location import first_local_root
        from dflash_train.checkpoints.publication import run_id_from
        from dflash_train.checkpoints.training_state import import_checkpoint
        from dflash_train.common.settings import Settings
        from eval_worker.service.jobs.request import EvalRequest
        from eval_worker.service.queueing.client import JobClient
        from eval_worker.service.queueing.queue import QueueConfig

        settings = Settings.from_env()
        roots = settings.checkpoint_roots
        # converted into a local root: a store prefix among the roots is read by workers, not written here
        record_root = into or first_local_root(roots)
        if record_root is None:
            raise ValueError("set $DFLASH_CHECKPOINT_ROOTS (a local directory among them) or pass into= for the "
                             "converted checkpoints")
        run = run_id_from(str(exp_name or Path(checkpoint_dir).parent.name), default="deepspec")
        record, _, _ = import_checkpoint(record_root, run, int(step), checkpoint_dir,
                                         config=Path(checkpoint_dir) / "config.json")
        target = resolve_target(str(target_model_name_or_path)) if target_model_name_or_path else None
        (job,) = EvalRequest.of(suites=suite, target=target, requested_by="hook").jobs(record, roots=roots)
        client = JobClient(redis_url, config=QueueConfig(base=queue), roots=roots, settings=settings)
        try:
            [receipt] = client.post([job])
        finally:
            client.close()
        line = f"[dflash-eval] step {step}: {receipt.status} {receipt.job_id} ({record})"
        if not receipt.taken:
            line += f": {receipt.message}"
    except Exception as e:  # noqa: BLE001 - training goes on; the eval can be queued later (dflash-eval watch)
        line = f"[dflash-eval] step {step}: eval not queued: {type(e).__name__}: {e}"
    print(line, flush=True)
    return line
