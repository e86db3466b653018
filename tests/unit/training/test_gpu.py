"""CUDA paths of the trainer (skipped without a GPU): stream/event queue safety, flex == SDPA training."""
import copy

import pytest
import torch

from dflash_train.training.hidden_queue import HiddenStateQueue
from dflash_train.training.trainer import Trainer
from tests.support.factories import MASK_ID
from tests.support.train_helpers import small_config, target_and_examples

pytestmark = pytest.mark.gpu


def test_cuda_slot_is_not_overwritten_while_the_consumer_kernels_read_it():
    dev = torch.device("cuda")

    def buffers():
        return {"x": torch.zeros(1024, 1024, device=dev)}

    def fill(slot, item):
        slot["x"].fill_(float(item))  # on the producer stream
        slot.meta = item

    q = HiddenStateQueue(range(30), buffers, fill, depth=2, device=dev)
    for slot in q:
        x = slot["x"]
        acc = torch.zeros((), device=dev)
        for _ in range(20):  # long-running reads queued on the consumer stream
            acc = acc + (x @ x).mean() / (1024 * max(slot.meta, 1) ** 2)
        first, last = float(x[0, 0]), float(x[-1, -1])
        q.release(slot)
        assert first == last == slot.meta
        if slot.meta:
            assert abs(float(acc) / 20 - 1.0) < 1e-3  # every read saw this slot's value, not the next fill's
    q.close()


def test_flex_training_matches_sdpa_and_queue_depths_agree(tmp_path):
    shared, examples = target_and_examples()
    target = copy.deepcopy(shared)  # the cached CPU target stays on the CPU for other tests
    target.model.to("cuda")
    losses = {}
    for backend, depth in (("sdpa", 0), ("flex", 0), ("flex", 2)):
        cfg = small_config(tmp_path / f"{backend}{depth}", device="cuda", backend=backend, queue_depth=depth,
                           autocast="off", mask_token_id=MASK_ID)
        losses[(backend, depth)] = Trainer(cfg, target=target, examples=list(examples)).train().losses
    for a, b in zip(losses[("sdpa", 0)], losses[("flex", 0)], strict=False):
        assert abs(a - b) < 1e-3 * max(abs(a), 1)
    for a, b in zip(losses[("flex", 0)], losses[("flex", 2)], strict=False):
        assert abs(a - b) < 1e-5 * max(abs(a), 1)
