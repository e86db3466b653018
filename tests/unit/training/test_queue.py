"""The hidden-state queue: buffer reuse safety, order, errors, and depth 0 == depth 2 training."""
import threading
import time

import pytest
import torch

from dflash_train.training.hidden_queue import HiddenStateQueue
from dflash_train.training.trainer import Trainer
from tests.support.train_helpers import small_config, target_and_examples

SHAPE = (4, 256)


def _buffers():
    return {"x": torch.zeros(SHAPE), "tag": torch.zeros((), dtype=torch.long)}


def _fill(slot, item):
    # fast producer, written piecewise so a concurrent overwrite would tear the slot
    for r in range(SHAPE[0]):
        slot["x"][r].fill_(float(item * 10 + r))
    slot["tag"].fill_(item)
    slot.meta = item


def test_a_slot_is_never_overwritten_while_the_consumer_holds_it():
    """Slow consumer, fast producer: the slot's content at release equals its content at take."""
    q = HiddenStateQueue(range(40), _buffers, _fill, depth=2)
    seen = []
    for slot in q:
        at_take = slot["x"].clone()
        assert int(slot["tag"]) == slot.meta
        time.sleep(0.01)  # the producer has ample time to (wrongly) refill this slot
        assert torch.equal(slot["x"], at_take), "slot overwritten while in use"
        assert torch.equal(at_take[:, 0], torch.arange(4.0) + slot.meta * 10)
        seen.append(slot.meta)
        q.release(slot)
    q.close()
    assert seen == list(range(40))  # in order, each once
    h = q.health
    assert h.producer_wait_fraction > 0.5  # the ring was full: the producer really had to wait
    assert h.mean_slots_in_use > 2.5  # all three slots busy: filling/ready ahead + the one consumed
    assert len({id(s["x"]) for s in q.slots}) == 3  # three preallocated buffers, reused


def test_consumer_waits_when_the_producer_is_slow():
    def slow_fill(slot, item):
        time.sleep(0.01)
        _fill(slot, item)

    q = HiddenStateQueue(range(10), _buffers, slow_fill, depth=2)
    for slot in q:
        q.release(slot)
    q.close()
    assert q.health.consumer_wait_fraction > 0.5


def test_producer_error_reaches_the_consumer():
    def bad_fill(slot, item):
        if item == 3:
            raise ValueError("target exploded")
        _fill(slot, item)

    q = HiddenStateQueue(range(10), _buffers, bad_fill, depth=2)
    got = []
    with pytest.raises(RuntimeError, match="target exploded"):
        for slot in q:
            got.append(slot.meta)
            q.release(slot)
    q.close()
    assert got == [0, 1, 2]


def test_misuse_is_refused():
    q = HiddenStateQueue(range(3), _buffers, _fill, depth=0)
    slot = q.take()
    with pytest.raises(RuntimeError, match="release"):
        q.take()
    q.release(slot)
    with pytest.raises(RuntimeError, match="not taken"):
        q.release(slot)
    with pytest.raises(ValueError):
        HiddenStateQueue(range(3), _buffers, _fill, depth=-1)


def test_close_stops_a_blocked_producer():
    q = HiddenStateQueue(iter(range(10**6)), _buffers, _fill, depth=1)
    q.release(q.take())
    t = time.perf_counter()
    q.close()
    assert time.perf_counter() - t < 5 and not q._thread.is_alive()
    assert threading.active_count() >= 1


def test_depth_0_and_depth_2_give_identical_losses(tmp_path):
    target, examples = target_and_examples()
    runs = {}
    for depth in (0, 2):
        cfg = small_config(tmp_path / f"d{depth}", queue_depth=depth, noise_std=0.05)
        s = Trainer(cfg, target=target, examples=list(examples)).train()
        runs[depth] = s
    assert len(runs[0].losses) == 6
    assert runs[0].losses == runs[2].losses  # bit-identical on CPU
    assert runs[0].losses[0] != runs[0].losses[-1]
    assert runs[2].queue_health["depth"] == 2
    assert runs[0].queue_health["mean_slots_in_use"] == 1.0 and runs[2].queue_health["mean_slots_in_use"] >= 1.0
