"""Embeddings and reranking on Qwen3: the pooled states against transformers, and
``/v1/embeddings`` and ``/v1/rerank`` of a real ``lmserve`` through the OpenAI SDK,
LangChain's ``OpenAIEmbeddings`` and LlamaIndex's ``OpenAIEmbedding``."""

from __future__ import annotations

import base64
import concurrent.futures
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import numpy as np
import pytest
from lmserve_qwen3.model import Qwen3Model
from synthetic import RERANK_TEMPLATE, rerank_ids

from lmserve_core.embeddings import Embedder, embedder_for, file_pooling
from lmserve_core.gguf_file import GGUFFile
from lmserve_core.testing.serving import lmserve_process
from lmserve_core.tokenizer import Tokenizer

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

TEXTS = [
    "hello world",
    "The capital of France is Paris, a city of bridges, old stones and long avenues. " * 3,
    "x",
    "Qwen3 embeds the <|endoftext|> token it is given.",
]
QUERY = "What is the capital of France?"
DOCS = ["Paris is the capital of France.", "Bananas are yellow.", "The Seine flows west."]


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def reference_embedding(hf: Any, ids: list[int], pooling: str) -> np.ndarray:
    """transformers: the last layer after the final norm, pooled, L2-normalised."""
    with torch.no_grad():
        states = hf.model(torch.tensor([ids])).last_hidden_state[0].double().numpy()
    pooled = {"last": states[-1], "mean": states.mean(0), "cls": states[0]}[pooling]
    return np.asarray(pooled / np.linalg.norm(pooled))


def assert_embed(texts: list[str], vectors: list[Any], hf: Any, tokenizer: Tokenizer) -> None:
    """Each vector is the text's last-token embedding, as transformers computes it."""
    assert len(vectors) == len(texts)
    for text, vector in zip(texts, vectors, strict=True):
        ids = tokenizer.encode(text, add_special=True, parse_special=True)
        assert cosine(np.array(vector), reference_embedding(hf, ids, "last")) >= 0.9999


def reference_score(hf: Any, ids: list[int]) -> float:
    """Qwen3-Reranker's score: P("yes") over the pair "yes"/"no" at the last token."""
    yes, no = rerank_ids()
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0, -1].double()
    return float(torch.softmax(torch.stack([logits[yes], logits[no]]), 0)[0])


@pytest.fixture(scope="module")
def embedding_model(synthetic: Any) -> Any:
    return synthetic("qwen3-embedding", "f32")


@pytest.fixture(scope="module")
def reranker_model(synthetic: Any) -> Any:
    return synthetic("qwen3-reranker", "f32")


# ------------------------------------------------------------------ numerics


def test_the_files_declare_what_llama_cpp_writes(embedding_model: Any, reranker_model: Any) -> None:
    with GGUFFile.open(embedding_model.gguf) as g:
        assert file_pooling(g) == "last"
    with GGUFFile.open(reranker_model.gguf) as g:
        assert file_pooling(g) == "rank"
        assert g.get("tokenizer.chat_template.rerank") == RERANK_TEMPLATE
        assert g.tensors["cls.output.weight"].shape == (2, 64)


@pytest.mark.parametrize("pooling", ["last", "mean", "cls"])
def test_pooled_embeddings_match_transformers(embedding_model: Any, pooling: str) -> None:
    gguf = GGUFFile.open(embedding_model.gguf)
    # a batch of 16 tokens: the long input runs in pieces, the short ones share passes
    model = Qwen3Model.load(gguf, n_batch=16)
    tokenizer = Tokenizer.from_gguf(gguf)
    hf = embedding_model.load_hf()
    embedder = Embedder(model, tokenizer, gguf, pooling, max_tokens=512)
    inputs = [embedder.tokens(text) for text in TEXTS]
    assert len(inputs[1]) > 16 and inputs[3][-1] != inputs[3][-2]
    pooled = embedder.embed(inputs)
    assert pooled.rows.shape == (len(TEXTS), 64)
    assert pooled.tokens == sum(len(x) for x in inputs)
    for ids, row in zip(inputs, pooled.rows, strict=True):
        assert abs(float(np.linalg.norm(row)) - 1.0) < 1e-5
        assert cosine(row, reference_embedding(hf, ids, pooling)) >= 0.9999
    # batched or alone, an input embeds the same
    alone = embedder.embed([inputs[2]]).rows[0]
    assert cosine(alone, pooled.rows[2]) >= 0.99999
    model.close()


