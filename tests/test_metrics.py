"""``GET /metrics``: Prometheus text that ``prometheus_client``'s own parser reads, with
counters that move with the requests a real ``lmserve`` process serves."""

from __future__ import annotations

import httpx
from processes import API_KEY
from prometheus_client.parser import text_string_to_metric_families

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def scrape(base: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    reply = httpx.get(base + "/metrics", headers=AUTH, timeout=30)
    assert reply.status_code == 200
    assert reply.headers["content-type"].startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(reply.text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def value(samples: dict, name: str, **labels: str) -> float:  # type: ignore[type-arg]
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_metrics_need_the_key(server) -> None:
    assert httpx.get(server.base_url + "/metrics", timeout=30).status_code == 401


def test_counters_move_with_requests(server) -> None:
    base = server.base_url
    before = scrape(base)
    for _ in range(3):
        reply = httpx.post(base + "/v1/chat/completions", headers=AUTH, timeout=30, json={
            "model": "m", "messages": [{"role": "user", "content": "#tokens:5"}],
            "max_tokens": 50, "stream": True})
        assert reply.status_code == 200
    bad = httpx.post(base + "/v1/messages", headers=AUTH, timeout=30,
                     json={"model": "m", "max_tokens": 5, "messages": []})
    assert bad.status_code == 400
    after = scrape(base)

    def delta(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert delta("lmserve_requests_total", dialect="chat", status="200") == 3
    assert delta("lmserve_requests_total", dialect="messages", status="400") == 1
    assert delta("lmserve_generated_tokens_total") == 15
    assert delta("lmserve_prompt_tokens_total") > 0
    assert delta("lmserve_time_to_first_token_seconds_count") == 3
    # five tokens a request: four gaps between them
    assert delta("lmserve_inter_token_latency_seconds_count") == 12
    assert value(after, "lmserve_queue_depth") == 0
    assert value(after, "lmserve_active_sequences") == 0
