"""Streaming of conventions whose calls are regions between an opening and a closing marker."""

from __future__ import annotations

from ..request import ToolCall


def _partial_tail(text: str, marker: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


class MarkerRegionParser:
    """Streams reply text, lifting out calls written as ``OPEN…CLOSE`` regions.

    The streaming is this class's; a subclass says what a region holds by implementing
    :meth:`parse_region`, and may refine where a region ends with :meth:`close_at`.

    - Outside a region only text that may still become the opening marker is held back,
      plus trailing whitespace (it is content only if more text follows: whitespace that
      merely separates text from a call, or two calls, is dropped).
    - Inside a region everything waits for the closing marker; the text between the
      markers is given to :meth:`parse_region`. A call comes out as a call; a region that
      is not one passes through as content, markers included, with the whitespace that
      came before it.
    - A reply may hold any number of regions, with text before, between and after them.
    - :meth:`flush` at the end of the reply gives back what was held: trailing whitespace,
      a partial opening marker, or an unclosed region (as text, its marker included).
    - :meth:`cut`, when the token bound ended the reply, gives back trailing whitespace
      only: an unclosed region is a call (:meth:`cut_region`, partial unless all but its
      closing marker was written) or nothing, a partial opening marker is dropped.
    """

    def __init__(self, open_marker: str, close_marker: str) -> None:
        self.open = open_marker
        self.close = close_marker
        self._buf = ""  # outside: text not yet emitted; inside: the region so far
        self._inside = False
        self._space = ""  # trailing whitespace held back
        self._gap = ""  # whitespace before the open region: text again if it is no call
        self._scan = 0  # inside: where the search for the closing marker goes on
        self._in_span = False  # inside: within a span the closing marker may not end

    # ------------------------------------------------------------------ hooks

    def parse_region(self, body: str) -> ToolCall | None:
        """The call written between the markers (``body`` as it came, surrounding
        whitespace included), or None when it is not one: the region is then content."""
        raise NotImplementedError

    def close_at(self, region: str) -> int:
        """Where the closing marker starts in ``region``, the text after the opening
        marker so far, or -1 while it has not come. Called again, with the same text
        grown longer, as more arrives; :meth:`begin_region` starts each region afresh.
        This one takes the first closing marker; a subclass in whose regions the marker
        may be quoted text overrides it (and may keep its scan state between calls)."""
        at = region.find(self.close, self._scan)
        if at < 0:  # a marker that starts before this point would have been found whole
            self._scan = max(self._scan, len(region) - len(self.close) + 1)
        return at

    def cut_region(self, body: str) -> ToolCall | None:
        """The call begun in ``body``, an unclosed region the token bound cut off (the text
        after the opening marker, less any part of the closing one), as a partial call —
        ``partial`` set, the arguments written so far as JSON text — or None when not even
        the tool can be told. This one reads nothing; a subclass that can, overrides it."""
        return None

    def begin_region(self) -> None:
        """A region opened (or the reply ended): forget the previous one's scan state."""
        self._scan = 0
        self._in_span = False

    def close_outside(self, region: str, span_open: str, span_close: str) -> int:
        """:meth:`close_at` for regions whose spans from ``span_open`` to ``span_close``
        (quoted strings, parameter values) may hold the closing marker as text: the first
        closing marker outside every span."""
        i = self._scan
        while True:
            if self._in_span:
                j = region.find(span_close, i)
                if j < 0:
                    self._scan = max(i, len(region) - len(span_close) + 1)
                    return -1
                i, self._in_span = j + len(span_close), False
                continue
            start = region.find(span_open, i)
            close = region.find(self.close, i)
            if close >= 0 and (start < 0 or close < start):
                return close
            if start >= 0:
                i, self._in_span = start + len(span_open), True
                continue
            # a marker that starts before this point would have been found whole
            self._scan = max(i, len(region) - max(len(span_open), len(self.close)) + 1)
            return -1

    # ------------------------------------------------------------------ streaming

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self._buf += text
        out: list[str] = []
        calls: list[ToolCall] = []
        while True:
            if self._inside:
                end = self.close_at(self._buf)
                if end < 0:
                    break
                body = self._buf[:end]
                self._buf = self._buf[end + len(self.close) :]
                self._inside = False
                call = self.parse_region(body)
                if call is None:  # not a call: the model's text, markers and all
                    out.append(self._gap + self.open + body + self.close)
                else:
                    calls.append(call)
                self._space = self._gap = ""
                continue
            start = self._buf.find(self.open)
            if start >= 0:
                before = self._space + self._buf[:start]
                kept = before.rstrip()
                if kept:
                    out.append(kept)
                self._gap = before[len(kept) :]
                self._space = ""
                self._buf = self._buf[start + len(self.open) :]
                self._inside = True
                self.begin_region()
                continue
            keep = _partial_tail(self._buf, self.open)
            ready = self._buf[: len(self._buf) - keep]
            self._buf = self._buf[len(self._buf) - keep :]
            kept = ready.rstrip()
            if kept:
                out.append(self._space + kept)
                self._space = ready[len(kept) :]
            else:
                self._space += ready
            break
        return "".join(out), calls

    def flush(self) -> tuple[str, list[ToolCall]]:
        # an unclosed region is text, its marker included
        text = (self._gap + self.open if self._inside else self._space) + self._buf
        self._reset()
        return text, []

    def cut(self) -> tuple[str, list[ToolCall]]:
        if not self._inside:
            # whitespace held is the reply's; a marker begun is not
            text = "" if self._buf else self._space
            self._reset()
            return text, []
        body = self._buf[: len(self._buf) - _partial_tail(self._buf, self.close)]
        self._reset()
        call = self.parse_region(body) or self.cut_region(body)
        return "", [] if call is None else [call]

    def _reset(self) -> None:
        self._buf, self._inside, self._space, self._gap = "", False, "", ""
        self.begin_region()