def test_rerank_scores_match_transformers(reranker_model: Any) -> None:
    gguf = GGUFFile.open(reranker_model.gguf)
    model = Qwen3Model.load(gguf)
    embedder = Embedder(model, Tokenizer.from_gguf(gguf), gguf, "rank", max_tokens=512)
    hf = reranker_model.load_hf()
    inputs = [embedder.rerank_tokens(QUERY, doc) for doc in DOCS]
    text = embedder.tokenizer.decode(inputs[0])
    assert text.startswith("<|im_start|>system\nJudge") and "<Document>: Paris is" in text
    scores = embedder.rank(inputs).rows
    for ids, score in zip(inputs, scores, strict=True):
        assert 0.0 < score < 1.0
        assert abs(float(score) - reference_score(hf, ids)) < 1e-4
    model.close()


def test_a_chat_model_embeds_only_when_asked(synthetic: Any) -> None:
    class Backend:
        name = "qwen3"
        context_length = 64

    backend = Backend()
    gguf = GGUFFile.open(synthetic("qwen3", "f32").gguf)
    backend.gguf = gguf  # type: ignore[attr-defined]
    backend.model = Qwen3Model.load(gguf)  # type: ignore[attr-defined]
    backend.tokenizer = Tokenizer.from_gguf(gguf)  # type: ignore[attr-defined]
    assert file_pooling(gguf) is None
    assert embedder_for(backend) is None
    embedder = embedder_for(backend, enabled=True)
    assert embedder is not None and embedder.pooling == "last" and not embedder.ranks
    mean = embedder_for(backend, pooling="mean")
    assert mean is not None and mean.pooling == "mean"
    with pytest.raises(ValueError, match="classifier head"):
        embedder_for(backend, pooling="rank")
    backend.model.close()  # type: ignore[attr-defined]


# ------------------------------------------------------------------ a real lmserve


def _start(path: Any, *extra: str, tmp: Any) -> Iterator[str]:
    args = ("--backend", "qwen3", str(path), "--ctx", "512", "--threads", "2", *extra)
    with lmserve_process(*args, log=tmp / "lmserve.log") as base:
        yield base


@pytest.fixture(scope="module")
def embedding_server(embedding_model: Any, tmp_path_factory: Any) -> Iterator[str]:
    yield from _start(embedding_model.gguf, tmp=tmp_path_factory.mktemp("embed"))


@pytest.fixture(scope="module")
def reranker_server(reranker_model: Any, tmp_path_factory: Any) -> Iterator[str]:
    yield from _start(reranker_model.gguf, tmp=tmp_path_factory.mktemp("rerank"))


@pytest.fixture(scope="module")
def hf_embedding(embedding_model: Any) -> Any:
    return embedding_model.load_hf()


@pytest.fixture(scope="module")
def tokenizer(embedding_model: Any) -> Tokenizer:
    with GGUFFile.open(embedding_model.gguf) as g:
        return Tokenizer.from_gguf(g)


def test_openai_sdk_embeds_every_input_shape(
    embedding_server: str, hf_embedding: Any, tokenizer: Tokenizer
) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=embedding_server + "/v1", api_key="unused", max_retries=0)
    reply = client.embeddings.create(model="any", input=TEXTS[:3], encoding_format="float")
    assert [d.index for d in reply.data] == [0, 1, 2]
    ids = [tokenizer.encode(t, add_special=True, parse_special=True) for t in TEXTS[:3]]
    assert reply.usage.prompt_tokens == reply.usage.total_tokens == sum(len(x) for x in ids)
    for x, item in zip(ids, reply.data, strict=True):
        assert len(item.embedding) == 64
        assert (
            cosine(np.array(item.embedding), reference_embedding(hf_embedding, x, "last")) >= 0.9999
        )
    # the SDK's default: base64, decoded by the SDK into the same floats
    # (alone or beside others an input runs through other kernels: equal to ~1e-5)
    b64 = client.embeddings.create(model="any", input=TEXTS[0])
    assert cosine(np.array(b64.data[0].embedding), np.array(reply.data[0].embedding)) > 0.99999
    # token ids, one list and a list of lists
    one = client.embeddings.create(model="any", input=ids[1], encoding_format="float")
    assert cosine(np.array(one.data[0].embedding), np.array(reply.data[1].embedding)) > 0.99999
    many = client.embeddings.create(model="any", input=ids, encoding_format="float")
    assert np.allclose(
        [d.embedding for d in many.data], [d.embedding for d in reply.data], atol=1e-6
    )
    # dimensions: the first N, renormalised
    short = client.embeddings.create(
        model="any", input=TEXTS[0], dimensions=16, encoding_format="float"
    )
    head = np.array(b64.data[0].embedding[:16])
    assert len(short.data[0].embedding) == 16
    assert np.allclose(short.data[0].embedding, head / np.linalg.norm(head), atol=1e-6)


