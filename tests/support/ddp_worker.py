"""One rank of the 2-process DDP test (run by torchrun from tests/unit/training/test_ddp.py)."""
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
torch.set_num_threads(1)

from dflash_train.training import distributed as dist_util  # noqa: E402
from dflash_train.training.trainer import Trainer  # noqa: E402
from tests.support.train_helpers import small_config, target_and_examples  # noqa: E402


def main(out: str) -> None:
    info = dist_util.init_distributed("cpu")
    target, examples = target_and_examples()
    cfg = small_config(Path(out), **json.loads(sys.argv[2]))
    trainer = Trainer(cfg, target=target, examples=list(examples), dist_info=info)
    summary = trainer.train()
    torch.save({k: v.clone() for k, v in trainer.drafter.state_dict().items()}, Path(out) / f"rank{info.rank}.pt")
    (Path(out) / f"rank{info.rank}.json").write_text(json.dumps({"losses": summary.losses, "step": summary.step,
                                                                 "checkpoints": summary.checkpoints}))
    trainer.close()  # before the group goes (see Trainer.close)
    dist_util.shutdown(info)


if __name__ == "__main__":
    main(sys.argv[1])
