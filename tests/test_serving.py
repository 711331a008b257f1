"""Load, faults and bad input against a real ``lmserve`` process (scripted backend)."""

from __future__ import annotations

import concurrent.futures
import json
import signal
import socket
import time

import httpx
import pytest
from processes import API_KEY

AUTH = {"Authorization": f"Bearer {API_KEY}"}


def chat(text: str, **extra: object) -> dict[str, object]:
    return {"model": "m", "messages": [{"role": "user", "content": text}], **extra}


def raw_request(port: int, path: str, body: dict[str, object]) -> socket.socket:
    """Send a POST on a raw socket and return it without reading the reply."""
    payload = json.dumps(body).encode()
    sock = socket.create_connection(("127.0.0.1", port))
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {API_KEY}\r\nContent-Length: {len(payload)}\r\n\r\n"
    )
    sock.sendall(head.encode() + payload)
    return sock


def read_until(sock: socket.socket, marker: bytes, timeout: float = 30) -> bytes:
    sock.settimeout(timeout)
    data = b""
    while marker not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def test_queue_bound_gives_429_with_retry_after_and_never_hangs(start_server) -> None:
    srv = start_server("--queue", "2")
    url = srv.base_url + "/v1/chat/completions"

    def one(i: int) -> httpx.Response:
        return httpx.post(url, json=chat("#tokens:5 #delay:20"), headers=AUTH, timeout=60)

    with concurrent.futures.ThreadPoolExecutor(20) as pool:
        replies = list(pool.map(one, range(20)))
    statuses = sorted(r.status_code for r in replies)
    assert set(statuses) <= {200, 429}, statuses
    assert statuses.count(429) >= 1, "a queue of 2 must turn some of 20 concurrent requests away"
    assert statuses.count(200) >= 3  # the running job plus the two queued ones
    for reply in replies:
        if reply.status_code == 429:
            assert int(reply.headers["retry-after"]) >= 1
            assert reply.json()["error"]["type"] == "rate_limit_error"
        else:
            assert reply.json()["choices"][0]["message"]["content"] == "t0 t1 t2 t3 t4"
    after = httpx.post(url, json=chat("#reply:still here"), headers=AUTH, timeout=30)
    assert after.status_code == 200
    assert after.json()["choices"][0]["message"]["content"] == "still here"


def test_stalled_reader_does_not_delay_a_sibling(start_server) -> None:
    srv = start_server()
    stalled = raw_request(
        srv.port, "/v1/chat/completions", chat("#tokens:512", stream=True, max_tokens=2000)
    )
    try:
        time.sleep(0.3)  # let the stalled stream start
        started = time.perf_counter()
        sibling = httpx.post(
            srv.base_url + "/v1/chat/completions", json=chat("#reply:sibling"), headers=AUTH,
            timeout=30,
        )
        elapsed = time.perf_counter() - started
        assert sibling.status_code == 200
        print(f"sibling completed in {elapsed:.3f} s while a 512-token stream was unread")
        assert elapsed < 5.0
        # The stalled client still receives the whole stream once it reads (what piled
        # up meanwhile in fewer, longer deltas).
        data = read_until(stalled, b"data: [DONE]")
        assert b"data: [DONE]" in data
        frames = [json.loads(line[6:]) for line in data.decode().splitlines()
                  if line.startswith("data: {")]
        text = "".join(f["choices"][0]["delta"].get("content") or "" for f in frames if f["choices"])
        assert text == " ".join(f"t{i}" for i in range(512))
    finally:
        stalled.close()


def test_disconnect_frees_the_worker_at_the_next_token(start_server) -> None:
    srv = start_server()
    # 1000 tokens at 10 ms each would hold the worker for 10 s.
    sock = raw_request(
        srv.port, "/v1/chat/completions", chat("#tokens:1000 #delay:10", stream=True, max_tokens=2000)
    )
    read_until(sock, b"t2", timeout=10)
    sock.close()
    started = time.perf_counter()
    reply = httpx.post(
        srv.base_url + "/v1/chat/completions", json=chat("#reply:next"), headers=AUTH, timeout=30
    )
    elapsed = time.perf_counter() - started
    assert reply.status_code == 200
    assert elapsed < 2.0, f"the worker stayed busy for {elapsed:.2f} s after the client left"
    deadline = time.monotonic() + 5
    while '"cancelled"' not in srv.log_text() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert '"finish_reason": "cancelled"' in srv.log_text()


def test_queued_request_dropped_by_its_client_is_skipped(start_server) -> None:
    srv = start_server()
    busy = raw_request(srv.port, "/v1/chat/completions", chat("#tokens:100 #delay:10"))
    time.sleep(0.2)
    queued = raw_request(srv.port, "/v1/chat/completions", chat("#tokens:100 #delay:50"))
    time.sleep(0.2)
    queued.close()
    read_until(busy, b"t99", timeout=30)
    busy.close()
    started = time.perf_counter()
    reply = httpx.post(
        srv.base_url + "/v1/chat/completions", json=chat("#reply:ok"), headers=AUTH, timeout=30
    )
    assert reply.status_code == 200
    assert time.perf_counter() - started < 2.0, "the dropped queued job still ran"


