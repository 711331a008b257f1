"""What the cluster's ingress decides from the bytes it relays: a request's routing key, the
dialect's error for a refusal or for a stream cut short, and the replicas' metrics merged.
No Ray here: this module is imported (and tested) without it."""

from __future__ import annotations

import hashlib
import json
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any, TypeVar

from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from ..dialects.common import json_text, sse_data, sse_event
from ..metrics import CONTENT_TYPE as METRICS_TYPE
from ..wire_errors import anthropic_error, error_body, is_anthropic_path, openai_error

# A client may name its conversation itself; the ingress then routes on that name.
SESSION_HEADER = "x-session-id"
# Routing of one request: "prefix" (the default) or "round-robin" (no affinity; what the
# affinity is measured against).
ROUTING_HEADER = "x-lmserve-routing"
ROUTINGS = ("prefix", "round-robin")
# How much of a prompt or first message decides where a conversation goes.
KEY_CHARS = 1024
# The ingress's own metrics, merged into its /metrics with the replicas' (replica="ingress").
ROUTING = CollectorRegistry()
ROUTE_MOVES = Counter(
    "lmserve_route_moves", "Conversations moved to another replica (each costs a prefill)",
    registry=ROUTING,
)


_T = TypeVar("_T")

__all__ = ["METRICS_TYPE", "Affinity", "StreamWatch", "error_response", "merge_metrics",
           "rank_by_key", "routing_key"]


def json_bytes(value: Any) -> bytes:
    return json_text(value).encode()


def _leading_messages(messages: Any) -> list[Any]:
    """The messages up to and including the first user message: what every later turn of
    the conversation starts with."""
    if not isinstance(messages, list):
        return []
    out = []
    for message in messages:
        out.append(message)
        if isinstance(message, dict) and message.get("role") == "user":
            break
    return out


def _text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, sort_keys=True, default=str)


def routing_key(path: str, body: bytes, headers: Mapping[str, str]) -> str | None:
    """The key of the conversation a request continues: its ``x-session-id`` when it sends
    one, else a digest of the model, the system prompt and the first user message (chat,
    messages), the instructions and the first input item (responses), or the prompt's
    first ``KEY_CHARS`` characters (completions). None: nothing to keep together."""
    session = headers.get(SESSION_HEADER)
    if session:
        return "session:" + session
    if not body:
        return None
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(data, dict):
        return None
    key: list[Any] = [data.get("model")]
    route = path.rstrip("/")
    if route.endswith("/chat/completions"):
        key.append(_leading_messages(data.get("messages")))
    elif is_anthropic_path(route):
        key += [data.get("system"), _leading_messages(data.get("messages"))]
    elif route.endswith("/responses"):
        items = data.get("input")
        first = items[:KEY_CHARS] if isinstance(items, str) else _leading_messages(items)
        key += [data.get("instructions"), first]
    elif route.endswith("/completions"):
        prompt = data.get("prompt")
        key.append(_text(prompt)[:KEY_CHARS] if prompt is not None else None)
    else:
        return None
    return hashlib.blake2b(_text(key).encode(), digest_size=12).hexdigest()


def rank_by_key(key: str, items: list[_T], name: Callable[[_T], str]) -> list[_T]:
    """``items`` (replicas, known by ``name``) from the one ``key`` belongs to down:
    rendezvous hashing, so a replica that leaves or joins moves only the keys it held or
    takes, and every router ranks alike without sharing any state."""
    def weight(item: _T) -> bytes:
        return hashlib.blake2b(f"{key}\0{name(item)}".encode(), digest_size=8).digest()

    return sorted(items, key=weight, reverse=True)


