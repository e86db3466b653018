"""Feedback on long work: a tqdm bar on a terminal, periodic log lines with counts and ETA elsewhere.

Regenerating training responses, building references, extracting features and drafting can
each take minutes. On a TTY the user gets a bar; in a log file (a worker, CI, `nohup`) a bar
is noise, so every `every_s` seconds one line says how far the phase is:

    references: 12/64 prompts (19%), 0.41 prompts/s, ETA 2m07s

and, when such a line was written, one more at the end (`references: 64/64 prompts in 2m36s`).
A phase shorter than `every_s` writes nothing off a TTY. `enabled=False` (e.g. ranks other
than 0) writes nothing at all.
"""
from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterable, Iterator
from typing import TypeVar

T = TypeVar("T")
DEFAULT_EVERY_S = 15.0

log = logging.getLogger(__name__)


def format_duration(seconds: float) -> str:
    s = max(int(round(seconds)), 0)
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


def _isatty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # closed or not a file
        return False


class Progress:
    """Counts of one phase; see the module docstring. Use as a context manager or call `close()`."""

    def __init__(self, desc: str, total: int | None = None, *, unit: str = "it", enabled: bool = True,
                 initial: int = 0, stream=None, every_s: float = DEFAULT_EVERY_S, logger: logging.Logger | None = None,
                 tty: bool | None = None, clock=time.monotonic):
        self.desc, self.total, self.unit = desc, total, unit
        self.n = self.initial = int(initial)
        self.every_s, self.clock = float(every_s), clock
        self.log = logger or log
        self.lines_written = 0
        stream = sys.stderr if stream is None else stream
        use_bar = enabled and (_isatty(stream) if tty is None else tty)
        self._bar = None
        if use_bar:
            from tqdm import tqdm

            self._bar = tqdm(total=total, initial=initial, desc=desc, unit=f" {unit}", file=stream,
                             dynamic_ncols=True, leave=False)
        self._lines = enabled and not use_bar
        self._t0 = self._last = clock()

    # ---- counting ------------------------------------------------------------------
    def update(self, n: int = 1, **postfix) -> None:
        self.n += n
        if self._bar is not None:
            if postfix:
                self._bar.set_postfix(postfix, refresh=False)
            self._bar.update(n)
        elif self._lines:
            now = self.clock()
            if now - self._last >= self.every_s:
                self._last = now
                self._write(self.line(now, postfix))

    def count_to(self, done: int, total: int | None = None) -> None:
        """Absolute form (a callback that knows how many are done out of how many)."""
        if total is not None and total != self.total:
            self.total = total
            if self._bar is not None:
                self._bar.total = total
        self.update(done - self.n)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        elif self._lines and self.lines_written:
            self._write(f"{self.desc}: {self._count()} {self.unit} in {format_duration(self.clock() - self._t0)}")
        self._lines = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---- the log line ----------------------------------------------------------------
    def _count(self) -> str:
        return f"{self.n}/{self.total}" if self.total is not None else str(self.n)

    def line(self, now: float | None = None, postfix: dict | None = None) -> str:
        now = self.clock() if now is None else now
        elapsed = max(now - self._t0, 1e-9)
        done = self.n - self.initial
        rate = done / elapsed
        parts = [f"{self.desc}: {self._count()} {self.unit}"]
        if self.total:
            parts[0] += f" ({100 * self.n / self.total:.0f}%)"
        parts.append(f"{rate:.3g} {self.unit}/s")
        if self.total is not None and rate > 0:
            parts.append(f"ETA {format_duration((self.total - self.n) / rate)}")
        parts += [f"{k}={v}" for k, v in (postfix or {}).items()]
        return ", ".join(parts)

    def _write(self, text: str) -> None:
        self.lines_written += 1
        self.log.info("%s", text)


def track(items: Iterable[T], desc: str, total: int | None = None, **kwargs) -> Iterator[T]:
    """Iterate `items` with a `Progress` (total from `len(items)` when it has one)."""
    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]
    with Progress(desc, total, **kwargs) as p:
        for item in items:
            yield item
            p.update()


class RepeatLimiter(logging.Filter):
    """Shows a warning (or worse) once per `window_s` per (logger, level, message template).

    A dependency that is down makes the same line appear every second or two (RQ's reconnect
    loop, heartbeats, our own waits): the first one says what is wrong, the rest hide it. The
    next one shown after the window carries how many were held back. INFO and below pass.
    """

    def __init__(self, window_s: float = 30.0, clock=time.monotonic) -> None:
        super().__init__()
        self.window_s, self._clock = window_s, clock
        self._seen: dict[tuple, list] = {}  # key -> [first shown at, held back since]
        import threading

        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True
        decided = getattr(record, "_dflash_shown", None)
        if decided is not None:  # the same record at the logger's next handler: the same answer
            return decided
        key = (record.name, record.levelno, str(record.msg))
        with self._lock:
            now, entry = self._clock(), self._seen.get(key)
            if entry is not None and now - entry[0] < self.window_s:
                entry[1] += 1
                record._dflash_shown = False
                return False
            if entry is not None and entry[1]:
                record.msg = f"{record.msg} [{entry[1]} more like this in the last {self.window_s:.0f}s not shown]"
            self._seen[key] = [now, 0]
        record._dflash_shown = True
        return True


def limit_repeated_warnings(window_s: float = 30.0, logger: logging.Logger | None = None) -> RepeatLimiter:
    """Install one RepeatLimiter on every handler of `logger` (default: the root, after basicConfig)."""
    logger = logger or logging.getLogger()
    limiter = next((f for h in logger.handlers for f in h.filters if isinstance(f, RepeatLimiter)), None)
    limiter = limiter or RepeatLimiter(window_s)
    for handler in logger.handlers:
        if limiter not in handler.filters:
            handler.addFilter(limiter)
    return limiter