def test_sigterm_during_a_stream_drains_and_exits_zero(start_server) -> None:
    srv = start_server()
    sock = raw_request(
        srv.port, "/v1/chat/completions", chat("#tokens:1000 #delay:10", stream=True, max_tokens=2000)
    )
    read_until(sock, b"t1", timeout=10)
    srv.process.send_signal(signal.SIGTERM)
    rest = read_until(sock, b"data: [DONE]", timeout=20)
    sock.close()
    assert srv.process.wait(20) == 0
    assert b"shutting down" in rest or b"[DONE]" in rest


def test_connection_is_reused_after_a_streamed_reply(server) -> None:
    with httpx.Client(headers=AUTH, timeout=30) as client:
        url = server.base_url + "/v1/chat/completions"
        seen = set()
        for _ in range(3):
            with client.stream("POST", url, json=chat("#reply:a b c", stream=True)) as reply:
                body = b"".join(reply.iter_bytes())
                assert body.rstrip().endswith(b"data: [DONE]")
                stream = reply.extensions["network_stream"]
                seen.add(id(stream.get_extra_info("socket")))
        assert len(seen) == 1, "each streamed reply closed its connection"


@pytest.mark.parametrize(
    ("body", "param_hint"),
    [
        (b"{not json", None),
        (json.dumps({"messages": "hello"}).encode(), "messages"),
        (json.dumps(chat("hi", temperature="hot")).encode(), "temperature"),
        (json.dumps({"messages": [{"role": "wizard", "content": "hi"}]}).encode(), "role"),
        (json.dumps({"messages": []}).encode(), "messages"),
        (json.dumps([1, 2, 3]).encode(), None),
    ],
)
def test_bad_input_gets_a_clear_400_in_the_openai_envelope(server, body, param_hint) -> None:
    reply = httpx.post(
        server.base_url + "/v1/chat/completions", content=body,
        headers={**AUTH, "Content-Type": "application/json"}, timeout=30,
    )
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["message"]
    if param_hint:
        assert param_hint in (error.get("param") or "") + error["message"]


def test_bad_input_gets_the_anthropic_envelope_on_messages(server) -> None:
    reply = httpx.post(
        server.base_url + "/v1/messages", content=b"{oops",
        headers={"x-api-key": API_KEY, "Content-Type": "application/json"}, timeout=30,
    )
    assert reply.status_code == 400
    body = reply.json()
    assert body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", '{"model":"m","messages":[{"role":"user","content":"hi"}],'),
        ("/v1/completions", '{"model":"m","prompt":"hi",'),
        ("/v1/responses", '{"model":"m","input":"hi",'),
        ("/v1/messages", '{"model":"m","max_tokens":8,"messages":[{"role":"user","content":"hi"}],'),
    ],
)
def test_a_body_nested_thousands_deep_is_a_400(server, path: str, body: str) -> None:
    deep = body + '"metadata":' + "[" * 10_000 + "]" * 10_000 + "}"
    reply = httpx.post(server.base_url + path, content=deep,
                       headers={**AUTH, "content-type": "application/json"}, timeout=30)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert "nested too deeply" in error["message"]
    assert error["type"] == "invalid_request_error"
    assert httpx.get(server.base_url + "/health").status_code == 200


def test_oversized_body_is_413_and_the_server_lives(start_server) -> None:
    srv = start_server("--max-body-mb", "1")
    big = chat("x" * (2 * 1024 * 1024))
    reply = httpx.post(srv.base_url + "/v1/chat/completions", json=big, headers=AUTH, timeout=30)
    assert reply.status_code == 413
    assert "too large" in reply.json()["error"]["message"]
    reply = httpx.post(srv.base_url + "/v1/messages", json=big, headers=AUTH, timeout=30)
    assert reply.status_code == 413
    assert reply.json()["error"]["type"] == "request_too_large"
    ok = httpx.post(srv.base_url + "/v1/chat/completions", json=chat("hi"), headers=AUTH, timeout=30)
    assert ok.status_code == 200


def test_prompt_longer_than_ctx_is_400_naming_both_lengths(start_server) -> None:
    srv = start_server("--ctx", "64")
    long = " ".join(["word"] * 200)
    reply = httpx.post(
        srv.base_url + "/v1/chat/completions", json=chat(long), headers=AUTH, timeout=30
    )
    assert reply.status_code == 400
    message = reply.json()["error"]["message"]
    assert "64" in message and "prompt" in message
    reply = httpx.post(
        srv.base_url + "/v1/messages", json={**chat(long), "max_tokens": 10}, headers=AUTH,
        timeout=30,
    )
    assert reply.status_code == 400
    assert reply.json()["type"] == "error"


