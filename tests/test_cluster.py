"""``lmserve cluster``: two SmolLM2 replicas (one thread each) on a local Ray cluster behind
one ingress, through the official SDKs; affinity, overload, a replica killed mid-stream and
the graceful stop. One cluster for the whole module: Ray is slow to start on two cores."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import anthropic
import httpx
import openai
import pytest
from models import smollm2_path
from processes import API_KEY, RunningServer, launch

from lmserve_core.testing import soak

pytestmark = pytest.mark.slow

if importlib.util.find_spec("ray") is None or importlib.util.find_spec("ray.serve") is None:
    pytest.skip("needs ray[serve] (pip install lmserve-core[ray])", allow_module_level=True)
if importlib.util.find_spec("lmserve_llama") is None:
    pytest.skip("needs lmserve-llama", allow_module_level=True)

AUTH = {"authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):  # type: ignore[no-untyped-def]
    # 2 replicas x 1 CPU (1 thread each), 4 generations at once and 2 waiting per replica;
    # 8 KV slots each so that every conversation a replica owns keeps its cache
    running = launch(
        "--replicas", "2", "--replica-cpus", "1", "--queue", "2", "--kv-slots", "8",
        "--ctx", "2048", "--log-level", "warning", subcommand=("cluster", str(smollm2_path())),
        env={"RAY_USAGE_STATS_ENABLED": "0"}, scripted=False, timeout=240,
        log_dir=tmp_path_factory.mktemp("cluster"),
    )
    yield running
    # the graceful stop drains: a stream in progress at SIGTERM runs to its end
    with httpx.stream("POST", running.base_url + "/v1/chat/completions", headers=AUTH,
                      timeout=60, json={"model": "m", "max_tokens": 200, "stream": True,
                                        "messages": [{"role": "user", "content": "A story."}]}
                      ) as reply:
        lines = reply.iter_lines()
        assert next(lines).startswith("data: ")
        running.process.send_signal(signal.SIGTERM)
        rest = list(lines)
    assert "data: [DONE]" in rest and not any('"error"' in line for line in rest)
    code = running.stop(timeout=90)  # Ray's own shutdown follows
    assert code == 0, running.log_text()[-4000:]


@pytest.fixture
def oai(cluster):  # type: ignore[no-untyped-def]
    with openai.OpenAI(base_url=cluster.base_url + "/v1", api_key=API_KEY, max_retries=0,
                       timeout=120) as c:
        yield c


@pytest.fixture
def ant(cluster):  # type: ignore[no-untyped-def]
    with anthropic.Anthropic(base_url=cluster.base_url, api_key=API_KEY, max_retries=0,
                             timeout=120) as c:
        yield c


QUESTION = "What is the capital of France? Answer in one word."


def replicas(cluster: RunningServer, want: int = 2, timeout: float = 30) -> dict[str, int]:
    return soak.cluster_replicas(cluster.base_url, want=want, timeout=timeout, headers=AUTH)


def test_openai_chat_and_completions_through_the_ingress(oai) -> None:
    chat = oai.chat.completions.create(
        model="m", messages=[{"role": "user", "content": QUESTION}], temperature=0, max_tokens=8
    )
    assert "Paris" in chat.choices[0].message.content
    text = ""
    for chunk in oai.chat.completions.create(
        model="m", messages=[{"role": "user", "content": QUESTION}], temperature=0,
        max_tokens=8, stream=True, stream_options={"include_usage": True},
    ):
        if chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
    assert "Paris" in text
    done = oai.completions.create(model="m", prompt="The capital of France is", max_tokens=4,
                                  temperature=0)
    assert "Paris" in done.choices[0].text
    assert [m.id for m in oai.models.list()] == [chat.model]


def test_responses_and_messages_through_the_ingress(oai, ant) -> None:
    response = oai.responses.create(model="m", input=QUESTION, temperature=0,
                                    max_output_tokens=8)
    assert "Paris" in response.output_text
    with oai.responses.stream(model="m", input=QUESTION, temperature=0,
                              max_output_tokens=8) as stream:
        assert "Paris" in stream.get_final_response().output_text
    message = ant.messages.create(model="m", max_tokens=8, extra_body={"temperature": 0},
                                  messages=[{"role": "user", "content": QUESTION}])
    assert "Paris" in message.content[0].text
    with ant.messages.stream(model="m", max_tokens=8, extra_body={"temperature": 0},
                             messages=[{"role": "user", "content": QUESTION}]) as stream:
        final = stream.get_final_message()
    assert "Paris" in final.content[0].text and final.usage.output_tokens > 0


def test_errors_health_and_metrics(cluster, oai, ant) -> None:
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(model="m", messages=[], max_tokens=4)
    with pytest.raises(anthropic.AuthenticationError):
        anthropic.Anthropic(base_url=cluster.base_url, api_key="wrong", max_retries=0).messages.create(
            model="m", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert httpx.get(cluster.base_url + "/health").json()["status"] == "ok"
    names = replicas(cluster)
    assert len(names) == 2
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:  # the replicas leave their figures every second
        text = httpx.get(cluster.base_url + "/metrics", headers=AUTH).text
        if all(f'replica="{n}"' in text for n in names):
            break
        time.sleep(0.5)
    assert "# TYPE lmserve_generated_tokens_total counter" in text
    for name in names:
        assert f'replica="{name}"' in text
    assert 'lmserve_route_moves_total{replica="ingress"}' in text  # the ingress's own


def active(cluster: RunningServer) -> float:
    text = httpx.get(cluster.base_url + "/metrics", headers=AUTH).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("lmserve_active_sequences{"))


def test_a_client_that_leaves_cancels_its_generation_on_the_replica(cluster) -> None:
    # greedy counting goes on: nothing but the client leaving ends it before 1500 tokens
    body = {"model": "m", "max_tokens": 1500, "stream": True, "temperature": 0,
            "prompt": "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,"}
    with httpx.stream("POST", cluster.base_url + "/v1/completions", headers=AUTH,
                      json=body, timeout=60) as reply:
        lines = reply.iter_lines()
        for _ in range(6):
            next(lines)
        deadline = time.monotonic() + 10
        while active(cluster) < 1 and time.monotonic() < deadline:
            time.sleep(0.3)
        assert active(cluster) >= 1
    # 1500 tokens take a replica's thread far longer than this
    deadline = time.monotonic() + 8
    while active(cluster) > 0 and time.monotonic() < deadline:
        time.sleep(0.3)
    assert active(cluster) == 0


SYSTEM = ("You are a patient tutor. Answer briefly and plainly, in one or two sentences, "
          "and never use lists or headings. The student is working through topic {i}.")
TOPICS = ["rivers", "volcanoes", "bread", "bicycles", "planets", "bees", "clocks", "glass"]


def two_turns(base_url: str, routing: str) -> list[float]:
    """8 conversations of two turns, interleaved: each one's second turn comes after the
    next one's first (c0 c1 c0' c2 c1' c3 c2' ...). The share of each conversation's history
    (first prompt + reply) its second turn found cached."""
    headers = {**AUTH, "x-lmserve-routing": routing}

    def ask(messages: list[dict[str, str]]) -> dict[str, Any]:
        r = httpx.post(base_url + "/v1/chat/completions", headers=headers, timeout=120, json={
            "model": "m", "messages": messages, "temperature": 0, "max_tokens": 12})
        assert r.status_code == 200, r.text
        return r.json()

    # conversations of their own for each run: the replicas still hold the other run's
    convs = [[{"role": "system", "content": SYSTEM.format(i=i)},
              {"role": "user", "content": f"Tell me one fact about {t} ({routing})."}]
             for i, t in enumerate(TOPICS)]
    firsts: list[dict[str, Any]] = []
    shares = []
    for step in range(len(convs) + 1):
        if step < len(convs):
            firsts.append(ask(convs[step]))
            convs[step] += [firsts[step]["choices"][0]["message"],
                            {"role": "user", "content": "And one more?"}]
        if step > 0:
            first, second = firsts[step - 1], ask(convs[step - 1])
            history = first["usage"]["prompt_tokens"] + first["usage"]["completion_tokens"]
            shares.append(second["usage"]["prompt_tokens_details"]["cached_tokens"] / history)
    return shares


def test_affinity_keeps_conversations_cached(cluster) -> None:
    affine = two_turns(cluster.base_url, "prefix")
    spread = two_turns(cluster.base_url, "round-robin")
    print(f"\nsecond-turn cached share of the history, prefix affinity: "
          f"{sum(affine) / len(affine):.1%} (min {min(affine):.1%}); round robin: "
          f"{sum(spread) / len(spread):.1%} (min {min(spread):.1%})")
    assert min(affine) >= 0.9


def test_a_burst_of_conversations_spreads_and_each_keeps_its_cache(cluster) -> None:
    """Eight new conversations at once, then their second turns at once: each replica takes
    some (at most what it admits: 4 running and 2 waiting), and every second turn finds its
    first turn's replica and its history cached."""
    def ask(messages: list[dict[str, str]]) -> httpx.Response:
        r = httpx.post(cluster.base_url + "/v1/chat/completions", headers=AUTH, timeout=180,
                       json={"model": "m", "messages": messages, "temperature": 0,
                             "max_tokens": 16})
        assert r.status_code == 200, r.text
        return r

    convs = [[{"role": "system", "content": SYSTEM.format(i=100 + i)},
              {"role": "user", "content": f"Tell me one fact about {TOPICS[i % len(TOPICS)]}."}]
             for i in range(8)]
    with ThreadPoolExecutor(8) as pool:
        firsts = list(pool.map(ask, convs))
    for conv, first in zip(convs, firsts, strict=True):
        conv += [first.json()["choices"][0]["message"], {"role": "user", "content": "More?"}]
    with ThreadPoolExecutor(8) as pool:
        seconds = list(pool.map(ask, convs))
    homes = [r.headers["x-lmserve-replica"] for r in firsts]
    assert len(set(homes)) == 2 and max(homes.count(h) for h in homes) <= 6, homes
    assert [r.headers["x-lmserve-replica"] for r in seconds] == homes
    for first, second in zip(firsts, seconds, strict=True):
        usage = first.json()["usage"]
        history = usage["prompt_tokens"] + usage["completion_tokens"]
        assert second.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 0.9 * history


