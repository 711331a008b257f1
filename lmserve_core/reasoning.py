"""Routing a reply's leading ``<think>`` block out of the reply text.

A family with think markers may open its reply with ``<think>…</think>``: that block is
reasoning, the rest is the reply. Some templates prime an empty think block in the prompt
and the model still emits a stray ``</think>`` first: that is a template artifact and is
dropped. Only the head of the reply is inspected; a marker later in the reply is text.
"""

from __future__ import annotations

from .backend import ThinkMarkers

_HEAD, _THINK, _REPLY = range(3)


class ThinkRouter:
    """Splits streamed reply text into reasoning and reply text.

    ``feed(chunk)`` returns ``(reasoning, reply)``, each possibly empty; text that may still
    turn out to be part of a marker is held back until it can be classified. ``flush()``
    returns what is held at the end. With ``inside=True`` the reply starts in a think block
    (the prompt already opened it).
    """

    def __init__(self, markers: ThinkMarkers, *, inside: bool = False) -> None:
        self.markers = markers
        self._state = _THINK if inside else _HEAD
        self._buf = ""
        self._strip_next = False  # drop whitespace that follows a closing marker

    @property
    def in_reasoning(self) -> bool:
        """True while inside the think block."""
        return self._state == _THINK

    def feed(self, chunk: str) -> tuple[str, str]:
        """Add ``chunk``; return the reasoning and reply text that can be emitted now."""
        if self._state == _REPLY and not self._strip_next:
            return "", chunk
        self._buf += chunk
        reasoning = ""
        while True:
            if self._state == _HEAD:
                head = self._buf.lstrip()
                if head.startswith(self.markers.open):
                    self._buf = head[len(self.markers.open) :]
                    self._state = _THINK
                    self._strip_next = True
                    continue
                if head.startswith(self.markers.close):
                    self._buf = head[len(self.markers.close) :]
                    self._state = _REPLY
                    self._strip_next = True
                    continue
                if (
                    not head
                    or self.markers.open.startswith(head)
                    or self.markers.close.startswith(head)
                ):
                    return reasoning, ""  # undecided: wait for more text
                self._state = _REPLY
                continue
            if self._state == _THINK:
                if self._strip_next:
                    self._buf = self._buf.lstrip()
                    if not self._buf:
                        return reasoning, ""
                    self._strip_next = False
                close = self.markers.close
                i = self._buf.find(close)
                if i >= 0:
                    reasoning += self._buf[:i].rstrip()
                    self._buf = self._buf[i + len(close) :]
                    self._state = _REPLY
                    self._strip_next = True
                    continue
                keep = _partial_suffix(self._buf, close)
                # Trailing whitespace waits too: the block's last newline is not reasoning.
                cut = len(self._buf) - keep
                body = self._buf[:cut]
                tail = len(body) - len(body.rstrip())
                cut -= tail
                reasoning += self._buf[:cut]
                self._buf = self._buf[cut:]
                return reasoning, ""
            # _REPLY
            if self._strip_next:
                self._buf = self._buf.lstrip()
                if not self._buf:
                    return reasoning, ""
                self._strip_next = False
            reply, self._buf = self._buf, ""
            return reasoning, reply

    def flush(self) -> tuple[str, str]:
        """Return what is held back once no more text is coming."""
        buf, self._buf = self._buf, ""
        if self._state == _THINK:
            return buf.rstrip(), ""
        if self._state == _REPLY and self._strip_next:
            return "", ""
        return "", buf


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[len(text) - n :]):
            return n
    return 0