class Affinity:
    """Which replica each conversation (routing key) belongs to, as one ingress placed them.

    New conversations take the replicas in turn: the conversations of a burst spread within
    one of even at once, without waiting for a load reading to move. A known one goes back
    to its replica while that replica is among the candidates; it moves only when its
    request lands elsewhere (its replica was full or is gone: :meth:`routed` says so). The
    table holds the ``capacity`` most recently seen conversations; a conversation forgotten
    is placed again like a new one.
    """

    def __init__(self, capacity: int = 65_536) -> None:
        self.capacity = capacity
        self.owner: OrderedDict[str, str] = OrderedDict()  # key: replica name
        self._turn = 0  # new conversations placed so far

    def place(self, key: str, names: list[str]) -> list[str]:
        """``names`` (the candidate replicas) in the order to try for ``key``: its replica
        first (chosen now when it has none among them), then the others by rendezvous rank."""
        owner = self.owner.get(key)
        if owner not in names:
            owner = sorted(names)[self._turn % len(names)]
            self._turn += 1
            self._own(key, owner)
        else:
            self.owner.move_to_end(key)
        return [owner, *(name for name in rank_by_key(key, names, str) if name != owner)]

    def routed(self, key: str, name: str) -> bool:
        """The request of ``key`` went to replica ``name``; True when that moved it."""
        moved = self.owner.get(key) not in (None, name)
        if moved or key not in self.owner:
            self._own(key, name)
        return moved

    def _own(self, key: str, name: str) -> None:
        self.owner.pop(key, None)
        self.owner[key] = name
        while len(self.owner) > self.capacity:
            self.owner.popitem(last=False)


def routing_metrics() -> str:
    """The ingress's own metrics (its router's moves), in Prometheus text."""
    return generate_latest(ROUTING).decode()


def error_response(
    path: str, headers: Mapping[str, str], status: int, message: str, *, retry_after: int = 1
) -> tuple[bytes, dict[str, str]]:
    """The body and headers of a refusal in the envelope of the path's API (429 carries
    ``retry-after``)."""
    body = error_body(path, status, message, anthropic_client="anthropic-version" in headers)
    out = {"content-type": "application/json"}
    if status == 429:
        out["retry-after"] = str(retry_after)
    return json.dumps(body).encode(), out


def is_event_stream(headers: Iterable[tuple[str, str]]) -> bool:
    return any(k.lower() == "content-type" and v.startswith("text/event-stream") for k, v in headers)


class StreamWatch:
    """Follows a relayed event stream just enough to end it in its dialect when the replica
    serving it is lost: the Responses API's ``response.created`` object and frame count."""

    def __init__(self, path: str) -> None:
        self.path = path.rstrip("/")
        self.responses = self.path.endswith("/responses")
        self.response: dict[str, Any] | None = None
        self.frames = 0
        self._head = b""

    def feed(self, chunk: bytes) -> None:
        if not self.responses:
            return
        self.frames += chunk.count(b"\n\n")
        if self.response is None and len(self._head) < 65536:
            self._head += chunk
            end = self._head.find(b"\n\n")
            if end >= 0:
                for line in self._head[:end].split(b"\n"):
                    if line.startswith(b"data: "):
                        try:
                            self.response = json.loads(line[6:]).get("response")
                        except (ValueError, AttributeError):
                            self.response = {}
                self._head = b""

    def error_frames(self, status: int, message: str) -> bytes:
        """The in-band error of a started stream, as the dialect's own encoder sends one."""
        if is_anthropic_path(self.path):
            return sse_event("error", anthropic_error(status, message))
        if self.responses:
            code = "server_error"
            response = dict(self.response or {})
            response.update(status="failed", error={"code": code, "message": message})
            seq = self.frames
            return sse_event(
                "error",
                {"type": "error", "sequence_number": seq, "code": code, "message": message,
                 "param": None},
            ) + sse_event(
                "response.failed",
                {"type": "response.failed", "sequence_number": seq + 1, "response": response},
            )
        return sse_data(openai_error(status, message))


def merge_metrics(texts: Mapping[str, str]) -> bytes:
    """The replicas' Prometheus texts as one, every sample labelled ``replica``."""
    families: dict[str, Metric] = {}
    for replica, text in sorted(texts.items()):
        for family in text_string_to_metric_families(text):
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(
                    family.name, family.documentation, family.type, family.unit
                )
            for sample in family.samples:
                merged.samples.append(
                    sample._replace(labels={**sample.labels, "replica": replica})
                )

    class _Merged:
        def collect(self) -> Iterator[Metric]:
            return iter(families.values())

    registry = CollectorRegistry()
    registry.register(_Merged())  # type: ignore[arg-type]
    return generate_latest(registry)