def test_a_session_stays_on_its_replica_until_it_is_full(cluster) -> None:
    headers = {**AUTH, "x-session-id": "one-session"}

    def ask(max_tokens: int) -> httpx.Response:
        return httpx.post(cluster.base_url + "/v1/chat/completions", headers=headers,
                          timeout=120, json={"model": "m", "max_tokens": max_tokens,
                                             "messages": [{"role": "user", "content": "Hi"}]})

    one_by_one = {ask(2).headers["x-lmserve-replica"] for _ in range(4)}
    assert len(one_by_one) == 1
    # 10 at once: the session's replica takes what it can (4 running, 2 waiting), the
    # least loaded other replica the rest
    with ThreadPoolExecutor(10) as pool:
        answers = list(pool.map(ask, [48] * 10))
    assert [r.status_code for r in answers] == [200] * 10, [r.text for r in answers if r.status_code != 200]
    served = [r.headers["x-lmserve-replica"] for r in answers]
    assert len(set(served)) == 2 and served.count(one_by_one.pop()) >= 4


def test_overload_answers_429_with_retry_after(cluster) -> None:
    async def one(client: httpx.AsyncClient, i: int) -> httpx.Response:
        story = f"Write a long story about ship number {i}."  # hundreds of tokens, not a line
        if i % 2:
            return await client.post("/v1/messages", headers={"anthropic-version": "2023-06-01"},
                                     json={"model": "m", "max_tokens": 300, "messages": [
                                         {"role": "user", "content": story}]})
        return await client.post("/v1/chat/completions", json={
            "model": "m", "max_tokens": 300, "messages": [
                {"role": "user", "content": story}]})

    async def flood() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=cluster.base_url, headers=AUTH, timeout=120,
                                     limits=httpx.Limits(max_connections=64)) as client:
            return await asyncio.wait_for(
                asyncio.gather(*(one(client, i) for i in range(40))), 180)

    started = time.monotonic()
    answers = asyncio.run(flood())
    statuses = [r.status_code for r in answers]
    print(f"\n40 at once: {statuses.count(200)} x 200, {statuses.count(429)} x 429 "
          f"in {time.monotonic() - started:.1f}s")
    # 12 fit at once (4 running and 2 waiting per replica); the rest wait up to 2 s for
    # room, which these replies leave few of them
    assert set(statuses) <= {200, 429}
    assert statuses.count(200) >= 12 and statuses.count(429) >= 1
    for i, r in enumerate(answers):
        if r.status_code == 429:
            assert int(r.headers["retry-after"]) >= 1
            body = r.json()
            if i % 2:
                assert body["type"] == "error" and body["error"]["type"] == "rate_limit_error"
            else:
                assert body["error"]["type"] == "rate_limit_error"


