"""Claude Code and Codex CLI complete a headless one-shot prompt against a synthetic Qwen3.

The tiny synthetic Qwen3 (q8_0, random weights, Qwen3's tokenizer and chat template) is fast
enough to prefill Claude Code's whole request (system prompt and every tool, ~19k tokens) in
seconds. Random weights never end a turn, though, and both CLIs treat a reply cut by the
token limit as a failed turn; so the model served here is that synthetic model with its
output steered (see ``hello_model``): it answers exactly "hello" and stops, and each CLI must
print that answer and exit 0. The core counterpart, against SmolLM2, is
tests/test_agent_clis.py; the harness is tests/agent_clis.py.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "tests"))

import agent_clis as cli  # noqa: E402
from gguf import GGMLQuantizationType  # noqa: E402
from processes import RunningServer, launch  # noqa: E402
from synthetic import GEOMETRIES, add_metadata, tensor_shapes, tensor_type  # noqa: E402

from lmserve_core.gguf_file import GGUFFile  # noqa: E402
from lmserve_core.testing.assets import cache_dir  # noqa: E402
from lmserve_core.testing.gguf_writer import StreamingWriter, atomic_output, decode_raw  # noqa: E402

pytestmark = pytest.mark.slow

HELLO = 14990  # "hello" in Qwen3's vocabulary
IM_END = 151645  # <|im_end|>, Qwen3's end of turn
# Bump when hello_model changes: it keys the cached file.
HELLO_VERSION = "1"


def _steer(weights: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Make the model say "hello", then end its turn, whatever came before.

    Embedding dimension 0 is set to a large constant for every token and dimension 1 only for
    "hello": they dominate the residual stream through both random layers, so after the final
    RMSNorm dimension 0 is always large and dimension 1 is large exactly when the current token
    is "hello". The untied output head reads dimension 0 as "say hello" and dimension 1 as
    twice as strong "end the turn"; it reads nothing else from them, and the random logits of
    every other token come out far smaller.
    """
    big, head = 1000.0, 8.0
    embd = weights["token_embd.weight"]
    out = embd.copy()
    embd[:, 0] = big
    embd[:, 1] = 0.0
    embd[HELLO, 1] = big
    out[:, :2] = 0.0
    out[HELLO, 0] = head
    out[IM_END, 1] = 2 * head
    weights["output.weight"] = out
    weights["output_norm.weight"][:2] = 1.0
    return weights


def hello_model(source: Path) -> Path:
    """The steered copy of the synthetic GGUF ``source`` (cached next to the agent CLIs)."""
    dest = cache_dir() / "agent-clis" / f"{source.parent.name}-hello{HELLO_VERSION}"
    if (dest / "model.gguf").is_file():
        return dest / "model.gguf"
    kind, type_name = "qwen3", "q8_0"
    geometry = dataclasses.replace(GEOMETRIES[(kind, "tiny")], tied=False)
    with GGUFFile.open(source) as gguf, atomic_output(dest) as tmp:
        weights = {}
        for name in ("token_embd.weight", "output_norm.weight"):
            t = gguf.tensors[name]
            qtype = GGMLQuantizationType(t.ggml_type)
            raw = t.data.view(np.float32) if qtype == GGMLQuantizationType.F32 else t.data
            weights[name] = decode_raw(raw, qtype, t.shape).astype(np.float32)
        weights = _steer(weights)
        tmp.mkdir()
        writer = StreamingWriter(tmp / "model.gguf", kind)
        add_metadata(writer.writer, kind, geometry, type_name, "tiny q8_0 hello")
        shapes = tensor_shapes(kind, geometry)
        for name, shape in shapes:
            writer.plan(name, shape, tensor_type(name, shape, type_name, geometry))
        writer.begin()
        for name, _ in shapes:
            if name in weights:
                writer.write(name, weights[name])
            else:
                writer.write_raw(name, gguf.tensors[name].data)
        writer.close()
    return dest / "model.gguf"


@pytest.fixture(scope="module")
def qwen3(
    synthetic: Callable[..., Any], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    model = hello_model(synthetic("qwen3", "q8_0").gguf)
    # Claude Code's request is ~19k Qwen3 tokens with every tool declared up front.
    running = launch(str(model), "--ctx", "32768", "--seed", "0", scripted=False,
                     log_dir=tmp_path_factory.mktemp("qwen3-agents"), timeout=120)
    yield running
    running.stop()


def test_claude_code_qwen3(qwen3: RunningServer, tmp_path: Path) -> None:
    before = len(cli.served_requests(qwen3))
    run = cli.claude_code(cli.require(cli.CLAUDE_CODE), qwen3, tmp_path, max_output_tokens=256)
    result = cli.claude_result(run)
    served = cli.answered(qwen3, "messages", before)
    assert run.returncode == 0, run.report()
    assert result is not None and result.get("is_error") is False, run.report()
    assert result.get("result") == "hello", run.report()
    assert served and all(r["status"] == 200 for r in served), run.report()
    # every tool is declared in the prompt: ~19k tokens, ~4k without the tools
    assert served[0]["prompt_tokens"] > 12000, run.report()
    assert all(r["finish_reason"] == "stop" for r in served), run.report()


def test_codex_qwen3(qwen3: RunningServer, tmp_path: Path) -> None:
    before = len(cli.served_requests(qwen3))
    run = cli.codex(cli.require(cli.CODEX), qwen3, tmp_path)
    served = cli.answered(qwen3, "responses", before)
    assert run.returncode == 0, run.report()
    assert (cli.codex_last_message(tmp_path) or "").strip() == "hello", run.report()
    assert served and all(r["status"] == 200 for r in served), run.report()
    # every tool is declared in the prompt: ~8.7k tokens, ~4.5k without the tools
    assert served[0]["prompt_tokens"] > 6500, run.report()
    assert all(r["finish_reason"] == "stop" for r in served), run.report()
