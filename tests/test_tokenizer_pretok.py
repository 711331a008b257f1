"""Every ``tokenizer.ggml.pre`` name llama.cpp knows, against llama.cpp's ids.

``data/tokenizer/pretok_llamacpp.json`` holds ``llama-tokenize``'s ids (written by
``benchmarks/record_llamacpp_pretok.py``) for the corpus on vocabularies made from SmolLM2's
(``lmserve_core.testing.pretok``: a real byte-level one, one that shows every split, and one
in raw UTF-8) for every name, and for a missing or empty name, the gemma4 model and the
whitespace model lowercasing. It stores each string's distinct id lists once; ``pick`` says
which one a configuration got.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from models import smollm2_path
from structlog.testing import capture_logs

from lmserve_core.gguf_file import GGUFFile
from lmserve_core.testing import pretok
from lmserve_core.tokenizer import PRE_TOKENIZER_NAMES, Tokenizer, TokenizerError, TokenType

DATA = Path(__file__).parent / "data" / "tokenizer"
REFERENCE: dict[str, Any] = json.loads((DATA / "pretok_llamacpp.json").read_text("utf-8"))
# the names of llama.cpp's GPT-2 regex (LLAMA_VOCAB_PRE_TYPE_GPT2 and the types sharing it)
GPT2_NAMES = {
    *["gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de"],
    *["a.x-4.0", "mellum", "modern-bert", "jina-v1-en", "jina-v2-code", "roberta-bpe"],
    *["exaone4", "mpt", "olmo", "jais", "trillion", "granite-docling"],
}
CORPUS: list[str] = json.loads((DATA / "corpus.json").read_text("utf-8"))


@pytest.fixture(scope="module")
def vocabs() -> dict[str, pretok.Vocab]:
    made = pretok.vocabs(GGUFFile.open(smollm2_path()), CORPUS)
    assert [(c["text"], c["parse_special"]) for c in REFERENCE["cases"]] == pretok.cases(
        CORPUS, made["byte_level"]
    ), "the corpus changed: record llama.cpp's ids again"
    for name, vocab in made.items():
        assert vocab.sha256() == REFERENCE["vocab_sha256"][name], (
            f"the {name} test vocabulary changed: record llama.cpp's ids again"
        )
    return made


def _mismatches(tok: Tokenizer, pick: list[int]) -> list[str]:
    out = []
    for case, k in zip(REFERENCE["cases"], pick, strict=True):
        got = tok.encode(case["text"], add_special=False, parse_special=case["parse_special"])
        if got != case["ids"][k]:
            want = [tok.token_text(i) for i in case["ids"][k]]
            out.append(f"{case['text'][:50]!r}: {[tok.token_text(i) for i in got]} != {want}")
    return out


def test_every_name_is_recorded() -> None:
    assert set(PRE_TOKENIZER_NAMES) <= set(REFERENCE["variants"])
    assert set(REFERENCE["variants"]) == set(pretok.VARIANTS)
    assert len(PRE_TOKENIZER_NAMES) == 91


@pytest.mark.parametrize("label", list(pretok.VARIANTS))
def test_matches_llama_cpp(label: str, vocabs: dict[str, pretok.Vocab]) -> None:
    variant = pretok.VARIANTS[label]
    tok = pretok.tokenizer(variant, vocabs[variant.vocab])
    ref = REFERENCE["variants"][label]
    wrong = _mismatches(tok, ref["pick"])
    assert not wrong, f"{len(wrong)} strings differ:\n" + "\n".join(wrong[:5])
    assert tok.encode("Hello") == ref["bos_ids"]


def test_the_corpus_tells_the_pre_tokenizers_apart() -> None:
    # Names whose ids agree on both byte-level vocabularies: only those llama.cpp gives the
    # same regexes and settings (settings that do not change ids aside), and the equivalent
    # minicpm5 and glm4 (digits by three either way), bailingmoe and qwen2.
    ids: dict[str, list[str]] = {}
    for label, variant in pretok.VARIANTS.items():
        if variant.pre in PRE_TOKENIZER_NAMES and not variant.lowercase:
            ids.setdefault(variant.pre, []).append(json.dumps(REFERENCE["variants"][label]))
    same: dict[tuple[str, ...], list[str]] = {}
    for name, key in ids.items():
        same.setdefault(tuple(key), []).append(name)
    groups = sorted(sorted(names) for names in same.values() if len(names) > 1)
    assert groups == [
        sorted(GPT2_NAMES - {"jina-v2-code", "jina-v2-de", "jina-v2-es"}),
        ["bailingmoe", "bailingmoe2", "deepseek-r1-qwen", "f2llmv2", "grok-2", "hunyuan"]
        + ["kormo", "llada-moe", "megrez", "qwen2", "solar-open", "stablelm2"],
        ["bloom", "gpt3-finnish", "poro-chat"],
        ["chatglm-bpe", "dbrx", "smaug-bpe"],
        ["codeshell", "command-r", "exaone", "mellum2", "minerva-7b", "refact", "smollm"]
        + ["starcoder"],
        ["cohere2moe", "tiny_aya"],
        ["deepseek-v3", "hunyuan-dense", "hy_v4", "joyai-llm"],
        ["falcon-h1", "falcon3", "jina-v5-nano", "lfm2", "llama-bpe", "llama-v3", "llama3"]
        + ["midm-2.0", "pixtral"],
        ["gemma4", "granite-embed-multi-311m"],
        ["glm4", "glm5", "minicpm5"],
        ["gpt-4o", "kanana2", "llama4", "minimax-m2", "talkie"],
        ["jina-v2-code", "jina-v2-de", "jina-v2-es"],  # <mask> takes the space before it
    ]
    assert len(same) == 33


def test_llama_cpp_takes_a_missing_or_empty_name_as_default() -> None:
    variants = REFERENCE["variants"]
    assert variants["(missing)"] == variants["(empty)"] == variants["default"]
    assert variants["(missing) (boundary)"] == variants["default (boundary)"]


def test_missing_name_falls_back_with_a_warning(vocabs: dict[str, pretok.Vocab]) -> None:
    vocab = vocabs["byte_level"]
    for pre in (None, ""):
        with capture_logs() as logs:
            tok = Tokenizer(model="gpt2", tokens=vocab.tokens, merges=vocab.merges, pre=pre)
        assert tok.pre == "default"
        assert [e["event"] for e in logs if e["log_level"] == "warning"] == [
            "pre_tokenizer_missing"
        ]
    with capture_logs() as logs:
        Tokenizer(model="gpt2", tokens=vocab.tokens, merges=vocab.merges, pre="default")
    assert not logs  # named explicitly: no warning, as in llama.cpp


@pytest.mark.parametrize("pre", ["klingon", "Qwen2", "llama-3", "gemma-4", " gpt-2"])
def test_names_llama_cpp_does_not_know_are_refused(pre: str) -> None:
    with pytest.raises(TokenizerError) as info:
        Tokenizer(model="gpt2", tokens=["a"], merges=[], pre=pre)
    message = str(info.value)
    assert f"unknown pre-tokenizer type {pre!r}" in message
    assert "docs/tokenizers.md" in message and "PRE_TOKENIZER_NAMES" in message


def _bytes_vocab(extra: list[str]) -> list[str]:
    from lmserve_core.tokenizer import _bytes_to_unicode

    return [*_bytes_to_unicode().values(), *extra]


def test_special_token_defaults_per_name() -> None:
    tokens = _bytes_vocab(["<|x|>"])
    # BPE vocabularies default to BOS = EOS = 11; chatglm's names have no default BOS
    assert Tokenizer(model="gpt2", tokens=tokens, merges=[], pre="gpt-2").bos_id == 11
    glm = Tokenizer(model="gpt2", tokens=tokens, merges=[], pre="glm4")
    assert glm.bos_id is None and glm.eos_id == 11
    assert Tokenizer(model="gpt2", tokens=tokens, merges=[], pre="glm4", bos_id=3).bos_id == 3
    with pytest.raises(TokenizerError, match="no BOS token"):
        Tokenizer(model="gpt2", tokens=tokens, merges=[], pre="chatglm-bpe", add_bos=True)
    # llama3's names and tekken add BOS unless the file says not to; Gemma 4's always
    assert Tokenizer(model="gpt2", tokens=tokens, merges=[], pre="tekken").add_bos
    assert not Tokenizer(
        model="gpt2", tokens=tokens, merges=[], pre="pixtral", add_bos=False
    ).add_bos
    gemma = Tokenizer(
        model="gpt2", tokens=tokens, merges=[], pre="granite-embed-multi-311m", add_bos=False
    )
    assert gemma.add_bos
    # Kimi K2's vocabulary may come without merges
    kimi = Tokenizer(model="gpt2", tokens=tokens, pre="kimi-k2")
    assert kimi.encode("ab") == [tokens.index("a"), tokens.index("b")]
    with pytest.raises(TokenizerError, match="needs tokenizer.ggml.merges"):
        Tokenizer(model="gpt2", tokens=tokens, pre="qwen2")
    assert Tokenizer(model="gpt2", tokens=tokens, merges=[], pre="roberta-bpe").add_sep


def test_mask_takes_the_whitespace_before_it() -> None:
    tokens = _bytes_vocab(["<mask>"])
    types = [TokenType.NORMAL] * 256 + [TokenType.CONTROL]
    text = "a \t<mask> b<mask>\n<mask>"
    jina = Tokenizer(model="gpt2", tokens=tokens, token_types=types, merges=[], pre="jina-v2-de")
    ids = jina.encode(text, parse_special=True)
    assert [jina.token_text(i) for i in ids] == ["a", "<mask>", "Ġ", "b", "<mask>", "<mask>"]
    plain = Tokenizer(model="gpt2", tokens=tokens, token_types=types, merges=[], pre="jina-v2-es")
    assert plain.encode(text, parse_special=True) == ids  # also lstrip
    gpt2 = Tokenizer(model="gpt2", tokens=tokens, token_types=types, merges=[], pre="jina-v1-en")
    assert len(gpt2.encode(text, parse_special=True)) > len(ids)
    # without parse_special the control token is text, nothing stripped
    assert jina.decode(jina.encode(text)) == text


@pytest.mark.parametrize(
    ("text", "cleaned"),
    [
        ("Hi , there . Yes ! Why ?", "Hi, there. Yes! Why?"),
        ("a ' b", "a'b"),
        ("it 's I 'm we 're you 've", "it's I'm we're you've"),
        ("do n't we 'll I 'd", "do n't we 'll I 'd"),
        (" .", "."),
        ("", ""),
    ],
)
def test_clean_spaces_as_llama_detokenize(text: str, cleaned: str) -> None:
    tokens = _bytes_vocab([])
    gpt2 = Tokenizer(model="gpt2", tokens=tokens, merges=[], pre="gpt-2")
    ids = gpt2.encode(text)
    assert gpt2.clean_spaces and gpt2.decode(ids, clean_spaces=True) == cleaned
    assert gpt2.decode(ids) == text
    qwen = Tokenizer(model="gpt2", tokens=tokens, merges=[], pre="qwen2")
    assert not qwen.clean_spaces and qwen.decode(ids, clean_spaces=True) == text
