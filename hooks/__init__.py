"""Training-side eval hooks: queue acceptance evals of published DFlash checkpoints.

- `EvalOnCheckpoint`: callback for the dflash_train trainer (on_checkpoint_published).
- `DFlashEvalCallback`: Hugging Face `TrainerCallback` adapter (on_save); imported lazily
  so that using `EvalOnCheckpoint` does not import transformers' trainer machinery.
- `Outbox`: the durable local job outbox next to the checkpoints.
"""
from eval_worker.service.queueing.outbox import Outbox

from .eval_on_checkpoint import EvalOnCheckpoint

__all__ = ["EvalOnCheckpoint", "DFlashEvalCallback", "Outbox"]


def __getattr__(name):
    if name == "DFlashEvalCallback":
        from .hf_callback import DFlashEvalCallback

        return DFlashEvalCallback
    raise AttributeError(f"module 'hooks' has no attribute {name!r}")
