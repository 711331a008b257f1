"""Text stop strings over streamed text.

Text arrives in chunks (one decoded token at a time). A stop string may span several
chunks, so the scanner holds back any tail that could still grow into a stop string and
releases it once it cannot. The stop string itself is never released.
"""

from __future__ import annotations

from collections.abc import Iterable


class StopScanner:
    """Scans streamed text for the first occurrence of any stop string.

    ``feed(chunk)`` returns ``(text, stop)``: ``text`` is safe to emit now and ``stop`` is the
    stop string that fired (``None`` while none has). After a stop fires the scanner is
    finished and ignores further input. ``flush()`` releases the held-back tail at the end.
    """

    def __init__(self, stops: Iterable[str]) -> None:
        self.stops = tuple(dict.fromkeys(s for s in stops if s))
        # Proper prefixes of the stop strings: a buffer tail equal to one of them must wait.
        self._prefixes = frozenset(s[:i] for s in self.stops for i in range(1, len(s)))
        self._max_hold = max((len(s) - 1 for s in self.stops), default=0)
        self._held = ""
        self.fired: str | None = None

    @property
    def held(self) -> str:
        """Text withheld because it may be the start of a stop string."""
        return self._held

    def feed(self, chunk: str) -> tuple[str, str | None]:
        """Add ``chunk``; return the text now safe to emit and the stop that fired, if any."""
        if self.fired is not None:
            return "", self.fired
        if not self.stops:
            return chunk, None
        if not chunk:
            return "", None
        buf = self._held + chunk
        # Only the held tail plus the new chunk can contain a new match: the held tail is
        # shorter than every stop string, so the search never rescans emitted text.
        hit = self._earliest(buf)
        if hit is not None:
            start, stop = hit
            self.fired = stop
            self._held = ""
            return buf[:start], stop
        keep = self._hold_length(buf)
        self._held = buf[len(buf) - keep :] if keep else ""
        return buf[: len(buf) - keep], None

    def flush(self) -> str:
        """Release the held-back tail (no more text is coming)."""
        out, self._held = self._held, ""
        return "" if self.fired is not None else out

    def _earliest(self, buf: str) -> tuple[int, str] | None:
        # The stop that completes first wins (as if text arrived one character at a time);
        # among those ending at the same place, the one starting earliest.
        best: tuple[int, int, str] | None = None
        for stop in self.stops:
            i = buf.find(stop)
            if i < 0:
                continue
            key = (i + len(stop), i, stop)
            if best is None or key[:2] < best[:2]:
                best = key
        return None if best is None else (best[1], best[2])

    def _hold_length(self, buf: str) -> int:
        for n in range(min(self._max_hold, len(buf)), 0, -1):
            if buf[len(buf) - n :] in self._prefixes:
                return n
        return 0
