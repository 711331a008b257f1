"""Fleets served on real SmolLM2-135M-Instruct: the native forward pass embeds a text as the
fleet builder's torch copy does (the index's own vectors come back, questions rank the
documents the same way), and a real ``lmserve --fleet`` process, through the openai SDK,
routes each conversation to its document, keeps that choice for its later turns (with their
``cached_tokens``), keeps interleaved conversations apart, and with ``--rag-adaptive``
moves a conversation that changes subject.

The fleet is the three documents of examples/cartridge/corpus with prefill cartridges of
``P`` rows, built once per run by ``lmserve cartridge fleet`` (its index needs the ``train``
extra: torch)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import openai
import pytest
from processes import API_KEY, RunningServer, launch

pytestmark = pytest.mark.slow

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "cartridge"
P = 48
# a question per document, a word of the answer its first P tokens hold
ROUTES = [
    ("What is the capital city of Zorvania?", "zorvania.md", "Brelmouth"),
    ("Who founded Velmora Instruments?", "velmora.md", "Kettleworth"),
    ("In which lake is the saffron quillfish found?", "quillfish.md", "Ombrelle"),
]


def smollm2() -> Path:
    from models import smollm2_path

    pytest.importorskip("lmserve_llama")
    return smollm2_path()


@pytest.fixture(scope="module")
def fleet_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    out = tmp_path_factory.mktemp("fleet") / "fleet"
    done = subprocess.run(
        [sys.executable, "-m", "lmserve_core", "cartridge", "fleet", str(EXAMPLE / "corpus"),
         str(out), "--init", "prefill", "--p", str(P), "--model", str(smollm2()),
         "--threads", "2"],
        capture_output=True, text=True, timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return out


@pytest.fixture(scope="module")
def backend() -> Iterator[Any]:
    """SmolLM2's chat backend in this process (its model, tokenizer and template)."""
    from lmserve_core.backend import ServerSettings
    from lmserve_core.plugins import backend_for_architecture

    spec = backend_for_architecture("llama")
    assert spec is not None
    b = spec.factory(str(smollm2()), ServerSettings(ctx=512, threads=2, kv_slots=1))
    yield b
    b.close()


def questions() -> list[dict[str, str]]:
    return json.loads((EXAMPLE / "questions.json").read_text())  # type: ignore[no-any-return]


# ---------------------------------------------------------------------- the embedding


def test_the_native_embedding_gives_back_the_index(fleet_dir: Path, backend: Any) -> None:
    from lmserve_core.cartridge.fleet import Fleet, FleetIndex, chunks, embed_tokens
    from lmserve_core.cartridge.route import FleetRouter

    fleet = Fleet.open(fleet_dir)
    rows, rows_raw = [], []
    for doc in fleet.docs:
        text = (EXAMPLE / "corpus" / doc.name).read_text()
        ids = backend.tokenizer.encode(text, add_special=False)
        for c in chunks(ids, fleet.embed_chunk):
            rows_raw.append(backend.model.embed(embed_tokens(backend.tokenizer, c)))
            rows.append(fleet.index.center(rows_raw[-1]))
    got = np.stack(rows)
    assert got.shape == fleet.index.embeddings.shape
    cos = np.sum(got * fleet.index.embeddings, axis=1)
    assert cos.min() > 0.999, cos
    # an index of the native vectors ranks the documents as the builder's does
    mine = FleetIndex.build(rows_raw, list(fleet.index.chunk_doc))
    for r in questions():
        ids = embed_tokens(backend.tokenizer, backend.tokenizer.encode(r["question"], add_special=False))
        q = backend.model.embed(ids)
        assert np.argsort(-mine.doc_scores(q)).tolist() == np.argsort(-fleet.index.doc_scores(q)).tolist()
    # routing by the native embedding (what the server does)
    router = FleetRouter(fleet, backend.model, backend.tokenizer)
    routed = sum(
        fleet.docs[router.select([], r["question"]).docs[0]].name == f"{r['doc']}.md"
        for r in questions()
    )
    print(f"routing accuracy (native embedding): {routed}/{len(questions())}")
    assert routed >= 24


def test_the_native_embedding_is_the_torch_one(fleet_dir: Path, backend: Any) -> None:
    torch = pytest.importorskip("torch")
    from lmserve_core.cartridge.fleet import Fleet, embed_tokens
    from lmserve_core.cartridge.train import TorchLM

    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        lm = TorchLM.from_gguf(smollm2(), "llama")
        fleet = Fleet.open(fleet_dir)
        tok = backend.tokenizer
        for r in questions()[::5]:  # two questions a document: torch's forward is slow here
            ids = embed_tokens(tok, tok.encode(r["question"], add_special=False))
            mine, theirs = backend.model.embed(ids), lm.embed(ids)
            assert mine.shape == theirs.shape == (576,)
            cos = float(mine @ theirs / np.linalg.norm(mine) / np.linalg.norm(theirs))
            assert cos > 0.9995, (r["question"], cos)
            ranked = [np.argsort(-fleet.index.doc_scores(v)).tolist() for v in (mine, theirs)]
            assert ranked[0] == ranked[1], r["question"]
    finally:
        torch.set_num_threads(threads)