def test_soak_with_a_replica_killed_loses_only_its_requests(cluster) -> None:
    """Twelve users for a minute, a third of the replies cut by their reader, a replica
    killed halfway: nothing hangs, only requests on the killed replica are lost, each of its
    conversations is served again, and the ingress and the other replica keep their
    descriptors and memory."""
    before = replicas(cluster)
    assert len(before) == 2
    victim = sorted(before)[0]
    survivor = next(name for name in before if name != victim)

    def kill() -> str:
        os.kill(before[victim], signal.SIGKILL)
        return victim

    def watch() -> dict[str, int]:
        pid = soak.cluster_ingress_pid()
        return {"replica": before[survivor], **({"ingress": pid} if pid else {})}

    report = asyncio.run(soak.soak(cluster.base_url, seconds=60, clients=12, fault=kill,
                                   watch=watch, api_key=API_KEY))
    figures = soak.summary(report)
    print(f"\nsoak: {figures}")
    # the survivor's KV slots commit as the lost replica's conversations move to it: at
    # most 8 slots of 2048 positions, 47 MiB each
    assert soak.check(report, mib_slack={"replica": 8 * 47}) == []
    assert figures["done"] >= 40 and figures["cut"] >= 10 and figures["faulted_conversations"]
    assert set(figures["processes"]) == {"replica", "ingress"}
    assert len(replicas(cluster, timeout=120)) == 2  # the lost one came back


