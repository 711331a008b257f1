"""The cluster ingress's decisions on the bytes it relays (lmserve_core.cluster.wire), and
that Ray stays an optional extra. No Ray needed."""

from __future__ import annotations

import json
import subprocess
import sys

from models import smollm2_path
from prometheus_client.parser import text_string_to_metric_families

from lmserve_core.cluster import wire


def body(**fields: object) -> bytes:
    return json.dumps(fields).encode()


def test_a_conversation_keeps_its_key_across_turns() -> None:
    first = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    later = [*first, {"role": "assistant", "content": "Hello"},
             {"role": "user", "content": "More"}]
    other = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Bye"}]
    key = wire.routing_key("/v1/chat/completions", body(model="m", messages=first), {})
    assert key is not None
    assert wire.routing_key("/v1/chat/completions", body(model="m", messages=later), {}) == key
    assert wire.routing_key("/v1/chat/completions", body(model="m", messages=other), {}) != key
    # Anthropic: the system prompt is a field of its own
    a = wire.routing_key("/v1/messages", body(model="m", system="S", messages=first[1:]), {})
    b = wire.routing_key("/v1/messages", body(model="m", system="S", messages=later[1:]), {})
    assert a == b and a != wire.routing_key(
        "/v1/messages", body(model="m", system="T", messages=first[1:]), {})
    # Responses: instructions + the first input item; a string input by its leading text
    r1 = wire.routing_key("/v1/responses", body(model="m", instructions="I", input=first[1:]), {})
    r2 = wire.routing_key("/v1/responses", body(model="m", instructions="I", input=later[1:]), {})
    assert r1 == r2
    long = "x" * wire.KEY_CHARS
    assert wire.routing_key("/v1/completions", body(prompt=long + "a"), {}) == wire.routing_key(
        "/v1/completions", body(prompt=long + "b"), {})


def test_a_session_header_wins_and_unroutable_bodies_have_no_key() -> None:
    headers = {wire.SESSION_HEADER: "abc"}
    assert wire.routing_key("/v1/chat/completions", body(messages=[]), headers) == "session:abc"
    assert wire.routing_key("/v1/chat/completions", b"{not json", {}) is None
    assert wire.routing_key("/v1/chat/completions", b"[1, 2]", {}) is None
    assert wire.routing_key("/health", b"", {}) is None
    assert wire.routing_key("/tokenize", body(prompt="p"), {}) is None


def test_rendezvous_ranking_moves_only_the_keys_of_a_lost_replica() -> None:
    names = ["r0", "r1", "r2"]
    keys = [f"conv-{i}" for i in range(300)]
    owner = {k: wire.rank_by_key(k, names, str)[0] for k in keys}
    assert {names.count(n) for n in names} == {1}
    assert min(list(owner.values()).count(n) for n in names) > 60  # spread over all three
    without = {k: wire.rank_by_key(k, ["r0", "r2"], str)[0] for k in keys}
    assert all(without[k] == owner[k] for k in keys if owner[k] != "r1")
    assert all(wire.rank_by_key(k, names, str)[1] == without[k] for k in keys if owner[k] == "r1")


def test_a_burst_of_new_conversations_spreads_evenly_and_each_keeps_its_replica() -> None:
    for names, n in ((["r0", "r1"], 8), (["r0", "r1"], 7), (["r0", "r1", "r2"], 16)):
        affinity = wire.Affinity()
        first = {f"conv-{i}": affinity.place(f"conv-{i}", names)[0] for i in range(n)}
        counts = [list(first.values()).count(name) for name in names]
        assert max(counts) - min(counts) <= 1, (names, counts)  # within one of even
        for key, name in first.items():  # the later turns go back, most recent first
            assert affinity.place(key, names) == [name, *wire.rank_by_key(
                key, [m for m in names if m != name], str)]
            assert not affinity.routed(key, name)


def test_a_burst_spreads_evenly_whatever_the_counts_before() -> None:
    for names, before in ((["r0", "r1"], 7), (["r0", "r1", "r2"], 5), (["r0", "r1"], 0)):
        affinity = wire.Affinity()
        for i in range(before):  # earlier conversations leave the counts uneven
            affinity.place(f"old-{i}", names)
        burst = [affinity.place(f"new-{i}", names)[0] for i in range(8 * len(names))]
        counts = [burst.count(name) for name in names]
        assert max(counts) - min(counts) <= 1, (names, before, counts)


def test_a_conversation_moves_only_where_its_request_went() -> None:
    affinity = wire.Affinity()
    names = ["r0", "r1"]
    home = affinity.place("a", names)[0]
    other = next(name for name in names if name != home)
    assert affinity.routed("a", other)  # its replica was full: the other took it
    assert affinity.place("a", names)[0] == other and not affinity.routed("a", other)
    # a replica that leaves gives its conversations to the rest; the others stay
    keys = [f"c{i}" for i in range(20)]
    before = {k: affinity.place(k, ["r0", "r1", "r2"])[0] for k in keys}
    after = {k: affinity.place(k, ["r0", "r2"])[0] for k in keys}
    assert all(after[k] == before[k] for k in keys if before[k] != "r1")
    assert all(after[k] in ("r0", "r2") for k in keys)


