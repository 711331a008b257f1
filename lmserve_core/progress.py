"""Progress of long start-up work: loading a model's weights, scanning the KV disk tier.

The work reports through a plain callback, ``report(done, total)``, called as often as it
likes (per tensor, per file): most calls return after one clock read. Where the logs are
read on a terminal (:func:`lmserve_core.logs.configure` says so) the progress is a bar on
stderr, redrawn in place, for work that takes more than half a second. Elsewhere it is a
``progress`` log event every :data:`INTERVAL_ENV` seconds (5 by default), and a last one
at the end of work that took at least that long.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Any, TextIO

import structlog

log = structlog.get_logger("lmserve.progress")

#: Seconds between two progress lines in the logs (environment variable; default 5).
INTERVAL_ENV = "LMSERVE_PROGRESS_INTERVAL"
DEFAULT_INTERVAL = 5.0
BAR_AFTER = 0.5  # a terminal shows a bar for work that has taken this long
BAR_EVERY = 0.1  # and redraws it at most this often
BAR_WIDTH = 24

Report = Callable[[int, int], None]


class Terminal:
    """The terminal the logs are written to, as a text stream: a line written while a bar
    is shown first clears the bar, which the next report draws again below it."""

    def __init__(self, stream: TextIO) -> None:
        self.stream = stream
        self.bar_shown = False
        self.lock = threading.Lock()

    def write(self, text: str) -> int:
        with self.lock:
            if self.bar_shown:
                self.stream.write("\r\x1b[K")
                self.bar_shown = False
            return self.stream.write(text)

    def flush(self) -> None:
        self.stream.flush()

    def draw(self, line: str, *, final: bool = False) -> None:
        """Show ``line`` in place of the bar (``final``: and leave it, with a newline)."""
        with self.lock:
            self.stream.write("\r\x1b[K" + line + ("\n" if final else ""))
            self.stream.flush()
            self.bar_shown = not final

    def __getattr__(self, name: str) -> Any:  # encoding, isatty, fileno
        return getattr(self.stream, name)


_terminal: Terminal | None = None  # where bars go; None: progress is logged
_readable = False  # progress lines as readable text (the console format) instead of fields


def configure(terminal: Terminal | None, *, readable: bool = False) -> None:
    """Draw bars on ``terminal``, or (None) log progress lines, as text when ``readable``."""
    global _terminal, _readable
    _terminal, _readable = terminal, readable


def interval() -> float:
    """Seconds between two progress lines: ``$LMSERVE_PROGRESS_INTERVAL``, else 5."""
    try:
        value = float(os.environ.get(INTERVAL_ENV, DEFAULT_INTERVAL))
    except ValueError:
        return DEFAULT_INTERVAL
    return max(0.0, value)


def tracker(task: str, label: str, *, unit: str = "bytes") -> Report:
    """A ``report(done, total)`` callback for one piece of work: ``task`` names it in the
    log events, ``label`` on a terminal and in readable lines ("loading weights");
    ``unit``: "bytes" or a count's noun ("files"). The report with ``done >= total`` ends
    it; later reports are ignored."""
    return _Tracker(task, label, unit, _terminal)


class _Tracker:
    def __init__(self, task: str, label: str, unit: str, terminal: Terminal | None) -> None:
        self.task, self.label, self.unit = task, label, unit
        self.terminal = terminal
        self.every = BAR_EVERY if terminal is not None else interval()
        self.start = time.monotonic()
        self.next = self.start + (BAR_AFTER if terminal is not None else self.every)
        self.shown = False  # a bar was drawn or a line logged
        self.ended = False

    def __call__(self, done: int, total: int) -> None:
        final = done >= total
        if (not final and time.monotonic() < self.next) or self.ended:
            return  # the common case: one clock read
        now = time.monotonic()
        elapsed = now - self.start
        if final:
            self.ended = True
            if not self.shown and elapsed < (BAR_AFTER if self.terminal else self.every):
                return  # quick work is not worth a line
        self.next = now + self.every
        self.shown = True
        if self.terminal is not None:
            self.terminal.draw(self._bar(done, total, elapsed), final=final)
        elif _readable:
            log.info(f"{self.label} {self._amount(done, total)}", task=self.task)
        else:
            log.info(
                "progress",
                task=self.task,
                done=int(done),
                total=int(total),
                unit=self.unit,
                percent=_percent(done, total),
                elapsed_s=round(elapsed, 1),
            )

    def _amount(self, done: int, total: int) -> str:
        """ "37% 1.2/3.3 GiB", "5/64 files"."""
        if self.unit == "bytes":
            scale, name = byte_unit(total)
            amount = f"{done / scale:.1f}/{total / scale:.1f} {name}"
        else:
            amount = f"{done}/{total} {self.unit}"
        return f"{_percent(done, total)}% {amount}"

    def _bar(self, done: int, total: int, elapsed: float) -> str:
        encoding = (getattr(self.terminal, "encoding", None) or "").lower().replace("-", "")
        full, empty = ("\u2588", "\u2591") if encoding == "utf8" else ("#", "-")
        filled = BAR_WIDTH * min(done, total) // max(total, 1)
        bar = full * filled + empty * (BAR_WIDTH - filled)
        return f"{self.label} {bar} {self._amount(done, total)} {elapsed:.1f}s"


def _percent(done: int, total: int) -> int:
    return 100 if total <= 0 else min(100, 100 * done // total)


def byte_unit(n: int) -> tuple[int, str]:
    """The binary unit to show ``n`` bytes in: its size and name (GiB, MiB, KiB, B)."""
    for scale, name in ((1 << 30, "GiB"), (1 << 20, "MiB"), (1 << 10, "KiB")):
        if n >= scale:
            return scale, name
    return 1, "B"
