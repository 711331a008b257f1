"""The chat page at ``/`` (docs/webui.md): served, public, off with ``--no-webui``; and, in
headless Chromium (lmserve_core.testing.browser), against real ``lmserve`` processes:
SmolLM2 streaming a reply, a stop that cancels the generation on the server, conversations
found again after a reload, the API-key prompt; the scripted backend for tool calls,
reasoning and errors. Screenshots go to test-artifacts/webui/; the ``tab`` and ``chromium``
fixtures come from conftest.py."""

from __future__ import annotations

import importlib.util
import json
import re
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from models import smollm2_path
from processes import API_KEY, RunningServer, launch

from lmserve_core.native import kernels as K
from lmserve_core.testing.browser import open_page, screenshot, send, settings, wait_idle

AUTH = {"Authorization": f"Bearer {API_KEY}"}
ASSETS = ("app.js", "markdown.js", "style.css")


# ---------------------------------------------------------------------------- HTTP


def test_the_page_and_its_assets_are_served_without_the_key(server: RunningServer) -> None:
    html = httpx.get(server.base_url + "/")
    assert html.status_code == 200
    assert html.headers["content-type"].startswith("text/html")
    assert "script-src 'self'" in html.headers["content-security-policy"]
    for name in ASSETS:
        assert f'"webui/{name}"' in html.text
        asset = httpx.get(f"{server.base_url}/webui/{name}")
        assert asset.status_code == 200, name
        assert asset.headers["content-type"].split(";")[0] in ("text/javascript", "text/css")
    assert httpx.get(server.base_url + "/webui/nothing.js").status_code == 404
    # the API the page calls still wants the key
    assert httpx.get(server.base_url + "/v1/models").status_code == 401


def test_no_webui_leaves_the_root_unserved(start_server: Any) -> None:
    srv = start_server("--no-webui")
    assert httpx.get(srv.base_url + "/").status_code == 404
    assert httpx.get(srv.base_url + "/webui/app.js").status_code == 404
    assert httpx.get(srv.base_url + "/v1/models", headers=AUTH).status_code == 200


def test_models_meta_tells_the_family_context_and_capabilities(server: RunningServer) -> None:
    model = httpx.get(server.base_url + "/v1/models", headers=AUTH).json()["data"][0]
    assert model["meta"] == {
        "backend": "scripted",
        "family": "scripted",
        "n_ctx": 4096,
        "kernels": K.kernels_name(),
        "capabilities": {"reasoning": True, "tools": "hermes", "grammar": True},
        "embeddings": False,
        "rerank": False,
    }
    assert model["meta"]["kernels"] in {isa.name.lower() for isa in K.available_isas()}


# ---------------------------------------------------------------------------- SmolLM2

COLLECT_PARTS = """() => {
  window.parts = [];
  new MutationObserver(() => {
    const live = document.querySelector('.msg.assistant.live .content');
    if (live && live.textContent) window.parts.push(live.textContent.length);
  }).observe(document.getElementById('messages'), {subtree: true, childList: true,
                                                   characterData: true});
}"""