def test_auth_applies_everywhere_but_health(server) -> None:
    base = server.base_url
    assert httpx.get(base + "/health").status_code == 200
    for method, path in [
        ("GET", "/v1/models"), ("POST", "/v1/chat/completions"), ("POST", "/v1/responses"),
        ("POST", "/v1/messages"), ("POST", "/v1/completions"), ("POST", "/tokenize"),
    ]:
        reply = httpx.request(method, base + path, json=chat("hi"), timeout=30)
        assert reply.status_code == 401, path
    reply = httpx.get(base + "/v1/models", headers={"x-api-key": API_KEY})
    assert reply.status_code == 200
    reply = httpx.post(base + "/v1/messages", json={**chat("hi"), "max_tokens": 5})
    assert reply.json()["error"]["type"] == "authentication_error"


def test_one_json_log_event_per_request(server) -> None:
    reply = httpx.post(
        server.base_url + "/v1/chat/completions", json=chat("#reply:logged reply"),
        headers=AUTH, timeout=30,
    )
    assert reply.status_code == 200
    request_id = reply.json()["id"]
    deadline = time.monotonic() + 5
    events: list[dict[str, object]] = []
    while time.monotonic() < deadline and not events:
        for line in server.log_text().splitlines():
            if line.startswith("{") and request_id in line:
                events.append(json.loads(line))
        time.sleep(0.05)
    assert len(events) == 1
    event = events[0]
    for key in ("dialect", "status", "prompt_tokens", "completion_tokens", "ttft_s", "finish_reason"):
        assert key in event
    assert event["status"] == 200 and event["dialect"] == "chat"


def test_openapi_document_describes_the_request_bodies(server) -> None:
    doc = httpx.get(server.base_url + "/schema/openapi.json", headers=AUTH, timeout=30).json()
    paths = doc["paths"]
    for path in ("/v1/chat/completions", "/v1/responses", "/v1/messages", "/v1/completions"):
        assert "requestBody" in paths[path]["post"], path


def test_connections_beyond_conns_get_503(start_server) -> None:
    srv = start_server("--conns", "1")
    held = raw_request(
        srv.port, "/v1/chat/completions", chat("#tokens:200 #delay:10", stream=True, max_tokens=300)
    )
    try:
        read_until(held, b"t1", timeout=10)
        reply = httpx.post(
            srv.base_url + "/v1/chat/completions", json=chat("hi"), headers=AUTH, timeout=30
        )
        assert reply.status_code == 503
    finally:
        held.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        reply = httpx.post(
            srv.base_url + "/v1/chat/completions", json=chat("hi"), headers=AUTH, timeout=30
        )
        if reply.status_code == 200:
            break
        time.sleep(0.1)
    assert reply.status_code == 200


def _preflight(base: str, origin: str) -> httpx.Response:
    return httpx.options(
        base + "/v1/chat/completions",
        headers={"Origin": origin, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"},
        timeout=30,
    )


def test_cors_default_allows_loopback_pages_only(server) -> None:
    base = server.base_url
    for origin in ("http://localhost:5173", "http://127.0.0.1:3000", "https://localhost"):
        pre = _preflight(base, origin)  # no API key: preflights never carry one
        assert pre.status_code in (200, 204), pre.text
        assert pre.headers["access-control-allow-origin"] == origin
        assert "POST" in pre.headers["access-control-allow-methods"]
        assert "authorization" in pre.headers["access-control-allow-headers"].lower()
        reply = httpx.post(base + "/v1/chat/completions", json=chat("hi", max_tokens=4),
                           headers={**AUTH, "Origin": origin}, timeout=30)
        assert reply.status_code == 200
        assert reply.headers["access-control-allow-origin"] == origin
    for origin in ("https://evil.example", "http://localhost.evil.example"):
        pre = _preflight(base, origin)
        assert "access-control-allow-origin" not in pre.headers
        reply = httpx.post(base + "/v1/chat/completions", json=chat("hi", max_tokens=4),
                           headers={**AUTH, "Origin": origin}, timeout=30)
        assert "access-control-allow-origin" not in reply.headers
    # the API itself still wants the key, whatever the origin
    reply = httpx.post(base + "/v1/chat/completions", json=chat("hi"),
                       headers={"Origin": "http://localhost:5173"}, timeout=30)
    assert reply.status_code == 401


def test_cors_origins_flag_replaces_the_default(start_server) -> None:
    srv = start_server("--cors-origins", "https://app.example.com, https://other.example")
    pre = _preflight(srv.base_url, "https://app.example.com")
    assert pre.headers.get("access-control-allow-origin") == "https://app.example.com"
    assert "access-control-allow-origin" not in _preflight(srv.base_url, "http://localhost:5173").headers