def test_adaptive_stays_on_small_talk_and_moves_on_a_new_subject(
    fleet_dir: Path, backend: Any
) -> None:
    from lmserve_core.cartridge.fleet import Fleet
    from lmserve_core.cartridge.route import FleetRouter
    from lmserve_core.request import Message

    fleet = Fleet.open(fleet_dir)
    router = FleetRouter(fleet, backend.model, backend.tokenizer, adaptive=True)
    start = [Message("user", ROUTES[0][0]), Message("assistant", "Brelmouth.")]
    first = router.select(start[:1])
    assert first.how == "retrieved" and router.names(first.docs) == ["zorvania.md"]
    for said in ("Thanks!", "ok", "What else?"):
        chosen = router.select([*start, Message("user", said)])
        assert (chosen.how, chosen.prefix) == ("stayed", first.prefix), said
    moved = router.select([*start, Message("user", ROUTES[1][0])])
    assert moved.how == "switched" and router.names(moved.docs) == ["velmora.md"]
    assert moved.prefix is not first.prefix
    # the conversation now lives behind its new documents; without adaptive it would keep them
    router.adaptive = False
    assert router.select([*start, Message("user", "ok")]).docs == moved.docs


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_the_embedding_is_what_the_logits_are_read_from(arch: str) -> None:
    """On each kit family: the output matrix times the embedding gives the forward pass's
    logits (the embedding is the last row after the final norm)."""
    gguf = pytest.importorskip("gguf")
    from models import gemma3_path, smollm2_path

    from lmserve_core.backend import ServerSettings
    from lmserve_core.plugins import backend_for_architecture

    pytest.importorskip("lmserve_llama" if arch == "llama" else "lmserve_gemma")
    path = smollm2_path() if arch == "llama" else gemma3_path()
    spec = backend_for_architecture(arch)
    assert spec is not None
    b = spec.factory(str(path), ServerSettings(ctx=256, threads=2, kv_slots=1))
    try:
        ids = b.tokenizer.encode("The capital of France is", add_special=True)
        hidden = b.model.embed(ids)
        cache = b.model.new_cache(64)
        logits = b.model.forward(cache, ids, 0)
        cache.close()
        with pytest.raises(ValueError):
            b.model.embed([])
        tensors = b.gguf.tensors
        out = tensors.get("output.weight") or tensors["token_embd.weight"]
        # the best tokens and a spread of others (the whole matrix is big to dequantise)
        rows = np.unique(np.concatenate([np.argsort(-logits)[:16],
                                         np.linspace(0, logits.size - 1, 512).astype(np.int64)]))
        raw = np.array(out.data.reshape(out.shape[0], out.row_bytes)[rows])
        kind = gguf.GGMLQuantizationType(out.ggml_type)
    finally:
        b.close()
    mine = gguf.quants.dequantize(raw, kind).reshape(rows.size, -1) @ hidden
    assert np.abs(mine - logits[rows]).max() < 1e-2
    assert rows[mine.argmax()] == logits.argmax()


# ---------------------------------------------------------------------- serving


def serve(fleet_dir: Path, log_dir: Path, *extra: str) -> RunningServer:
    log_dir.mkdir(parents=True, exist_ok=True)
    return launch(str(smollm2()), "--threads", "2", "--ctx", "512", "--fleet", str(fleet_dir),
                  "--log-format", "json", *extra, scripted=False, log_dir=log_dir, timeout=180)


@pytest.fixture(scope="module")
def server(fleet_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    s = serve(fleet_dir, tmp_path_factory.mktemp("served"), "--kv-slots", "2")
    yield s
    s.stop()


def chat(server: RunningServer, messages: list[dict[str, str]]) -> tuple[str, int, int]:
    """The greedy reply, its prompt_tokens and cached_tokens."""
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0) as c:
        r = c.chat.completions.create(model="m", messages=messages,  # type: ignore[arg-type]
                                      temperature=0, max_tokens=16)
    assert r.usage is not None
    details = r.usage.prompt_tokens_details
    return r.choices[0].message.content or "", r.usage.prompt_tokens, (
        details.cached_tokens or 0 if details else 0
    )