def test_replica_killed_mid_stream(cluster, oai) -> None:
    before = replicas(cluster)
    assert len(before) == 2
    stream = oai.chat.completions.with_raw_response.create(
        model="m", messages=[{"role": "user", "content": "Write a long story about a ship."}],
        max_tokens=300, stream=True,
    )
    victim = stream.headers["x-lmserve-replica"]
    chunks = stream.parse()
    text = ""
    with pytest.raises(openai.APIError) as failure:
        for n, chunk in enumerate(chunks):
            if chunk.choices and chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
            if n == 3:
                os.kill(before[victim], signal.SIGKILL)
    assert text and "lost" in str(failure.value)
    # every later request succeeds: routed around the lost replica while it comes back
    for _ in range(4):
        reply = oai.chat.completions.create(
            model="m", messages=[{"role": "user", "content": QUESTION}], max_tokens=4)
        assert reply.choices[0].message.content
    after = replicas(cluster, timeout=120)
    assert len(after) == 2 and victim not in after
    assert before[victim] not in after.values()


def test_replica_killed_mid_stream_in_anthropic_messages(cluster, ant) -> None:
    before = replicas(cluster)
    assert len(before) == 2
    with ant.messages.with_streaming_response.create(
        model="m", max_tokens=300, stream=True,
        messages=[{"role": "user", "content": "Write a long story about a forest."}],
    ) as raw:
        victim = raw.headers["x-lmserve-replica"]
        events = []
        with pytest.raises(anthropic.APIError) as failure:
            for event in raw.parse():
                events.append(event.type)
                if len(events) == 4:
                    os.kill(before[victim], signal.SIGKILL)
    assert "content_block_delta" in events and "message_stop" not in events
    assert "lost" in str(failure.value)
    message = ant.messages.create(model="m", max_tokens=4,
                                  messages=[{"role": "user", "content": QUESTION}])
    assert message.content[0].text
    assert len(replicas(cluster, timeout=120)) == 2


@pytest.mark.parametrize(("args", "message"), [
    (["--replicas", "0"], "--replicas must be at least 1"),
    (["--min-replicas", "3", "--max-replicas", "2"], "--min-replicas is above --max-replicas"),
    (["--queue", "-1"], "--queue must be at least 0"),
])
def test_usage_errors_before_ray_starts(args: list[str], message: str) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "lmserve_core", "cluster", str(smollm2_path()), *args],
        capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and message in done.stderr


def test_a_missing_model_is_refused_before_ray_starts(tmp_path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "lmserve_core", "cluster", str(tmp_path / "none.gguf")],
        capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and "model file not found" in done.stderr


def test_serve_run_builds_the_same_application() -> None:
    from ray import serve

    from lmserve_core.cluster import command

    built = command.app({"argv": f"{smollm2_path()} --replicas 3 --replica-cpus 2 --queue 5"})
    assert isinstance(built, serve.Application)
    cluster, args, argv = command.parse([str(smollm2_path()), "--replicas", "3", "--batch", "2"])
    assert (cluster.replicas, args.batch) == (3, 2)
    # one thread per CPU reserved; slots for every conversation routed to a replica
    assert argv[-4:] == ["--threads", "1", "--kv-slots", "auto"]
    with pytest.raises(ValueError, match="--replicas must be at least 1"):
        command.app({"argv": f"{smollm2_path()} --replicas 0"})