def test_concurrent_requests_each_get_their_own_vectors(embedding_server: str) -> None:
    """Requests that arrive together share the worker's passes; each still gets its own."""
    bodies = [{"input": [f"request {i}: {t}" for t in TEXTS[: 1 + i % 3]]} for i in range(8)]
    url = embedding_server + "/v1/embeddings"
    alone = [httpx.post(url, json=body, timeout=60).json() for body in bodies]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda b: httpx.post(url, json=b, timeout=60).json(), bodies))
    for a, b in zip(alone, together, strict=True):
        assert a["usage"] == b["usage"] and len(a["data"]) == len(b["data"])
        for x, y in zip(a["data"], b["data"], strict=True):
            assert cosine(np.array(x["embedding"]), np.array(y["embedding"])) > 0.99999


def test_embeddings_base64_is_little_endian_float32(embedding_server: str) -> None:
    body = {"input": ["a", "b"], "encoding_format": "base64"}
    data = httpx.post(embedding_server + "/v1/embeddings", json=body, timeout=30).json()
    floats = httpx.post(
        embedding_server + "/v1/embeddings", json={"input": ["a", "b"]}, timeout=30
    ).json()
    for enc, plain in zip(data["data"], floats["data"], strict=True):
        decoded = np.frombuffer(base64.b64decode(enc["embedding"]), "<f4")
        assert np.allclose(decoded, plain["embedding"], atol=1e-7)
    assert data["object"] == "list" and data["data"][0]["object"] == "embedding"


@pytest.mark.parametrize(
    ("body", "status", "needle"),
    [
        ({"input": []}, 400, "'input' must not be empty"),
        ({"input": ""}, 400, "'input[0]' is empty"),
        ({"input": ["ok", [1, 2, 999999]]}, 400, "'input[1]': token id 999999"),
        ({"input": ["ok", {"text": 1}]}, 400, "'input[1]' must be a string"),
        ({"input": [[5] * 600]}, 400, "'input[0]' has 600 tokens"),
        ({"input": "a", "dimensions": 65}, 400, "'dimensions'"),
        ({"input": "a", "encoding_format": "int8"}, 400, "encoding_format"),
        ({"query": "q", "documents": ["a"]}, None, None),  # to /v1/rerank, below
    ],
)
def test_embeddings_errors_in_openai_shape(
    embedding_server: str, body: dict[str, Any], status: int | None, needle: str | None
) -> None:
    if status is None:  # an embedding model does not rerank
        reply = httpx.post(embedding_server + "/v1/rerank", json=body, timeout=30)
        assert reply.status_code == 400
        assert "does not serve reranking" in reply.json()["error"]["message"]
        return
    reply = httpx.post(embedding_server + "/v1/embeddings", json=body, timeout=30)
    assert reply.status_code == status, reply.text
    error = reply.json()["error"]
    assert needle in error["message"] and error["type"] == "invalid_request_error"


def test_models_meta_says_what_is_served(embedding_server: str, reranker_server: str) -> None:
    meta = httpx.get(embedding_server + "/v1/models", timeout=10).json()["data"][0]["meta"]
    assert meta["embeddings"] is True and meta["rerank"] is False
    assert meta["pooling"] == "last" and meta["n_embd"] == 64
    meta = httpx.get(reranker_server + "/v1/models", timeout=10).json()["data"][0]["meta"]
    assert meta["rerank"] is True and meta["pooling"] == "rank"


def langchain_vectors(base: str) -> list[Any]:
    lc = pytest.importorskip("langchain_openai")
    # check_embedding_ctx_length=False: send the texts, not tiktoken's ids of them
    client = lc.OpenAIEmbeddings(
        model="any",
        base_url=base,
        api_key="unused",
        check_embedding_ctx_length=False,
        max_retries=0,
    )
    return [*client.embed_documents(TEXTS[:2]), client.embed_query(TEXTS[2])]


def llama_index_vectors(base: str) -> list[Any]:
    li = pytest.importorskip("llama_index.embeddings.openai")
    client = li.OpenAIEmbedding(
        model="text-embedding-3-small", api_base=base, api_key="unused", max_retries=0
    )
    return [*client.get_text_embedding_batch(TEXTS[:2]), client.get_query_embedding(TEXTS[2])]


@pytest.mark.parametrize("vectors_of", [langchain_vectors, llama_index_vectors])
def test_rag_clients_embed_as_transformers_does(
    embedding_server: str, hf_embedding: Any, tokenizer: Tokenizer, vectors_of: Any
) -> None:
    """LangChain's OpenAIEmbeddings and LlamaIndex's OpenAIEmbedding, documents and query."""
    assert_embed(TEXTS[:3], vectors_of(embedding_server + "/v1"), hf_embedding, tokenizer)