def selections(server: RunningServer, at_least: int) -> list[dict[str, Any]]:
    """The server's ``fleet_selection`` events, once there are ``at_least``."""
    deadline = time.monotonic() + 10
    while True:
        lines = [json.loads(line) for line in server.log_text().splitlines()
                 if line.startswith("{")]
        found = [e for e in lines if e.get("event") == "fleet_selection"]
        if len(found) >= at_least or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def prompt_tokens(backend: Any, messages: list[dict[str, str]]) -> int:
    from lmserve_core.request import Message, NormalizedRequest

    req = NormalizedRequest(id="x", dialect="chat",
                            messages=[Message(m["role"], m["content"]) for m in messages])  # type: ignore[arg-type]
    return int(backend.count_tokens(req))


def test_each_question_is_served_behind_its_document(server: RunningServer, backend: Any) -> None:
    seen = len(selections(server, 0))
    routed = 0
    for i, (question, doc, word) in enumerate(ROUTES):
        messages = [{"role": "user", "content": question}]
        answer, n_prompt, cached = chat(server, messages)
        event = selections(server, seen + i + 1)[seen + i]
        assert event["how"] == "retrieved" and len(event["scores"]) == 1
        routed += event["docs"] == [doc]
        assert word in answer, (question, answer)  # the answer comes from the cartridge
        # the prefix is in no usage: the prompt is the conversation's own tokens
        assert n_prompt == prompt_tokens(backend, messages) and cached == 0
    assert routed == len(ROUTES)


def test_a_follow_up_keeps_its_documents_and_its_cache(server: RunningServer) -> None:
    question, doc, _ = ROUTES[0]
    first = [{"role": "user", "content": question}]
    reply, n_first, _ = chat(server, first)
    second = [*first, {"role": "assistant", "content": reply},
              {"role": "user", "content": "Tell me about the saffron quillfish instead."}]
    seen = len(selections(server, 0))
    _, n_second, cached = chat(server, second)
    event = selections(server, seen + 1)[seen]
    assert (event["how"], event["docs"]) == ("kept", [doc])  # sticky: no re-retrieval
    assert n_first < cached < n_second


def test_interleaved_conversations_keep_their_documents(server: RunningServer) -> None:
    convs = [[{"role": "user", "content": f"Please answer briefly. {ROUTES[i][0]}"}] for i in (1, 2)]
    seen = len(selections(server, 0))
    for conv in convs:
        reply, _, _ = chat(server, conv)
        conv += [{"role": "assistant", "content": reply},
                 {"role": "user", "content": "When did that happen?"}]
    cached = [chat(server, conv)[2] for conv in convs]
    events = selections(server, seen + 4)[seen:]
    assert [(e["how"], e["docs"]) for e in events] == [
        ("retrieved", [ROUTES[1][1]]), ("retrieved", [ROUTES[2][1]]),
        ("kept", [ROUTES[1][1]]), ("kept", [ROUTES[2][1]]),
    ]
    assert all(c > 20 for c in cached), cached


def test_adaptive_moves_a_conversation_of_two_documents(
    fleet_dir: Path, tmp_path: Path
) -> None:
    s = serve(fleet_dir, tmp_path, "--rag-adaptive", "--rag-margin", "0.05", "--rag-docs", "2")
    try:
        conv = [{"role": "user", "content": ROUTES[0][0]}]
        reply, _, _ = chat(s, conv)
        assert ROUTES[0][2] in reply  # behind two documents' rows, the best one first
        conv += [{"role": "assistant", "content": reply},
                 {"role": "user", "content": "What is the highest mountain in Zorvania?"}]
        reply, _, same = chat(s, conv)
        conv += [{"role": "assistant", "content": reply},
                 {"role": "user", "content": "Now something else: how long is an adult saffron "
                  "quillfish, and in which lake does the quillfish live?"}]
        _, _, moved = chat(s, conv)
        events = selections(s, 3)
    finally:
        s.stop()
    assert [(e["how"], e["docs"][0], len(e["docs"])) for e in events] == [
        ("retrieved", "zorvania.md", 2), ("stayed", "zorvania.md", 2),
        ("switched", "quillfish.md", 2),
    ], events
    assert "quillfish.md" not in events[0]["docs"]  # it came from outside the selection
    assert same > 0 and moved == 0  # a move reads the whole conversation again


def run_lmserve(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "lmserve_core", *args], capture_output=True,
                          text=True, timeout=300)


def test_a_fleet_of_another_model_is_refused(fleet_dir: Path) -> None:
    from models import gemma3_path

    pytest.importorskip("lmserve_gemma")
    done = run_lmserve(str(gemma3_path()), "--fleet", str(fleet_dir), "--threads", "2")
    assert done.returncode == 2
    assert "--fleet:" in done.stderr and "built with another model" in done.stderr, done.stderr
