"""tests/support/tensor_peak.py: the benches' deterministic peak of live tensor bytes."""
from __future__ import annotations

import torch

from tests.support.tensor_peak import marked, peak_live_bytes, tensor_events_during, tensor_peak_during

MB = 1 << 20


def test_peak_counts_a_known_tensor_exactly_and_tensors_live_at_once_together():
    def one():
        return torch.empty(MB // 2).fill_(1).sum().item()  # float32: summed in place, no wider copy

    def two_at_once():
        a = torch.empty(3 * MB, dtype=torch.uint8)
        b = torch.empty(5 * MB, dtype=torch.uint8)
        return a.numel() + b.numel()

    def one_after_the_other():
        a = torch.empty(3 * MB, dtype=torch.uint8)
        del a
        b = torch.empty(5 * MB, dtype=torch.uint8)
        return b.numel()

    assert tensor_peak_during(one)[1] - 2 * MB in range(0, 64)  # the sum's scalar, nothing else
    assert tensor_peak_during(two_at_once) == (8 * MB, 8 * MB)
    assert tensor_peak_during(one_after_the_other) == (5 * MB, 5 * MB)


def test_freeing_what_existed_before_the_call_does_not_lower_the_peak():
    before = torch.empty(4 * MB, dtype=torch.uint8)
    held = [before]

    def swap():
        held.clear()  # frees 4 MB allocated outside the window
        return torch.empty(3 * MB, dtype=torch.uint8).numel()

    assert tensor_peak_during(swap)[1] == 3 * MB


def test_same_call_same_peak():
    x = torch.randn(64, 256)

    def work():
        return (torch.softmax(x @ x.T, -1) @ x).sum().item()

    peaks = {tensor_peak_during(work)[1] for _ in range(3)}
    assert len(peaks) == 1 and peaks.pop() >= 64 * 64 * 4


def test_a_reused_address_is_a_new_block():
    events = [(0, 7, 100), (1, 7, -100), (2, 7, 50), (3, 7, -50), (4, 8, 90), (5, 9, -999), (6, 10, 20)]
    assert peak_live_bytes(events) == 110  # an unknown block's free (address 9) lowers nothing


def test_a_window_reads_its_own_peak_above_its_start():
    events = [(0, 1, 100), (10, 2, 50), (11, 2, -50), (20, 3, 30), (21, 4, 5), (22, 3, -30), (30, 5, 400)]
    assert peak_live_bytes(events, since=15, until=25) == 35  # 100 live at 15 is the base; 400 is after
    assert peak_live_bytes(events, since=5) == 400 + 5
    marks: list[int] = []

    def phase(size):
        return torch.empty(size, dtype=torch.uint8).numel()

    def phases():
        keep = torch.empty(6 * MB, dtype=torch.uint8)  # before the phase: its base
        marked(phase, marks)(2 * MB)
        return keep.numel() + torch.empty(7 * MB, dtype=torch.uint8).numel()

    _, events = tensor_events_during(phases)
    assert peak_live_bytes(events, *marks) == 2 * MB  # on the profiler's clock, which is time.time_ns()'s
    assert peak_live_bytes(events) == 13 * MB
