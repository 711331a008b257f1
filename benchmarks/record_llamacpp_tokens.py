"""Regenerate the llama.cpp tokenizer reference files under tests/data/tokenizer/.

Every string of corpus.json is tokenized without special tokens added (no BOS)
and with special-token parsing off; strings that look like chat-template
markers are tokenized a second time with special-token parsing on. The ids of
"Hello" with the model's default special tokens added go into "bos_ids".

Two ways to reach llama.cpp:

    # the llama-tokenize tool (one process per string, prompt passed as a file)
    python benchmarks/record_llamacpp_tokens.py --model MODEL.gguf \
        --llama-tokenize /path/to/llama-tokenize --out tests/data/tokenizer/x.json

    # a running llama-server started with the same model
    python benchmarks/record_llamacpp_tokens.py --model MODEL.gguf \
        --server http://127.0.0.1:8080 --out tests/data/tokenizer/x.json

Standard library only; the test suite reads the JSON files, never this script.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import re
import subprocess
import tempfile
import urllib.request
from collections.abc import Callable
from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent.parent / "tests" / "data" / "tokenizer"
LLAMA_CPP_BUILD = "b11434"

# Text that a vocabulary may hold as a single control token.
SPECIAL_LOOKING = re.compile(r"<\|[a-z_]+\|>|<(?:start_of_turn|end_of_turn|bos|eos|pad|unk)>")

Tokenize = Callable[[str, bool, bool], list[int]]


def is_special_looking(text: str) -> bool:
    return SPECIAL_LOOKING.search(text) is not None


def tokenize_with_tool(tool: str, model: str) -> Tokenize:
    """Run llama-tokenize once per string; the prompt file keeps the exact bytes."""

    def tokenize(text: str, add_special: bool, parse_special: bool) -> list[int]:
        with tempfile.NamedTemporaryFile("wb", suffix=".txt", delete=False) as f:
            f.write(text.encode("utf-8"))
            path = f.name
        try:
            # --no-escape: a literal backslash-n in the text must stay two characters.
            cmd = [tool, "-m", model, "-f", path, "--ids", "--log-disable", "--no-escape"]
            if not add_special:
                cmd.append("--no-bos")
            if not parse_special:
                # llama-tokenize parses special tokens unless told not to.
                cmd.append("--no-parse-special")
            out = subprocess.run(cmd, check=True, capture_output=True).stdout.decode()
        finally:
            os.unlink(path)
        lines = [ln for ln in out.splitlines() if ln.startswith("[")]
        if len(lines) != 1:
            raise RuntimeError(f"unexpected llama-tokenize output: {out!r}")
        return [int(t) for t in ast.literal_eval(lines[0])]

    return tokenize


def tokenize_with_server(url: str) -> Tokenize:
    """POST /tokenize to a running llama-server."""

    def tokenize(text: str, add_special: bool, parse_special: bool) -> list[int]:
        body = json.dumps(
            {"content": text, "add_special": add_special, "parse_special": parse_special}
        ).encode()
        req = urllib.request.Request(
            url.rstrip("/") + "/tokenize",
            data=body,
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=60) as resp:
            tokens = json.load(resp)["tokens"]
        return [t if isinstance(t, int) else t["id"] for t in tokens]

    return tokenize


def record(model: str, corpus: list[str], tokenize: Tokenize) -> dict:
    cases = []
    for text in corpus:
        cases.append({"text": text, "parse_special": False, "ids": tokenize(text, False, False)})
        if is_special_looking(text):
            cases.append({"text": text, "parse_special": True, "ids": tokenize(text, False, True)})
    return {
        "model": os.path.basename(model),
        "llama_cpp": LLAMA_CPP_BUILD,
        "bos_ids": tokenize("Hello", True, False),
        "cases": cases,
    }


def dump(result: dict) -> str:
    """JSON with one case per line, so a diff shows which string changed."""

    def enc(value: object) -> str:
        return json.dumps(value, ensure_ascii=False)

    head = [f" {enc(k)}: {enc(v)}" for k, v in result.items() if k != "cases"]
    cases = ",\n".join(f"  {enc(c)}" for c in result["cases"])
    return "{\n" + ",\n".join(head) + ',\n "cases": [\n' + cases + "\n ]\n}\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="GGUF file (its name is recorded)")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--llama-tokenize", help="path to the llama-tokenize binary")
    source.add_argument("--server", help="base URL of a llama-server serving --model")
    parser.add_argument("--corpus", default=str(DATA_DIR / "corpus.json"))
    parser.add_argument("--out", required=True, help="output JSON file")
    args = parser.parse_args()

    corpus = json.loads(Path(args.corpus).read_text(encoding="utf-8"))
    if args.llama_tokenize:
        tokenize = tokenize_with_tool(args.llama_tokenize, args.model)
    else:
        tokenize = tokenize_with_server(args.server)
    result = record(args.model, corpus, tokenize)
    Path(args.out).write_text(dump(result), encoding="utf-8")
    print(f"{args.out}: {len(result['cases'])} cases")


if __name__ == "__main__":
    main()
