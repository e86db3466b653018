"""Feedback on long work: a bar on a terminal, lines with counts and ETA in a log, nothing when disabled."""
from __future__ import annotations

import io
import logging

from dflash_train.common.progress import Progress, format_duration, track


class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


def test_off_a_terminal_it_logs_counts_rate_and_eta_every_interval(caplog):
    clock = Clock()
    caplog.set_level(logging.INFO, logger="dflash_train.common.progress")
    with Progress("references", 64, unit="prompts", every_s=10, stream=io.StringIO(), clock=clock) as p:
        for _ in range(64):
            clock.t += 1.0  # one prompt a second
            p.update()
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 64 // 10 + 1  # one every 10 s, and the closing one
    assert lines[0] == "references: 10/64 prompts (16%), 1 prompts/s, ETA 54s"
    assert lines[-2].startswith("references: 60/64 prompts (94%)") and lines[-2].endswith("ETA 4s")
    assert lines[-1] == "references: 64/64 prompts in 1m04s"


def test_a_short_phase_and_a_disabled_one_write_nothing(caplog):
    clock = Clock()
    caplog.set_level(logging.INFO, logger="dflash_train.common.progress")
    with Progress("quick", 5, every_s=10, stream=io.StringIO(), clock=clock) as p:
        for _ in range(5):
            clock.t += 1
            p.update()
    stream = io.StringIO()
    with Progress("rank 1", 100, every_s=0, enabled=False, stream=stream, tty=True, clock=clock) as p:
        p.update(100)
    assert caplog.records == [] and stream.getvalue() == ""


def test_on_a_terminal_it_draws_a_bar_and_logs_nothing(caplog):
    caplog.set_level(logging.INFO, logger="dflash_train.common.progress")
    stream = io.StringIO()
    out = list(track(range(7), "draft", stream=stream, tty=True, every_s=0))
    assert out == list(range(7)) and caplog.records == []
    assert "draft:" in stream.getvalue() and "/7 [" in stream.getvalue()  # tqdm's bar (throttled redraws)


def test_count_to_learns_the_total_late(caplog):
    clock = Clock()
    caplog.set_level(logging.INFO, logger="dflash_train.common.progress")
    p = Progress("regenerating responses", unit="prompts", every_s=0, stream=io.StringIO(), clock=clock)
    clock.t = 4
    p.count_to(32, 128)
    p.close()
    assert caplog.records[0].getMessage() == "regenerating responses: 32/128 prompts (25%), 8 prompts/s, ETA 12s"


def test_durations_read_as_time():
    assert [format_duration(s) for s in (0.4, 59, 61, 3599, 3600 * 2 + 180)] == ["0s", "59s", "1m01s", "59m59s",
                                                                                 "2h03m"]
