"""Async hidden-state queue: a producer fills a fixed ring of preallocated slots, the
trainer consumes them oldest first.

The producer (a thread) runs `fill(slot, item)` for upcoming items: the frozen target
forward writing features and labels into the slot's buffers. The consumer takes the
oldest ready slot, trains on it and releases it. Invariants:

- a slot is never handed to the producer again before the consumer released it
  (state machine FREE -> FILLING -> READY -> IN_USE -> FREE under one condition variable);
- on CUDA the host-side release is not enough, the GPU may still be reading the slot:
  the producer works on its own stream, records `ready` after filling and the consumer's
  stream waits on it; the consumer records `free` at release and the producer stream
  waits on it before overwriting. Buffers live as long as the queue and every tensor the
  producer allocates dies inside `fill` (it is copied into the slot), so no tensor crosses
  streams without an event and `record_stream` is not needed.
- items are consumed in order; depth 0 runs `fill` synchronously in the consumer's thread
  on a single slot, so depth 0 and depth > 0 see identical data.
"""
from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Slot:
    index: int
    buffers: dict[str, torch.Tensor]
    meta: Any = None  # set by `fill` (e.g. batch position, real length)
    item_number: int = -1  # order of the item in the stream (0, 1, ...)
    ready_event: Any = None
    free_event: Any = None

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.buffers[name]


@dataclass
class QueueHealth:
    depth: int
    consumer_wait_s: float = 0.0
    consumer_total_s: float = 0.0
    producer_wait_s: float = 0.0
    producer_total_s: float = 0.0
    slots_in_use: int = 0
    slots_in_use_sum: int = 0  # sampled at each release
    takes: int = 0

    @property
    def consumer_wait_fraction(self) -> float:
        """Share of the consumer's time spent waiting for a ready slot (want ~0)."""
        return self.consumer_wait_s / self.consumer_total_s if self.consumer_total_s > 0 else 0.0

    @property
    def producer_wait_fraction(self) -> float:
        """Share of the producer's time spent waiting for a free slot (high = target is fast)."""
        return self.producer_wait_s / self.producer_total_s if self.producer_total_s > 0 else 0.0

    @property
    def mean_slots_in_use(self) -> float:
        return self.slots_in_use_sum / self.takes if self.takes else 0.0

    def as_dict(self) -> dict[str, float]:
        return {"consumer_wait_fraction": self.consumer_wait_fraction,
                "producer_wait_fraction": self.producer_wait_fraction,
                "slots_in_use": self.slots_in_use, "mean_slots_in_use": self.mean_slots_in_use, "depth": self.depth}


class QueueClosed(RuntimeError):
    pass


