"""Prometheus metrics of one serving process (``GET /metrics``, text format).

Counters move as requests end (or are refused); the gauges (queue depth, running
generations, KV slots) are read when the endpoint is scraped. Every series lives in the
process's own registry, so two servers in one process (tests) keep separate figures.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from .events import Usage

__all__ = ["CONTENT_TYPE", "Metrics", "dialect_of"]

CONTENT_TYPE = CONTENT_TYPE_LATEST

_DIALECTS = {
    "chat/completions": "chat",
    "completions": "completions",
    "responses": "responses",
    "messages": "messages",
    "messages/count_tokens": "messages",
    "embeddings": "embeddings",
    "rerank": "rerank",
    "reranking": "rerank",
}


def dialect_of(path: str) -> str | None:
    """The dialect an API path belongs to (None: not a generation endpoint)."""
    key = path.strip("/")
    key = key[3:] if key.startswith("v1/") else key
    return _DIALECTS.get(key)


class Metrics:
    """The process's series, in their own registry."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "lmserve_requests", "Requests answered, by dialect and HTTP status",
            ["dialect", "status"], registry=r,
        )
        self.prompt_tokens = Counter(
            "lmserve_prompt_tokens", "Prompt tokens of generated requests", registry=r
        )
        self.cached_tokens = Counter(
            "lmserve_cached_tokens", "Prompt tokens found in a KV slot, not prefilled", registry=r
        )
        self.generated_tokens = Counter(
            "lmserve_generated_tokens", "Tokens generated", registry=r
        )
        self.ttft = Histogram(
            "lmserve_time_to_first_token_seconds",
            "From a request's arrival to its first token",
            buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
            registry=r,
        )
        self.inter_token = Histogram(
            "lmserve_inter_token_latency_seconds",
            "Between two consecutive output events of one request",
            buckets=(0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1, 2.5),
            registry=r,
        )
        self.queue_depth = Gauge("lmserve_queue_depth", "Requests waiting", registry=r)
        self.active = Gauge(
            "lmserve_active_sequences", "Generations being run by the worker", registry=r
        )
        self.kv_slots = Gauge(
            "lmserve_kv_slots", "KV slots by state: busy (a generation runs in it), resident "
            "(holds a reusable prefix), empty", ["state"], registry=r,
        )
        self.kv_bytes = Gauge(
            "lmserve_kv_bytes", "Memory the KV slots take once every position is written (the "
            "RAM guard's plan)", registry=r,
        )

    def watch(self, queued: Callable[[], float], active: Callable[[], float],
              slots: Callable[[], Any] | None = None) -> None:
        """Read the gauges from these when scraped; ``slots()`` returns the KV slots (objects
        with ``busy`` and ``tokens``), or None when the backend has none."""
        self.queue_depth.set_function(queued)
        self.active.set_function(active)
        if slots is None:
            return
        for state in ("busy", "resident", "empty"):
            self.kv_slots.labels(state).set_function(_slot_count(slots, state))

    def watch_disk(self, stats: Callable[[], Any]) -> None:
        """Report the KV disk tier's counters (``kv_disk.TierStats``) when scraped."""
        self.registry.register(_DiskCollector(stats))

    def request(self, dialect: str | None, status: int) -> None:
        if dialect is not None:
            self.requests.labels(dialect, str(status)).inc()

    def usage(self, usage: Usage, ttft: float | None) -> None:
        self.prompt_tokens.inc(usage.prompt_tokens)
        self.cached_tokens.inc(usage.cached_tokens)
        self.generated_tokens.inc(usage.completion_tokens)
        if ttft is not None:
            self.ttft.observe(ttft)

    def render(self) -> bytes:
        """The text exposition of every series."""
        return generate_latest(self.registry)


class _DiskCollector(Collector):
    """The disk tier's counters, read from its statistics at each scrape."""

    FIELDS = (
        ("hits", "Requests whose prefix came from a disk-tier file"),
        ("misses", "Requests that found no disk-tier file better than the resident slots"),
        ("spills", "Disk-tier files written"),
        ("bytes_written", "Bytes written to the disk tier"),
        ("bytes_read", "Bytes read from the disk tier"),
        ("skipped", "Disk-tier files refused (corrupt, truncated, another model)"),
    )

    def __init__(self, stats: Callable[[], Any]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[CounterMetricFamily]:
        stats = self._stats()
        for name, help_text in self.FIELDS:
            yield CounterMetricFamily(
                f"lmserve_kv_disk_{name}", help_text, value=float(getattr(stats, name, 0))
            )


def _slot_count(slots: Callable[[], Any], state: str) -> Callable[[], float]:
    def count() -> float:
        n = 0
        for slot in slots() or ():
            busy = bool(getattr(slot, "busy", False))
            held = bool(getattr(slot, "tokens", None))
            n += (
                (state == "busy" and busy)
                or (state == "resident" and held and not busy)
                or (state == "empty" and not held and not busy)
            )
        return float(n)

    return count
