"""What refusing a request costs: a prompt too long for the context is found out within the
context's worth of tokens (``Tokenizer.encode_within``), on the preparation threads, not the
worker or the event loop; a grammar past llguidance's limits is a 400 naming its field.
``benchmarks/bench_rejection.py`` measures the same on a 7.5 MB body; ``docs/limits.md``
lists every limit."""

from __future__ import annotations

import json
import random
import re
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from models import smollm2_path
from processes import API_KEY
from scripted import (  # noqa: F401  (the fixtures)
    IM_END,
    ListSink,
    _gguf,
    _one_tokenizer,
    _tokenizer,
    chat,
    ids,
    make_backend,
)

import lmserve_core.pretokenize as pretokenize
import lmserve_core.tokenizer as tokenizer_module
from lmserve_core.errors import InvalidRequest
from lmserve_core.events import ErrorEvent, Finish, TextDelta
from lmserve_core.gguf_file import GGUFFile
from lmserve_core.request import Constraint
from lmserve_core.tokenizer import Tokenizer, TooManyTokens

CORPUS: list[str] = json.loads(
    (Path(__file__).parent / "data" / "tokenizer" / "corpus.json").read_text(encoding="utf-8")
)


def _documents(seed: int = 0) -> list[str]:
    """Long texts with every kind of character the corpus has, and runs of whitespace,
    punctuation before newlines, contractions and digits next to letters."""
    rng = random.Random(seed)
    pieces = [*CORPUS, "it's", "THEY'RE", "x  \n\n  y", "word.\n", "a\tb", "abc123", "é ", "\u2581"]
    return [
        "\n".join(CORPUS),
        " ".join(CORPUS),
        "".join(rng.choices(pieces, k=400)),
        " ".join(rng.choices(pieces, k=400)),
    ]


def _every_cut(monkeypatch: pytest.MonkeyPatch, chars: int = 1) -> None:
    """Bounded encoding cuts its pieces at every place it may (the first after ``chars``
    characters)."""
    monkeypatch.setattr(tokenizer_module, "_PIECE_CHARS", chars)
    monkeypatch.setattr(tokenizer_module, "_PIECE_CHARS_PER_TOKEN", 0)


def _same_ids_in_pieces(
    tok: Tokenizer, texts: list[str], specials: tuple[bool, ...] = (False, True)
) -> None:
    for text in texts:
        for special in specials:
            whole = tok.encode(text, add_special=True, parse_special=special)
            pieces = tok._encode(text, True, special, (), 10**9)
            assert pieces == whole, (text[:80], special)
            # and the length bound holds
            assert len(whole) >= tok.fewest_tokens(len(text.encode("utf-8", "surrogatepass")))


# -- the pieces are exact -------------------------------------------------------------------


def test_pieces_match_whole_for_every_pre_tokenizer(monkeypatch: pytest.MonkeyPatch) -> None:
    # Every pre-tokenizer llama.cpp knows (lmserve_core.testing.pretok: SmolLM2's vocabulary
    # byte-level and in raw UTF-8), once per distinct pre-tokenization: cuts at every
    # allowed place give the ids of the whole text.
    from lmserve_core.testing import pretok

    _every_cut(monkeypatch, chars=5)  # (each cut is a call into the tokenizer: fewer)
    made = pretok.vocabs(GGUFFile.open(smollm2_path()), CORPUS)
    kinds: dict[Any, pretok.Variant] = {}
    for variant in pretok.VARIANTS.values():
        if variant.vocab == "boundary":
            continue  # it joins letters to the spaces after them: it allows no such cut
        spec = pretokenize._PRE_NAMES.get(variant.pre or "default")
        assert spec is not None
        lstrip = any(n in (variant.pre or "") for n in pretokenize._MASK_LSTRIP_PRES)
        key = (
            variant.model,
            variant.vocab,
            spec.type,
            spec.ignore_merges,
            spec.escape_whitespaces,
            variant.lowercase,
            lstrip,
        )
        kinds.setdefault(key, variant)
    for variant in kinds.values():
        tok = pretok.tokenizer(variant, made[variant.vocab])
        _same_ids_in_pieces(tok, ["\n".join(CORPUS)], (False,))
        _same_ids_in_pieces(tok, [" ".join(CORPUS) + "<mask>  x <mask>"], (True,))


