"""llama.cpp's /tokenize and /detokenize against a real ``lmserve`` (scripted backend:
one token per UTF-8 byte)."""

from __future__ import annotations

from typing import Any

import httpx

AUTH = {"Authorization": "Bearer test-key"}


def call(server: Any, path: str, body: Any, **kw: Any) -> httpx.Response:
    headers = kw.pop("headers", AUTH)
    return httpx.post(server.base_url + path, json=body, headers=headers, timeout=30, **kw)


def test_round_trip(server: Any) -> None:
    r = call(server, "/tokenize", {"content": "Hello, world"})
    assert r.status_code == 200, r.text
    tokens = r.json()["tokens"]
    assert tokens == list(b"Hello, world")
    r = call(server, "/detokenize", {"tokens": tokens})
    assert r.status_code == 200
    assert r.json() == {"content": "Hello, world"}


def test_with_pieces(server: Any) -> None:
    r = call(server, "/tokenize", {"content": "hé", "with_pieces": True})
    assert r.status_code == 200
    # A piece that is not valid UTF-8 on its own comes back as its byte values.
    assert r.json() == {
        "tokens": [
            {"id": 104, "piece": "h"},
            {"id": 0xC3, "piece": [0xC3]},
            {"id": 0xA9, "piece": [0xA9]},
        ]
    }


def test_options_and_empty(server: Any) -> None:
    r = call(server, "/tokenize", {"content": "", "add_special": True, "parse_special": False})
    assert r.status_code == 200 and r.json() == {"tokens": []}
    r = call(server, "/detokenize", {})
    assert r.status_code == 200 and r.json() == {"content": ""}


def test_errors(server: Any) -> None:
    r = call(server, "/detokenize", {"tokens": [104, 100000]})
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "tokens"
    r = call(server, "/detokenize", {"tokens": [-1]})
    assert r.status_code == 400
    r = call(server, "/detokenize", {"tokens": ["a"]})
    assert r.status_code == 400
    r = call(server, "/tokenize", {"text": "wrong field"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = call(server, "/tokenize", {"content": "x"}, headers={})
    assert r.status_code == 401