class HiddenStateQueue:
    """Ring of `depth + 1` preallocated slots (depth 0: one slot, filled synchronously).

    `make_buffers()` allocates one slot's tensors (called once per slot, up front);
    `fill(slot, item)` writes an item into a slot and sets `slot.meta`.
    Use `take()` / `release(slot)`, or iterate: `for slot in queue: ...; queue.release(slot)`.
    """

    def __init__(self, items: Iterable, make_buffers: Callable[[], dict[str, torch.Tensor]],
                 fill: Callable[[Slot, Any], None], depth: int = 2, device: torch.device | str = "cpu"):
        if depth < 0:
            raise ValueError(f"queue depth must be >= 0 (got {depth})")
        self.depth = depth
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        self._items: Iterator = iter(items)
        self._fill = fill
        self.slots = [Slot(i, make_buffers()) for i in range(depth + 1 if depth else 1)]
        if self._cuda:
            for s in self.slots:
                s.ready_event, s.free_event = torch.cuda.Event(), torch.cuda.Event()
                s.free_event.record(torch.cuda.current_stream(self.device))  # buffers allocated on this stream
        self.health = QueueHealth(depth=depth)
        self._cv = threading.Condition()
        self._free: collections.deque[Slot] = collections.deque(self.slots)
        self._ready: collections.deque[Slot] = collections.deque()
        self._in_use: set[int] = set()
        self._produced = 0
        self._exhausted = False
        self._error: BaseException | None = None
        self._stop = False
        self._thread: threading.Thread | None = None
        self._t0 = time.perf_counter()
        if depth > 0:
            self._thread = threading.Thread(target=self._produce, name="hidden-state-producer", daemon=True)
            self._thread.start()

    # --- producer ------------------------------------------------------------------
    def _produce(self) -> None:
        stream = torch.cuda.Stream(self.device) if self._cuda else None
        start = time.perf_counter()
        try:
            with torch.no_grad():
                while True:
                    try:
                        item = next(self._items)
                    except StopIteration:
                        break
                    t = time.perf_counter()
                    with self._cv:
                        while not self._free and not self._stop:
                            self._cv.wait()
                        if self._stop:
                            return
                        slot = self._free.popleft()
                    self.health.producer_wait_s += time.perf_counter() - t
                    self._fill_slot(slot, item, stream)
                    with self._cv:
                        self._ready.append(slot)
                        self._cv.notify_all()
                    self.health.producer_total_s = time.perf_counter() - start
        except BaseException as e:  # noqa: BLE001 - surfaced to the consumer at its next take()
            with self._cv:
                self._error = e
        finally:
            with self._cv:
                self._exhausted = True
                self.health.producer_total_s = time.perf_counter() - start
                self._cv.notify_all()

    def _fill_slot(self, slot: Slot, item, stream) -> None:
        slot.item_number = self._produced
        self._produced += 1
        if stream is None:
            self._fill(slot, item)
            return
        # the host may rewrite this slot's pinned staging tensors: its last fill (and the
        # non-blocking host->device copies in it) must be finished, not just queued
        slot.ready_event.synchronize()
        with torch.cuda.stream(stream):
            stream.wait_event(slot.free_event)  # the consumer's kernels reading this slot are done
            self._fill(slot, item)
            slot.ready_event.record(stream)

    # --- consumer ------------------------------------------------------------------
    def take(self) -> Slot:
        """The oldest filled slot; raises StopIteration when the items are exhausted."""
        t = time.perf_counter()
        if self._thread is None:
            slot = self._take_sync()
        else:
            with self._cv:
                while not self._ready and not self._exhausted and self._error is None:
                    self._cv.wait()
                if not self._ready:  # batches filled before a producer failure are still delivered
                    if self._error is not None:
                        raise RuntimeError(f"hidden-state producer failed: {self._error!r}") from self._error
                    raise StopIteration
                slot = self._ready.popleft()
                self._in_use.add(slot.index)
            if self._cuda:
                torch.cuda.current_stream(self.device).wait_event(slot.ready_event)
        self.health.takes += 1
        self.health.consumer_wait_s += time.perf_counter() - t
        self.health.consumer_total_s = time.perf_counter() - self._t0
        return slot

    def _take_sync(self) -> Slot:
        slot = self.slots[0]
        if slot.index in self._in_use:
            raise RuntimeError("depth-0 queue: release the slot before taking the next one")
        item = next(self._items)  # StopIteration ends the stream
        with torch.no_grad():
            self._fill_slot(slot, item, None)
        with self._cv:
            self._free.remove(slot)
            self._in_use.add(slot.index)
        return slot

    def release(self, slot: Slot) -> None:
        """Hand a slot back; call after the last use of its tensors (after backward)."""
        with self._cv:
            if slot.index not in self._in_use:
                raise RuntimeError(f"slot {slot.index} released but not taken")
            in_use = len(self.slots) - len(self._free)  # filling + ready + held, sampled at release
            self.health.slots_in_use = in_use
            self.health.slots_in_use_sum += in_use
            self._in_use.discard(slot.index)
            if self._cuda:
                slot.free_event.record(torch.cuda.current_stream(self.device))
            self._free.append(slot)
            self._cv.notify_all()

    def __iter__(self):
        while True:
            try:
                yield self.take()
            except StopIteration:
                return

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self._thread is not None:
            self._thread.join(timeout=60)
        if self._cuda:
            torch.cuda.synchronize(self.device)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