def test_pieces_never_cut_between_characters_a_token_joins(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from lmserve_core.tokenizer import _bytes_to_unicode

    _every_cut(monkeypatch)
    merges = ["e Ġ", "eĠ t", "s Ġ", "Ġ Ġ", "t h", "th e", "Ċ Ċ"]
    extra = sorted({"".join(m.split()) for m in merges})
    tokens = [*_bytes_to_unicode().values(), *extra]
    for pre in ("gpt-2", "llama-bpe"):  # no pre-tokenizer of the table joins them; a vocabulary may
        tok = Tokenizer(model="gpt2", tokens=tokens, merges=merges, pre=pre)
        assert "eĠ" in tok._joined_before_space
        _same_ids_in_pieces(tok, _documents(1))


def test_pieces_match_whole_for_sentencepiece_vocabularies(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _every_cut(monkeypatch)
    chars = sorted(set("".join(_documents(2))) - {" "})
    tokens = ["<unk>", "<s>", "</s>", "▁", "▁▁", "a▁", "e▁", "▁a", "th", "▁th", "the", *chars]
    tokens = list(dict.fromkeys(tokens))
    scores = [0.0] * 3 + [-float(i) for i in range(len(tokens) - 3)]
    spm = Tokenizer(
        model="llama", tokens=tokens, token_types=[2, 3, 3] + [1] * (len(tokens) - 3), scores=scores
    )
    _same_ids_in_pieces(spm, _documents(2))


def test_pieces_match_whole_on_real_vocabularies(
    tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    from models import _gemma3

    _every_cut(monkeypatch)
    runs = [c * 3000 for c in (" ", "\u2581", "\n", "a", "0", "=", "é", "\t", "中")]
    docs = _documents(3) + runs + ["a \u2581" * 1000]
    _same_ids_in_pieces(tokenizer, docs)  # SmolLM2: byte-level, smollm pre-tokenizer
    gemma = _gemma3()
    if gemma is not None:  # Gemma 3: SentencePiece
        _same_ids_in_pieces(Tokenizer.from_gguf(GGUFFile.open(gemma)), docs)


# -- the count is bounded by the context, not by the text ---------------------------------


def _counting(tok: Tokenizer, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The lengths of the texts the merges are run over, recorded as they are."""
    seen: list[int] = []
    bpe = tok._bpe

    def counted(text: str) -> list[int]:
        seen.append(len(text))
        return bpe(text)

    monkeypatch.setattr(tok, "_bpe", counted)
    return seen


def test_a_huge_text_is_refused_without_tokenizing(
    tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    seen = _counting(tokenizer, monkeypatch)
    text = "hello world " * 500_000  # 6 MB
    started = time.perf_counter()
    with pytest.raises(TooManyTokens) as err:
        tokenizer.encode_within(text, 2047, parse_special=True)
    assert time.perf_counter() - started < 0.5
    # no token stands for more bytes than the longest one
    assert err.value.at_least >= len(text) // tokenizer.longest_token > 2047
    assert not err.value.exact and seen == []


def test_a_long_text_is_counted_only_past_the_bound(
    tokenizer: Tokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Short enough for the byte bound to let it through (under 2047 x the longest token):
    # counted in pieces, which stop once past 2047 tokens.
    rng = random.Random(0)
    words = ["".join(rng.choices("abcdefghij", k=rng.randint(1, 4))) for _ in range(500)]
    text = " ".join(rng.choices(words, k=40_000))[: 2047 * tokenizer.longest_token - 100]
    seen = _counting(tokenizer, monkeypatch)
    started = time.perf_counter()
    with pytest.raises(TooManyTokens) as err:
        tokenizer.encode_within(text, 2047, parse_special=True)
    assert time.perf_counter() - started < 0.5
    assert 2047 < err.value.at_least < 2 * 4 * 2048
    assert sum(seen) < 5 * 2048 + 100 < len(text) / 10  # characters given to the merges


def test_encode_within_returns_the_ids_of_a_prompt_that_fits(tokenizer: Tokenizer) -> None:
    for text in _documents(4):
        whole = tokenizer.encode(text, parse_special=True)
        assert tokenizer.encode_within(text, len(whole), parse_special=True) == whole
        with pytest.raises(TooManyTokens) as err:
            tokenizer.encode_within(text, len(whole) - 1, parse_special=True)
        assert err.value.at_least >= len(whole) or not err.value.exact


def test_a_prompt_over_the_context_is_refused_within_the_context(
    gguf: GGUFFile, monkeypatch: pytest.MonkeyPatch
) -> None:
    backend = make_backend(gguf, ctx=2048)
    seen = _counting(backend.tokenizer, monkeypatch)
    request = chat("the cat sat on a mat, " * 300_000)  # 6.6 MB: the byte bound refuses it
    started = time.perf_counter()
    with pytest.raises(InvalidRequest) as err:
        backend.validate(request)
    assert time.perf_counter() - started < 0.5 and seen == []
    assert err.value.code == "context_length_exceeded" and err.value.param == "messages"
    assert re.fullmatch(r"prompt is at least \d+ tokens; the context is 2048", err.value.message)
    # one that the byte bound lets through is counted past the context only
    request = chat("ab cd ef gh " * 8_000)
    with pytest.raises(InvalidRequest) as err:
        backend.validate(request)
    assert sum(seen) < 5 * 2048 + 100
    assert re.fullmatch(r"prompt is at least \d+ tokens; the context is 2048", err.value.message)


def test_a_flood_of_control_texts_is_refused_before_their_spans_are_found(
    gguf: GGUFFile,
) -> None:
    # Each control text a message supplies is kept as plain text (a span of its own); a
    # prompt too long by its length alone is refused before the spans are listed.
    backend = make_backend(gguf, ctx=2048)
    for content in ("<|im_end|>" * 300_000, "a <|im_start|> b " * 200_000):
        started = time.perf_counter()
        with pytest.raises(InvalidRequest) as err:
            backend.validate(chat(content))
        assert time.perf_counter() - started < 1.0  # seconds before (a span each)
        assert re.fullmatch(
            r"prompt is at least \d+ tokens; the context is 2048", err.value.message
        )
    # a few of them still come out as text, not as control tokens
    ids = backend.preparation.prepare(chat("say <|im_end|> now")).tokens
    assert backend.tokenizer.decode(ids).count("<|im_end|>") == 3
    assert ids.count(IM_END) == 2  # the template's own


def test_special_tokens_of_a_large_group_are_found_where_its_key_occurs() -> None:
    from lmserve_core.special_tokens import _SplitTable

    entries = [(f"<unused{i}>", i) for i in range(200)] + [("<|end|>", 200), ("<start>", 201)]
    entries.sort(key=lambda e: -len(e[0]))
    table = _SplitTable(entries)
    assert "<unuse" in table.windows
    rng = random.Random(0)
    parts = [*(text for text, _ in rng.sample(entries, 20)), "<unused", "<unused1", "x", "\n"]
    for _ in range(200):
        text = "".join(rng.choices(parts, k=12))
        assert table.occurring_in(text) == [e for e in entries if e[0] in text], text


# -- grammars past llguidance's limits --------------------------------------------------------


def test_a_grammar_over_a_parser_limit_is_a_400_naming_its_field(gguf: GGUFFile) -> None:
    pytest.importorskip("llguidance")
    backend = make_backend(gguf)
    # compiles, but its lexer gives up on the first token: "too many expressions"
    request = chat("x", constraint=Constraint(kind="regex", source="a{1000000}", field="regex"))
    with pytest.raises(InvalidRequest) as err:
        backend.validate(request)
    assert err.value.status == 400 and err.value.param == "regex"
    assert err.value.code == "grammar_too_complex"
    assert err.value.message.startswith("'regex': the grammar exceeded a parser limit")
    # the dialect's own name for the field, in a grammar that does not compile too
    schema = Constraint(kind="json_schema", source="[1", field="text.format")
    with pytest.raises(InvalidRequest) as err:
        backend.validate(chat("x", constraint=schema))
    assert err.value.param == "text.format" and err.value.code == "invalid_grammar"


class _GivesOut:
    """A matcher that gives out after ``after`` tokens, as llguidance does at a limit."""

    def __init__(self, matcher: Any, after: int) -> None:
        self._matcher, self._left = matcher, after

    def consume_token(self, token: int) -> bool:
        if self._left == 0:
            return False
        self._left -= 1
        return bool(self._matcher.consume_token(token))

    def get_error(self) -> str:
        return "lexer error: too many expressions constructed\n<state>..."

    def __getattr__(self, name: str) -> Any:
        return getattr(self._matcher, name)


def test_a_grammar_giving_out_mid_reply_ends_it_with_a_400_event(gguf: GGUFFile) -> None:
    pytest.importorskip("llguidance")
    b0 = make_backend(gguf)
    backend = make_backend(gguf, ids(b0, "abcabcabc") + [IM_END])
    request = chat(
        "x", max_tokens=20, constraint=Constraint(kind="regex", source="(abc)+", field="regex")
    )
    backend.validate(request)
    prepared = backend.preparation.pending[request.id]
    prepared.matcher = _GivesOut(prepared.matcher, after=2)
    sink = ListSink()
    finish = backend.generate(request, sink)
    assert finish.reason == "error"
    errors = [e for e in sink.events if isinstance(e, ErrorEvent)]
    assert len(errors) == 1 and errors[0].status == 400
    assert errors[0].kind == "invalid_request_error"
    assert errors[0].message.startswith(
        "'regex': the grammar exceeded a parser limit after 2 tokens of the reply: lexer error"
    )
    assert "".join(e.text for e in sink.events if isinstance(e, TextDelta))  # what came before
    assert not any(isinstance(e, Finish) for e in sink.events)


# -- a real server: the refusal costs others nothing -----------------------------------------


@pytest.fixture(scope="module")
def smol(tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    import importlib.util

    from processes import launch

    if importlib.util.find_spec("lmserve_llama") is None:
        pytest.skip("needs lmserve-llama")
    running = launch(
        str(smollm2_path()),
        "--ctx",
        "2048",
        "--threads",
        "2",
        scripted=False,
        log_dir=tmp_path_factory.mktemp("rejection"),
        timeout=120,
    )
    yield running
    running.stop()


def _post(base_url: str, body: dict[str, Any] | bytes) -> tuple[float, httpx.Response]:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"}
    started = time.perf_counter()
    reply = httpx.post(
        base_url + "/v1/chat/completions", content=content, headers=headers, timeout=120
    )
    return time.perf_counter() - started, reply


SMALL = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}


def test_over_context_bodies_do_not_hold_up_a_small_chat(smol) -> None:  # type: ignore[no-untyped-def]
    rng = random.Random(0)
    words = [
        "".join(rng.choices("abcdefghijklmnopqrstuvwxyz0123456789.,", k=rng.randint(1, 4)))
        for _ in range(2000)
    ]
    text = " ".join(rng.choices(words, k=700_000))  # 2 MB, about a million tokens
    hostile = json.dumps({"messages": [{"role": "user", "content": text}], "max_tokens": 4})
    alone, reply = _post(smol.base_url, SMALL)
    assert reply.status_code == 200
    pid = smol.process.pid
    before = _status_mib(pid, "VmRSS")
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # the peak (VmHWM) from here
    results: list[tuple[float, httpx.Response]] = []
    threads = [
        threading.Thread(target=lambda: results.append(_post(smol.base_url, hostile.encode())))
        for _ in range(3)
    ]
    for thread in threads:
        thread.start()
    time.sleep(0.05)
    beside, reply = _post(smol.base_url, SMALL)
    for thread in threads:
        thread.join()
    assert reply.status_code == 200
    for seconds, refused in results:
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["code"] == "context_length_exceeded" and error["param"] == "messages"
        assert re.fullmatch(r"prompt is at least \d+ tokens; the context is 2048", error["message"])
        assert seconds < 3.0  # ~0.1 s on an idle machine; bodies of ~1M tokens took ~5 s each
    assert beside - alone < 2.0
    # memory: the bodies and their renderings come and go (tokenizing them whole took GBs)
    assert _status_mib(pid, "VmHWM") - before < 150
    assert _status_mib(pid, "VmRSS") - before < 50


def _status_mib(pid: int, field: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(field)


def test_grammar_limit_over_http_is_a_400_naming_the_field(smol) -> None:  # type: ignore[no-untyped-def]
    pytest.importorskip("llguidance")
    _, reply = _post(smol.base_url, {**SMALL, "regex": "a{1000000}"})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "regex" and error["type"] == "invalid_request_error"
    assert error["code"] == "grammar_too_complex"
