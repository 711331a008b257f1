"""The nanochat family's hooks: registers the ``nanochat`` backend.

A nanochat run is a checkpoint directory, not a GGUF file: :func:`open_checkpoint` reads it
(``checkpoint.load_checkpoint``: no torch, nothing unpickled but tensors and plain
containers) and presents it to the generic chat path as a GGUF in memory
(``view.build_view``), its matrices converted to ``--load-type``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lmserve_core.backend import Capabilities, SamplingDefaults, ServerSettings
from lmserve_core.gguf_file import GGUFError, GGUFFile
from lmserve_core.hookspecs import hookimpl
from lmserve_core.kit.family import BackendSpec, Family
from lmserve_core.model import FamilyConventions
from lmserve_core.tokenizer import Tokenizer, TokenType

from . import calculator
from .config import CheckpointError

ARCHITECTURE = "nanochat"
CAPABILITIES = Capabilities(grammar=True, reasoning=False, stop_strings=True, system_role=True)
# nanochat's chat_cli.py: temperature 0.6, top-k 50
SAMPLING = SamplingDefaults(temperature=0.6, top_k=50, top_p=1.0, min_p=0.0, repeat_penalty=1.0)
# The calculator's markers are shown in the reply and read back from a conversation's
# history as the tokens they are (llama.cpp's user-defined tokens); the turn markers stay
# control tokens, which a message's text can never produce.
TOOL_MARKERS = ("<|python_start|>", "<|python_end|>", "<|output_start|>", "<|output_end|>")
LOAD_TYPES = ("f32", "bf16", "f16", "q8_0")

# nanochat's tokenizer.render_conversation: <|bos|>, then the turns; a system message joins
# the user message after it (a blank line between), as nanochat does. Messages of other roles
# (tool results) are user turns; an assistant's tool calls are written as their JSON.
CHAT_TEMPLATE = """\
{%- set ns = namespace(pending='') -%}
{{- bos_token -}}
{%- for m in messages -%}
{%- set text = m.content if m.content is string else '' -%}
{%- if m.tool_calls -%}
{%- for c in m.tool_calls -%}
{%- set text = text + ('\\n' if text else '') + (c.function | tojson) -%}
{%- endfor -%}
{%- endif -%}
{%- if m.role in ('system', 'developer') -%}
{%- set ns.pending = ns.pending + ('\\n\\n' if ns.pending else '') + text -%}
{%- elif m.role == 'assistant' -%}
{%- if ns.pending -%}
{{- '<|user_start|>' + ns.pending + '<|user_end|>' -}}
{%- set ns.pending = '' -%}
{%- endif -%}
{{- '<|assistant_start|>' + text + '<|assistant_end|>' -}}
{%- else -%}
{{- '<|user_start|>' + (ns.pending + '\\n\\n' if ns.pending else '') + text + '<|user_end|>' -}}
{%- set ns.pending = '' -%}
{%- endif -%}
{%- endfor -%}
{%- if ns.pending -%}
{{- '<|user_start|>' + ns.pending + '<|user_end|>' -}}
{%- endif -%}
{%- if add_generation_prompt -%}
{{- '<|assistant_start|>' -}}
{%- endif -%}
"""


@dataclass(frozen=True, slots=True)
class Options:
    """The nanochat backend's own flags (``ServerSettings.options``)."""

    step: int | None = None  # the checkpoint's training step; None: the latest
    source: str | None = None  # base, mid, sft or rl; None: sft, rl, mid, base, the first
    tokenizer: str | None = None  # the tokenizer's path when it is not beside the checkpoint
    load_type: str = "q8_0"  # the type matrices are held in once read

    @classmethod
    def from_args(cls, args: Any) -> Options:
        return cls(step=args.step, source=args.source, tokenizer=args.tokenizer,
                   load_type=args.load_type)