@pytest.fixture(scope="module")
def smol(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    """SmolLM2-135M-Instruct behind ``--api-key test-key``."""
    if importlib.util.find_spec("lmserve_llama") is None:
        pytest.skip("lmserve-llama is not installed")
    model = smollm2_path()
    running = launch(
        str(model),
        "--model-id",
        "SmolLM2-135M-Instruct",
        "--seed",
        "7",
        log_dir=tmp_path_factory.mktemp("webui"),
        scripted=False,
    )
    yield running
    running.stop()


def chat_requests(tab: Any) -> list[dict[str, Any]]:
    """The bodies of the chat requests the page sends from now on."""
    bodies: list[dict[str, Any]] = []

    def seen(request: Any) -> None:
        if request.method == "POST" and request.url.endswith("/v1/chat/completions"):
            bodies.append(request.post_data_json)

    tab.on("request", seen)
    return bodies


def test_a_reply_streams_and_the_conversation_is_there_after_a_reload(
    tab: Any, smol: RunningServer
) -> None:
    open_page(tab, smol.base_url, api_key=API_KEY)
    assert tab.inner_text("#model-id") == "SmolLM2-135M-Instruct"
    assert tab.inner_text("#model-meta") == "llama · context 4,096"
    assert tab.is_hidden("#thinking-switch")  # llama has no reasoning mode
    settings(tab, max_tokens="100", temperature="0")
    tab.click("#settings-toggle")
    bodies = chat_requests(tab)
    tab.evaluate(COLLECT_PARTS)
    send(tab, "Write a Python function that adds two numbers.")
    wait_idle(tab)
    parts = tab.evaluate("window.parts")
    assert len(set(parts)) >= 3, f"the reply did not arrive in pieces: {parts}"
    assert bodies[0]["stream"] is True and bodies[0]["max_tokens"] == 100
    reply = tab.locator(".msg.assistant .content")
    assert reply.inner_text().strip()
    assert re.search(r"\b\d+ tokens · [\d.]+ tok/s", tab.inner_text(".msg.assistant .stats"))
    assert re.fullmatch(r"[\d.]+ tok/s", tab.inner_text("#speed"))

    send(tab, "Now one that multiplies them.")
    wait_idle(tab)
    assert tab.locator(".msg.assistant").count() == 2
    # the second request carries the first turn
    assert [m["role"] for m in bodies[1]["messages"]] == ["user", "assistant", "user"]
    screenshot(tab, "reply")
    first_reply = reply.first.inner_text()

    tab.reload()
    tab.wait_for_selector("body[data-ready]")
    chats = tab.locator("#chats li")
    assert chats.count() == 1
    assert chats.first.inner_text().startswith("Write a Python function")
    assert tab.locator(".msg").count() == 4
    assert tab.locator(".msg.assistant .content").first.inner_text() == first_reply
    tab.click("#new-chat")
    assert tab.locator(".msg").count() == 0
    tab.click("#chats li .open")
    assert tab.locator(".msg").count() == 4
    screenshot(tab, "reloaded")


def _request_lines(srv: RunningServer) -> list[dict[str, Any]]:
    lines = []
    for line in srv.log_text().splitlines():
        if line.startswith("{") and '"event": "request"' in line:
            lines.append(json.loads(line))
    return lines


def test_stop_ends_the_generation_on_the_server(tab: Any, smol: RunningServer) -> None:
    open_page(tab, smol.base_url, api_key=API_KEY)
    # a schema that holds the end of the reply off for longer than the test waits
    endless = {"type": "array", "items": {"type": "integer"}, "minItems": 1500}
    settings(tab, max_tokens="2000", temperature="0", schema=json.dumps(endless))
    before = len(_request_lines(smol))
    send(tab, "Count from 1 to 1500.")
    tab.wait_for_function(
        "() => (document.querySelector('.msg.assistant.live .content') || {}).textContent?.length > 20"
    )
    tab.click("#stop")
    wait_idle(tab, timeout=5_000)
    assert "stopped" in tab.inner_text(".msg.assistant .stats")
    screenshot(tab, "stopped")
    # the server saw the client go and cancelled the generation long before 2000 tokens
    deadline = time.monotonic() + 10
    while len(_request_lines(smol)) == before and time.monotonic() < deadline:
        time.sleep(0.05)
    done = _request_lines(smol)[before:]
    assert [line["finish_reason"] for line in done] == ["cancelled"], done
    assert done[0]["completion_tokens"] < 1000
    # and the worker is free for the next request
    settings(tab, schema="", max_tokens="8")
    send(tab, "Say hi.")
    wait_idle(tab, timeout=10_000)
    assert tab.locator(".msg.assistant").count() == 2


def test_the_page_asks_for_the_api_key(tab: Any, smol: RunningServer) -> None:
    tab.goto(smol.base_url + "/")
    dialog = tab.locator("#key-dialog")
    dialog.wait_for(state="visible")
    assert "invalid or missing API key" in tab.inner_text("#key-message")
    screenshot(tab, "api-key")
    tab.fill("#key-input", "not-the-key")
    tab.click("#key-save")
    tab.wait_for_function(
        "() => document.getElementById('key-message').textContent.startsWith('The key was refused')"
    )
    tab.fill("#key-input", API_KEY)
    tab.press("#key-input", "Enter")
    tab.wait_for_function(
        "() => document.getElementById('model-id').textContent === 'SmolLM2-135M-Instruct'"
    )
    assert dialog.is_hidden()
    assert tab.evaluate("sessionStorage.getItem('lmserve.apiKey')") == API_KEY
    settings(tab, max_tokens="8")
    send(tab, "Hi")
    wait_idle(tab)
    assert tab.locator(".msg.assistant .content").inner_text().strip()
    assert tab.locator(".msg.assistant .error").is_hidden()


# ---------------------------------------------------------------------------- scripted


def test_a_tool_call_takes_a_pasted_result(tab: Any, server: RunningServer) -> None:
    open_page(tab, server.base_url, api_key=API_KEY)
    tools = [{"name": "get_weather", "parameters": {"type": "object"}}]
    settings(tab, tools=json.dumps(tools))
    bodies = chat_requests(tab)
    send(tab, '#reply:Let me look. #tool:get_weather:{"city": "Paris"}')
    wait_idle(tab)
    assert bodies[0]["tools"] == [{"type": "function", "function": tools[0]}]
    call = tab.locator(".msg.assistant .tool-call")
    assert call.locator(".call-name").inner_text() == "get_weather()"
    assert json.loads(call.locator(".call-args").inner_text()) == {"city": "Paris"}
    call.locator("textarea").fill('{"temp_c": 21}')
    screenshot(tab, "tool-call")
    call.locator(".send-result").click()
    wait_idle(tab)
    messages = bodies[1]["messages"]
    assert messages[-1] == {"role": "tool", "tool_call_id": "call_0", "content": '{"temp_c": 21}'}
    assert messages[-2]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert tab.locator(".tool-result pre").inner_text() == '{"temp_c": 21}'
    assert "result sent" in tab.locator(".msg.assistant .tool-call").first.inner_text()


def test_errors_show_the_message_the_api_returned(tab: Any, server: RunningServer) -> None:
    open_page(tab, server.base_url, api_key=API_KEY)
    send(tab, "#fail")
    wait_idle(tab)
    error = tab.locator(".msg.assistant .error")
    assert error.inner_text() == "scripted failure before output (HTTP 500)"
    send(tab, "#reply:some text #error")  # fails after its first token: in-band
    wait_idle(tab)
    assert error.nth(1).inner_text() == "scripted failure mid-stream"
    # a setting the server refuses: the 400's own message
    settings(tab, temperature="5")
    send(tab, "#reply:x")
    wait_idle(tab)
    assert error.nth(2).inner_text() == "'temperature' must be between 0 and 2 (HTTP 400)"
    screenshot(tab, "errors")


def test_a_phone_opens_the_conversations_from_the_header(tab: Any, server: RunningServer) -> None:
    tab.set_viewport_size({"width": 390, "height": 844})  # a phone, held upright
    open_page(tab, server.base_url, api_key=API_KEY)
    assert not tab.is_visible("#sidebar") and tab.is_visible("#sidebar-toggle")
    send(tab, "#reply:first answer")
    wait_idle(tab)
    tab.click("#sidebar-toggle")
    assert tab.is_visible("#new-chat") and tab.is_visible("#chats li")
    assert tab.get_attribute("#sidebar-toggle", "aria-expanded") == "true"
    # the overlay does not push the conversation off the screen: it covers part of it
    box = tab.locator("#sidebar").bounding_box()
    assert box is not None and box["x"] == 0 and box["width"] < 390
    screenshot(tab, "phone-sidebar")
    tab.click("#new-chat")
    assert not tab.is_visible("#sidebar")
    assert tab.locator(".msg").count() == 0
    tab.click("#sidebar-toggle")
    tab.click("#chats li .open")
    assert not tab.is_visible("#sidebar")
    assert "first answer" in tab.locator(".msg.assistant").inner_text()
    screenshot(tab, "phone")
    tab.click("#sidebar-toggle")
    tab.keyboard.press("Escape")
    assert not tab.is_visible("#sidebar")
    tab.click("#sidebar-toggle")
    tab.mouse.click(350, 400)  # beside the overlay
    assert not tab.is_visible("#sidebar")
    # a wide window shows the list and no button
    tab.set_viewport_size({"width": 1200, "height": 760})
    assert tab.is_visible("#sidebar") and not tab.is_visible("#sidebar-toggle")


def test_reasoning_folds_into_a_block_and_the_switch_asks_for_it(
    tab: Any, server: RunningServer
) -> None:
    open_page(tab, server.base_url, api_key=API_KEY)
    assert tab.is_visible("#thinking-switch")
    bodies = chat_requests(tab)
    tab.check("#thinking")
    # (the scripted thought arrives at once; the delay before the reply's one piece is the
    # time the block stays open: long enough for a busy browser to be seen in that state)
    send(tab, "#think:weighing the options one by one #reply:done #delay:600")
    # open while the model thinks ...
    tab.wait_for_selector(".msg.assistant.live .reasoning[open]")
    wait_idle(tab)
    block = tab.locator(".msg.assistant .reasoning")
    # ... folded once it has answered
    assert block.get_attribute("open") is None
    assert tab.inner_text(".msg.assistant .content") == "done"
    block.locator("summary").click()
    assert block.locator(".reasoning-body").inner_text() == "weighing the options one by one"
    assert bodies[0]["reasoning_effort"] == "high"
    tab.uncheck("#thinking")
    send(tab, "#think:unseen #reply:plain")
    wait_idle(tab)
    assert bodies[1]["reasoning_effort"] == "none"
    assert tab.locator(".msg.assistant .reasoning").nth(1).is_hidden()
    # the thought of the first reply stays in the history the server gets
    assert bodies[1]["messages"][1]["reasoning_content"] == "weighing the options one by one"