def test_rerank_in_jina_cohere_and_tei_shapes(reranker_server: str, reranker_model: Any) -> None:
    hf = reranker_model.load_hf()
    with GGUFFile.open(reranker_model.gguf) as g:
        tok = Tokenizer.from_gguf(g)
    expected = []
    for doc in DOCS:
        prompt = RERANK_TEMPLATE.replace("{query}", QUERY).replace("{document}", doc)
        expected.append(reference_score(hf, tok.encode(prompt, parse_special=True)))
    order = sorted(range(len(DOCS)), key=lambda i: expected[i], reverse=True)

    for path in ("/v1/rerank", "/rerank"):
        reply = httpx.post(
            reranker_server + path,
            timeout=30,
            json={
                "model": "m",
                "query": QUERY,
                "documents": DOCS,
                "top_n": 2,
                "return_documents": True,
            },
        )
        assert reply.status_code == 200, reply.text
        body = reply.json()
        assert body["object"] == "list" and body["usage"]["prompt_tokens"] > 0
        results = body["results"]
        assert [r["index"] for r in results] == order[:2]
        for r in results:
            assert abs(r["relevance_score"] - expected[r["index"]]) < 1e-4
            assert r["document"] == {"text": DOCS[r["index"]]}
    # Jina's documents as objects
    reply = httpx.post(
        reranker_server + "/v1/rerank",
        timeout=30,
        json={"query": QUERY, "documents": [{"text": d} for d in DOCS]},
    )
    assert [r["index"] for r in reply.json()["results"]] == order
    assert "document" not in reply.json()["results"][0]
    # TEI: texts in, a bare list out
    tei = httpx.post(
        reranker_server + "/rerank",
        timeout=30,
        json={"query": QUERY, "texts": DOCS, "return_text": True},
    ).json()
    assert [r["index"] for r in tei] == order and tei[0]["text"] == DOCS[order[0]]
    assert abs(tei[0]["score"] - expected[order[0]]) < 1e-4
    empty = httpx.post(
        reranker_server + "/v1/rerank", timeout=30, json={"query": QUERY, "documents": []}
    )
    assert empty.status_code == 400 and "'documents'" in empty.json()["error"]["message"]


def test_a_chat_model_serves_embeddings_with_the_flag(
    synthetic: Any, tokenizer: Tokenizer, tmp_path: Any
) -> None:
    openai = pytest.importorskip("openai")
    model = synthetic("qwen3", "f32")
    args = ("--backend", "qwen3", str(model.gguf), "--ctx", "512", "--threads", "2")
    with lmserve_process(*args, "--embeddings", log=tmp_path / "lmserve.log") as base:
        client = openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0)
        reply = client.embeddings.create(model="any", input=TEXTS[:2])
        assert_embed(TEXTS[:2], [d.embedding for d in reply.data], model.load_hf(), tokenizer)
        chat = client.chat.completions.create(
            model="any", messages=[{"role": "user", "content": "Hi"}], max_tokens=4
        )
        assert chat.choices[0].finish_reason in ("stop", "length")
        meta = httpx.get(base + "/v1/models", timeout=10).json()["data"][0]["meta"]
        assert meta["embeddings"] is True and meta["pooling"] == "last"
        refused = httpx.post(base + "/v1/rerank", json={"query": "q", "documents": ["d"]})
        assert refused.status_code == 400
    # ranking needs the classifier head a chat model's file does not have
    out = subprocess.run(
        [sys.executable, "-m", "lmserve_core", *args, "--pooling", "rank"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0
    assert "classifier head" in out.stdout + out.stderr


def test_hidden_states_skip_the_head_and_match_the_pass_with_logits(embedding_model: Any) -> None:
    gguf = GGUFFile.open(embedding_model.gguf)
    model = Qwen3Model.load(gguf, n_batch=32)
    rows = [(model.new_cache(8), [5, 6, 7, 8], 0), (model.new_cache(8), [9, 10], 0)]
    states = model.hidden_batch(rows)
    assert [s.shape for s in states] == [(4, 64), (2, 64)]
    with_logits = np.full((6, 64), np.nan, np.float32)
    logits = model._batch(rows, with_logits, want_logits=True)
    assert logits is not None and logits.shape == (6, model.n_vocab)
    assert np.array_equal(np.concatenate(states), with_logits)
    # the last row is what embed() (the fleet's retrieval vectors) reads
    assert np.allclose(model.embed([9, 10]), states[1][-1], atol=1e-6)
    model.close()