def _step(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be 0 or positive (got {value})")
    return value


@hookimpl
def register_options(parser: argparse.ArgumentParser) -> None:
    """``--nanochat DIR`` and the checkpoint's flags."""
    c = parser.add_argument_group("nanochat checkpoints (models that are not GGUF files)")
    c.add_argument(
        "--nanochat",
        metavar="DIR",
        help="serve a nanochat checkpoint directory (its base dir, a *_checkpoints or d{N} "
        "dir, model.safetensors + tokenizer.bin, or the Hugging Face layout)",
    )
    c.add_argument("--step", type=_step,
                   help="the checkpoint's training step (default: the latest)")
    c.add_argument(
        "--source",
        choices=["base", "mid", "sft", "rl"],
        help="which of a nanochat base dir's checkpoints: base_, mid_, chatsft_ or "
        "chatrl_checkpoints (default: sft, then rl, then mid, then base, the first present)",
    )
    c.add_argument(
        "--tokenizer", metavar="PATH", help="the checkpoint's tokenizer, when it is not beside it"
    )
    c.add_argument(
        "--load-type",
        choices=list(LOAD_TYPES),
        default="q8_0",
        help="the type a checkpoint's matrices are held in once read (default q8_0)",
    )


def recognizes(path: str) -> bool:
    """A directory holding a nanochat run in one of the layouts ``load_checkpoint`` reads."""
    from .checkpoint import looks_like_nanochat

    return Path(path).is_dir() and looks_like_nanochat(path)


def open_checkpoint(path: str, settings: ServerSettings) -> GGUFFile:
    """Read the checkpoint at ``path`` and present it as a GGUF in memory."""
    from .checkpoint import load_checkpoint
    from .view import build_view

    opts = settings.options if isinstance(settings.options, Options) else Options()
    if opts.load_type not in LOAD_TYPES:
        raise CheckpointError(f"load type {opts.load_type!r}: one of {', '.join(LOAD_TYPES)}")
    try:
        ckpt = load_checkpoint(path, step=opts.step, tokenizer=opts.tokenizer, source=opts.source)
    except CheckpointError as exc:
        raise GGUFError(str(exc)) from None
    metadata: dict[str, Any] = dict(ckpt.vocab.gguf_metadata())
    # a raw prompt starts with <|bos|> as nanochat's engine prepends it (the chat template
    # writes it too: the one it writes is then dropped, as for every vocabulary adding one)
    metadata["tokenizer.ggml.add_bos_token"] = True
    types = list(metadata["tokenizer.ggml.token_type"])
    tokens = metadata["tokenizer.ggml.tokens"]
    for i, text in enumerate(tokens):
        if text in TOOL_MARKERS:
            types[i] = TokenType.USER_DEFINED
    metadata["tokenizer.ggml.token_type"] = types
    metadata["tokenizer.chat_template"] = CHAT_TEMPLATE
    # each float32 tensor is let go once converted: the peak is the converted model and one
    # source tensor, not both models whole
    tensors = _TakeOnce(ckpt.tensors)
    ckpt.tensors.clear()
    view = build_view(
        ckpt.config, tensors, path=ckpt.model_file, weights=opts.load_type, metadata=metadata
    )
    view.model_id = model_id(ckpt.model_file)
    return view


class _TakeOnce(dict[str, Any]):
    """A state dict whose entries leave it as they are read."""

    def get(self, key: str, default: Any = None) -> Any:  # type: ignore[override]
        return self.pop(key, default)


def model_id(model_file: Path) -> str:
    """``nanochat-d20-chatsft-000650`` for ``chatsft_checkpoints/d20/model_000650.pt``; the
    directory's name for the other layouts."""
    parts = model_file.parts
    if model_file.suffix == ".pt" and len(parts) >= 3:
        kind = parts[-3].removesuffix("_checkpoints")
        step = model_file.stem.removeprefix("model_")
        return f"nanochat-{parts[-2]}-{kind}-{step}"
    return model_file.parent.name or "nanochat"


def conventions(gguf: GGUFFile) -> FamilyConventions:
    """Stops at ``<|assistant_end|>`` and ``<|bos|>``; the calculator answered in place."""
    return FamilyConventions(
        capabilities=CAPABILITIES,
        sampling=SAMPLING,
        extra_stop_tokens=("<|bos|>",),
        continuation=Calculator(Tokenizer.from_gguf(gguf)),
    )


class Calculator:
    """nanochat's calculator tool: when the model closes ``<|python_start|>expr<|python_end|>``
    and ``expr`` is what nanochat's engine evaluates (arithmetic, or a string's ``.count``),
    ``<|output_start|>result<|output_end|>`` is written after it; anything else is left
    unanswered, as nanochat's engine does. ``calculator.evaluate`` never runs code."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        found = [tokenizer.token_id(t) for t in TOOL_MARKERS]
        ids = [i for i in found if i is not None]
        self.ids = ids if len(ids) == len(found) else None

    def __call__(self, tokens: Sequence[int]) -> list[int]:
        if self.ids is None or not tokens:
            return []
        start, end, out_start, out_end = self.ids
        if tokens[-1] != end:
            return []
        for i in range(len(tokens) - 2, -1, -1):
            if tokens[i] == start:
                break
            if tokens[i] == end:
                return []  # a closing marker without its opening one
        else:
            return []
        expr = list(tokens[i + 1 : -1])
        if not expr:
            return []
        result = calculator.evaluate(self.tokenizer.decode(expr))
        if result is None:
            return []
        return [out_start, *self.tokenizer.encode(result, add_special=False), out_end]


FAMILY = Family(
    "nanochat",
    model="lmserve_nanochat.model:NanochatModel",
    conventions=conventions,
    open=open_checkpoint,
    backends=[
        BackendSpec(
            "nanochat",
            (ARCHITECTURE,),
            "nanochat checkpoints (its own .pt + meta.json, model.safetensors + tokenizer.bin, "
            "or the Hugging Face layout)",
            recognizes=recognizes,
            options=Options.from_args,
            model_option="--nanochat",
        )
    ],
)
create_backend = FAMILY.create_backend
register_backends = FAMILY.register_backends