def test_the_table_forgets_the_least_recent_conversations() -> None:
    affinity = wire.Affinity(capacity=4)
    for i in range(10):
        affinity.place(f"c{i}", ["r0", "r1"])
    assert list(affinity.owner) == ["c6", "c7", "c8", "c9"]
    affinity.place("c7", ["r0", "r1"])  # seen again: the most recent
    assert list(affinity.owner) == ["c6", "c8", "c9", "c7"]


def test_refusals_are_in_the_dialects_envelope() -> None:
    content, headers = wire.error_response("/v1/messages", {}, 429, "busy", retry_after=3)
    assert json.loads(content) == {"type": "error",
                                   "error": {"type": "rate_limit_error", "message": "busy"}}
    assert headers["retry-after"] == "3"
    content, headers = wire.error_response("/v1/chat/completions", {}, 429, "busy")
    assert json.loads(content)["error"]["type"] == "rate_limit_error"
    assert headers["retry-after"] == "1"
    content, _ = wire.error_response("/v1/models", {"anthropic-version": "x"}, 503, "gone")
    assert json.loads(content)["type"] == "error"


def sse(frame: bytes) -> list[tuple[str | None, dict]]:
    out = []
    for block in frame.decode().strip().split("\n\n"):
        event, data = None, None
        for line in block.split("\n"):
            if line.startswith("event: "):
                event = line[7:]
            elif line.startswith("data: "):
                data = json.loads(line[6:])
        out.append((event, data))
    return out


def test_a_cut_stream_ends_with_the_dialects_in_band_error() -> None:
    chat = wire.StreamWatch("/v1/chat/completions")
    [(event, data)] = sse(chat.error_frames(500, "lost"))
    assert event is None and data["error"]["message"] == "lost"
    messages = wire.StreamWatch("/v1/messages")
    [(event, data)] = sse(messages.error_frames(500, "lost"))
    assert event == "error" and data["error"] == {"type": "api_error", "message": "lost"}
    responses = wire.StreamWatch("/v1/responses")
    created = {"id": "resp_1", "object": "response", "status": "in_progress", "output": []}
    frame = (b'event: response.created\ndata: '
             + json.dumps({"type": "response.created", "sequence_number": 0,
                           "response": created}).encode() + b"\n\n")
    responses.feed(frame[:20])
    responses.feed(frame[20:] + b'event: response.in_progress\ndata: {}\n\n')
    (e1, d1), (e2, d2) = sse(responses.error_frames(500, "lost"))
    assert (e1, d1["code"], d1["sequence_number"]) == ("error", "server_error", 2)
    assert e2 == "response.failed" and d2["sequence_number"] == 3
    assert d2["response"]["id"] == "resp_1" and d2["response"]["status"] == "failed"
    assert d2["response"]["error"] == {"code": "server_error", "message": "lost"}


def test_metrics_of_the_replicas_are_labelled_and_merged() -> None:
    from lmserve_core.metrics import Metrics

    a, b = Metrics(), Metrics()
    a.requests.labels("chat", "200").inc(3)
    b.requests.labels("chat", "200").inc(2)
    merged = wire.merge_metrics({"ra": a.render().decode(), "rb": b.render().decode()})
    families = {f.name: f for f in text_string_to_metric_families(merged.decode())}
    samples = {(s.labels["replica"], s.labels["status"]): s.value
               for s in families["lmserve_requests"].samples if s.name.endswith("_total")}
    assert samples == {("ra", "200"): 3.0, ("rb", "200"): 2.0}
    assert merged.decode().count("# TYPE lmserve_requests_total counter") == 1


def test_plain_lmserve_does_not_import_ray() -> None:
    code = ("import sys, lmserve_core, lmserve_core.cli, lmserve_core.app, "
            "lmserve_core.cluster.wire; "
            "sys.exit(any(m == 'ray' or m.startswith('ray.') for m in sys.modules))")
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0


def test_cluster_help_and_checks_need_no_ray() -> None:
    """``lmserve cluster --help`` reads without Ray; running without it is one line, exit 2."""
    block = "import sys; sys.modules['ray'] = None; "  # as if Ray were not installed
    run = "from lmserve_core.cli import main; sys.exit(main({argv}))"
    helped = subprocess.run(
        [sys.executable, "-c", block + run.format(argv=["cluster", "--help"])],
        capture_output=True, text=True, timeout=120,
    )
    assert helped.returncode == 0 and "--replicas" in helped.stdout, helped.stderr
    ran = subprocess.run(
        [sys.executable, "-c", block + run.format(argv=["cluster", str(smollm2_path())])],
        capture_output=True, text=True, timeout=120,
    )
    assert ran.returncode == 2
    assert "lmserve-core[ray]" in ran.stderr and "Traceback" not in ran.stderr, ran.stderr
