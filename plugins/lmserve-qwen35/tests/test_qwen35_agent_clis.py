"""Claude Code and Codex CLI complete a headless one-shot prompt against a synthetic Qwen3.5.

As for Qwen3 (test_qwen3_agent_clis.py, whose two CLI tests run here unchanged against the
fixture below): the tiny synthetic model (q8_0, random weights, Qwen3's tokenizer, Qwen3.5's
chat template and its XML tool notation) is served by a real ``lmserve`` process, with its
output steered by edited weights so that it answers exactly "hello" and stops; each CLI must
print that answer and exit 0 (Codex's instructions and developer message reach Qwen3.5's
template as one system message). Claude Code runs again with thinking switched on and off:
with it on (Claude Code's default) Qwen3.5's template opens the think block in the prompt, the
steered model closes it and answers.

The steering (``hello_model``) is Qwen3's, plus one rule for the think prefill, and it is
checked here first, in-process and fast, on all three kinds: the steering dimensions of the
embedding dominate every layer's residual input, so they come through the Gated DeltaNet
layers (whose states carry thousands of earlier tokens) as through attention.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "plugins" / "lmserve-qwen3" / "tests"))
sys.path.insert(0, str(ROOT / "tests"))

import agent_clis as cli  # noqa: E402
import test_qwen3_agent_clis as qwen3_clis  # noqa: E402
import test_qwen3_tools as qwen3_tools  # noqa: E402
from gguf import GGMLQuantizationType  # noqa: E402
from processes import RunningServer, launch  # noqa: E402

from lmserve_core.backend import ServerSettings  # noqa: E402
from lmserve_core.gguf_file import GGUFFile  # noqa: E402
from lmserve_core.testing.assets import cache_dir  # noqa: E402
from lmserve_core.testing.gguf_writer import (  # noqa: E402
    StreamingWriter,
    add_arch_metadata,
    atomic_output,
    decode_raw,
)
from lmserve_core.testing.serving import serve  # noqa: E402
from lmserve_core.tokenizer import Tokenizer  # noqa: E402

KINDS = ("qwen35", "qwen35moe", "qwen3next")
# Bump when hello_model changes: it keys the cached file (with Qwen3's, for its _steer).
HELLO_VERSION = "1"
TEXT = ROOT / "tests" / "data" / "perplexity" / "text.txt"


def _steer(weights: dict[str, np.ndarray], newline: int, think_end: int) -> dict[str, np.ndarray]:
    """Qwen3's steering (``test_qwen3_agent_clis._steer``: "hello" after any token, the end
    of the turn after "hello"), and embedding dimension 2 set only for "\\n", read by the
    head as twice as strong "</think>": a prompt that ends by opening a think block
    ("<think>" "\\n", Qwen3.5's with thinking on) gets it closed at once. The other prompts
    end otherwise (thinking off: "</think>" "\\n\\n"), and where a reply starts with a stray
    "</think>" (Qwen3's template opens no block) the server drops it."""
    weights = qwen3_clis._steer(weights)
    embd, out = weights["token_embd.weight"], weights["output.weight"]
    big, head = embd[0, 0], out[qwen3_clis.HELLO, 0]  # _steer's magnitudes
    embd[:, 2] = 0.0
    embd[newline, 2] = big
    out[:, 2] = 0.0
    out[think_end, 2] = 2 * head
    weights["output_norm.weight"][2] = 1.0
    return weights


def _copy_metadata(writer: Any, gguf: GGUFFile) -> None:
    """Every key of ``gguf`` but the architecture (the writer writes it), typed as the
    converter types them (``add_arch_metadata``'s rules: u32 integers, f32 floats, arrays)."""
    for key, value in gguf.metadata.items():
        if key == "general.architecture":
            continue
        prefix, rest = key.split(".", 1)
        value = value.tolist() if isinstance(value, np.ndarray) else value
        add_arch_metadata(writer, prefix, {rest: value})


def _decoded(gguf: GGUFFile, name: str) -> np.ndarray:
    t = gguf.tensors[name]
    qtype = GGMLQuantizationType(t.ggml_type)
    raw = t.data.view(np.float32) if qtype == GGMLQuantizationType.F32 else t.data
    return decode_raw(raw, qtype, t.shape).astype(np.float32)


def hello_model(source: Path) -> Path:
    """The steered copy of the synthetic GGUF ``source`` (cached next to the agent CLIs):
    its metadata and tensors, ``token_embd`` and ``output_norm`` edited and an untied
    ``output`` head added (or replaced), stored in ``token_embd``'s type."""
    version = f"{qwen3_clis.HELLO_VERSION}.{HELLO_VERSION}"
    dest = cache_dir() / "agent-clis" / f"{source.parent.name}-hello{version}"
    if (dest / "model.gguf").is_file():
        return dest / "model.gguf"
    with GGUFFile.open(source) as gguf, atomic_output(dest) as tmp:
        tokenizer = Tokenizer.from_gguf(gguf)
        (newline,) = tokenizer.encode("\n")
        think_end = tokenizer.token_id("</think>")
        assert think_end is not None and tokenizer.encode("hello") == [qwen3_clis.HELLO]
        weights = {name: _decoded(gguf, name) for name in ("token_embd.weight", "output_norm.weight")}
        weights = _steer(weights, newline, think_end)
        embd = gguf.tensors["token_embd.weight"]
        tensors = [(name, t.shape, t.ggml_type) for name, t in gguf.tensors.items()]
        if "output.weight" not in gguf.tensors:  # tied: the head goes where an untied one is
            tensors.insert(0, ("output.weight", embd.shape, embd.ggml_type))
        tmp.mkdir()
        writer = StreamingWriter(tmp / "model.gguf", gguf.architecture)
        _copy_metadata(writer.writer, gguf)
        for name, shape, qtype in tensors:
            writer.plan(name, shape, GGMLQuantizationType(qtype))
        writer.begin()
        for name, _, _ in tensors:
            if name in weights:
                writer.write(name, weights[name])
            else:
                writer.write_raw(name, gguf.tensors[name].data)
        writer.close()
        with GGUFFile.open(tmp / "model.gguf") as copy:  # the copy reads back as the source
            assert set(copy.tensors) == set(gguf.tensors) | {"output.weight"}
            for key, value in gguf.metadata.items():
                assert np.array_equal(copy.metadata[key], value), key
    return dest / "model.gguf"


# ---------------------------------------------------------------------------- the steering


@pytest.fixture(scope="module", params=KINDS)
def steered(request: pytest.FixtureRequest, synthetic: Callable[..., Any]) -> Iterator[Any]:
    """A backend of the kind's steered model, and its in-process server."""
    from lmserve_qwen35.plugin import create_backend

    settings = ServerSettings(ctx=4096, threads=2)
    backend = create_backend(str(hello_model(synthetic(request.param, "q8_0").gguf)), settings)
    with serve(backend, settings) as http:
        yield backend, http


def test_the_steering_holds_through_the_deltanet_layers(steered: Any) -> None:
    backend, _ = steered
    tok = backend.tokenizer
    # a long text (the DeltaNet states fill up), then the tokens the rules react to
    ids = tok.encode(TEXT.read_text(encoding="utf-8"))[:3000]
    ids += tok.encode("\nhello hello\n<think>\nhello", parse_special=True)
    rules = {qwen3_clis.HELLO: qwen3_clis.IM_END, tok.encode("\n")[0]: tok.token_id("</think>")}
    cache = backend.model.new_cache(len(ids) + 8)
    top, top2 = [], []
    for pos in range(0, len(ids), 256):  # the logits of every position, a chunk at a time
        logits = backend.model.forward(cache, ids[pos : pos + 256], pos, all_logits=True)
        top += logits.argmax(axis=1).tolist()
        top2.append(np.partition(logits, -2, axis=1)[:, -2:])
    assert top == [rules.get(t, qwen3_clis.HELLO) for t in ids]
    # by a wide margin at every position, the last as the first
    margins = np.concatenate(top2)
    assert (margins[:, 1] - margins[:, 0]).min() > 40  # about 60 here, random logits +-12


@pytest.mark.parametrize("thinking", [False, True], ids=["no-thinking", "thinking"])
@pytest.mark.parametrize("dialect", qwen3_tools.DIALECTS)
def test_the_steered_model_answers_hello_and_stops(
    steered: Any, dialect: str, thinking: bool
) -> None:
    _, http = steered
    body = qwen3_tools.request_body(dialect, thinking=thinking, max_tokens=16)
    reply = http.post(qwen3_tools.PATHS[dialect], json=body)
    assert reply.status_code == 200, reply.text
    answer = qwen3_tools.READERS[dialect](reply.json())
    assert (answer.text, answer.reasoning, answer.calls) == ("hello", "", [])
    assert answer.finish == qwen3_tools.ANSWERED[dialect]
    # "hello", the end of the turn; with thinking on, the closing "</think>" first
    assert answer.completion_tokens == 2 + thinking


# ---------------------------------------------------------------------------- the CLIs


@pytest.fixture(scope="module", name="qwen3")  # the name the Qwen3 tests ask for
def qwen35_server(
    synthetic: Callable[..., Any], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RunningServer]:
    """A real lmserve process serving the steered Qwen3.5."""
    model = hello_model(synthetic("qwen35", "q8_0").gguf)
    log_dir = tmp_path_factory.mktemp("qwen35-agents")
    # Claude Code's request is ~19k tokens with every tool declared up front.
    args = (str(model), "--ctx", "32768", "--seed", "0")
    running = launch(*args, scripted=False, log_dir=log_dir, timeout=120)
    yield running
    running.stop()


def _here(test: Callable[..., None], *marks: Any) -> Callable[..., None]:
    """A Qwen3 test run as a test of this module, its marks on a function of its own."""

    @functools.wraps(test)
    def run(*args: Any, **kwargs: Any) -> None:
        test(*args, **kwargs)

    run.__dict__.pop("pytestmark", None)
    for mark in marks:
        run = mark(run)
    return run


test_claude_code_qwen35 = _here(qwen3_clis.test_claude_code_qwen3, pytest.mark.slow)
test_codex_qwen35 = _here(qwen3_clis.test_codex_qwen3, pytest.mark.slow)


@pytest.mark.slow
@pytest.mark.parametrize("budget", [0, 1024], ids=["no-thinking", "thinking"])
def test_claude_code_thinking_switch_qwen35(
    qwen3: RunningServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, budget: int
) -> None:
    # Claude Code asks for thinking with a budget (as by default), not with none: the prompt
    # then opens the think block, the model closes it, and the "</think>" must not reach
    # the answer. The run and its checks are the Qwen3 test's.
    isolated = cli.isolated_env
    monkeypatch.setattr(
        cli, "isolated_env", lambda home: {**isolated(home), "MAX_THINKING_TOKENS": str(budget)}
    )
    before = len(cli.served_requests(qwen3))
    qwen3_clis.test_claude_code_qwen3(qwen3, tmp_path)
    served = cli.answered(qwen3, "messages", before)
    # "hello" and the end of the turn, after a "</think>" where the prompt ended "<think>\n"
    assert [r["completion_tokens"] for r in served] == [2 + bool(budget)] * len(served)
