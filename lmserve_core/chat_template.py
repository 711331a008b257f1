"""Chat templates: the Jinja source stored in a GGUF, rendered the way Hugging Face does.

Templates come from model files, so they are treated as untrusted code. They run in jinja2's
immutable sandbox, and rendering is bounded: every loop iteration and call spends from a step
budget with a deadline, and every operation that can grow a string or list (``~``, ``+``,
``*``, ``**``, ``%``, filters, method calls) is checked against a size cap before it runs.
A template that misbehaves fails with :class:`ChatTemplateError` instead of hanging the
server or exhausting its memory.
"""

from __future__ import annotations

import contextvars
import functools
import json
import re
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any, NoReturn, cast

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError
from jinja2.visitor import NodeTransformer

from lmserve_core.errors import InvalidRequest, LmserveError

if TYPE_CHECKING:
    from lmserve_core.gguf_file import GGUFFile
    from lmserve_core.request import Message, Tool
    from lmserve_core.tokenizer import Tokenizer

__all__ = [
    "CHATML_TEMPLATE",
    "ChatTemplate",
    "ChatTemplateError",
    "message_dicts",
    "tool_dicts",
]

DEFAULT_MAX_OUTPUT_CHARS = 8_000_000
DEFAULT_MAX_STEPS = 1_000_000
DEFAULT_TIMEOUT_S = 2.0
MAX_INT_ARGUMENT = 100_000  # widths, counts and repeats a template may ask for
MAX_LIST_ITEMS = 1_000_000
MAX_JSON_INDENT = 64

_LOOP_GUARD = "__lmserve_loop"
_CONCAT = "__lmserve_concat"
_BIG_NUMBER = re.compile(r"\d{7,}")


class ChatTemplateError(InvalidRequest):
    """The chat template could not be loaded or rendered (sandbox violation, budget, bug)."""

    def __init__(self, message: str, *, status: int | None = None) -> None:
        super().__init__(message, code="chat_template_error", status=status)


# -- per-render budget ------------------------------------------------------------------------


class _Budget:
    __slots__ = ("steps", "max_steps", "deadline", "max_chars")

    def __init__(self, max_steps: int, timeout: float, max_chars: int) -> None:
        self.steps = 0
        self.max_steps = max_steps
        self.deadline = time.monotonic() + timeout
        self.max_chars = max_chars

    def step(self) -> None:
        self.steps += 1
        if self.steps > self.max_steps:
            raise ChatTemplateError(
                f"chat template exceeded its budget of {self.max_steps} loop iterations and calls"
            )
        # Checking the clock every step would dominate cheap loops.
        if not self.steps & 0x3FF and time.monotonic() > self.deadline:
            raise ChatTemplateError("chat template took too long to render")

    def check_size(self, n: int, what: str) -> None:
        if n > self.max_chars:
            raise ChatTemplateError(
                f"chat template tried to build a {what} of {n} characters (limit {self.max_chars})"
            )


_BUDGET: contextvars.ContextVar[_Budget | None] = contextvars.ContextVar(
    "lmserve_template_budget", default=None
)


def _budget() -> _Budget:
    b = _BUDGET.get()
    if b is None:  # rendering outside render(): still bounded
        b = _Budget(DEFAULT_MAX_STEPS, DEFAULT_TIMEOUT_S, DEFAULT_MAX_OUTPUT_CHARS)
        _BUDGET.set(b)
    return b


def _sized(value: Any) -> int:
    return len(value) if isinstance(value, str | list | tuple | dict) else 0


def _check_result(value: Any) -> Any:
    b = _budget()
    if isinstance(value, str):
        b.check_size(len(value), "string")
    elif isinstance(value, list | tuple) and len(value) > MAX_LIST_ITEMS:
        raise ChatTemplateError(f"chat template tried to build a list of {len(value)} items")
    return value


def _check_int_args(args: Iterable[Any]) -> None:
    for a in args:
        if isinstance(a, int) and not isinstance(a, bool) and abs(a) > MAX_INT_ARGUMENT:
            raise ChatTemplateError(
                f"chat template passed {a} where at most {MAX_INT_ARGUMENT} is allowed"
            )


def _check_format_string(fmt: Any) -> None:
    if isinstance(fmt, str) and _BIG_NUMBER.search(fmt):
        raise ChatTemplateError("chat template used a format width or precision that is too large")


def _estimate_join(sep: Any, items: Any) -> None:
    if isinstance(items, list | tuple):
        total = sum(_sized(x) if isinstance(x, str) else 1 for x in items)
        total += _sized(sep) * max(len(items) - 1, 0)
        _budget().check_size(total, "string")


def _estimate_replace(s: Any, old: Any, new: Any) -> None:
    if isinstance(s, str) and isinstance(old, str) and isinstance(new, str):
        hits = s.count(old) if old else len(s) + 1
        _budget().check_size(len(s) + hits * max(len(new) - len(old), 0), "string")


def _loop_guard(iterable: Any) -> Iterator[Any]:
    b = _budget()
    for item in iterable:
        b.step()
        yield item


def _concat(*parts: Any) -> str:
    texts = [p if isinstance(p, str) else str(p) for p in parts]
    _budget().check_size(sum(len(t) for t in texts), "string")
    return "".join(texts)


class _GuardTransformer(NodeTransformer):
    """Routes every ``for`` iterable and every ``~`` through the budget checks."""

    def __init__(self, environment: jinja2.Environment) -> None:
        self.environment = environment

    def _call(self, name: str, args: list[nodes.Expr], lineno: int) -> nodes.Call:
        call = nodes.Call(nodes.Name(name, "load"), args, [], None, None, lineno=lineno)
        call.set_environment(self.environment)
        return call

    def visit_For(self, node: nodes.For) -> nodes.Node:
        self.generic_visit(node)
        node.iter = self._call(_LOOP_GUARD, [cast(nodes.Expr, node.iter)], node.lineno)
        return node

    def visit_Concat(self, node: nodes.Concat) -> nodes.Node:
        self.generic_visit(node)
        return self._call(_CONCAT, list(node.nodes), node.lineno)


# -- what Hugging Face templates expect -------------------------------------------------------


def _raise_exception(message: str) -> NoReturn:
    raise InvalidRequest(f"chat template rejected the conversation: {message}")


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: Sequence[str] | None = None,
    sort_keys: bool = False,
) -> str:
    if indent is not None and (not isinstance(indent, int) or indent > MAX_JSON_INDENT):
        raise ChatTemplateError(f"tojson indent must be at most {MAX_JSON_INDENT}")
    seps = tuple(separators) if separators is not None else None
    return json.dumps(
        value,
        ensure_ascii=ensure_ascii,
        indent=indent,
        separators=seps,  # type: ignore[arg-type]
        sort_keys=sort_keys,
    )


def _strftime_now(fmt: str) -> str:
    _check_format_string(fmt)
    return datetime.now().strftime(fmt)


class _GenerationTracker(Extension):
    """Accepts HF's ``{% generation %}...{% endgeneration %}`` and renders its body as is."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.Scope(body, lineno=lineno)


_PASSED_ARGS = (jinja2.runtime.Context, jinja2.Environment, nodes.EvalContext)


def _guard_filter(name: str, func: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(func)
    def guarded(*args: Any, **kwargs: Any) -> Any:
        _budget().step()
        # Leading context/environment arguments and the filtered value are not limits.
        values = [a for a in args if not isinstance(a, _PASSED_ARGS)]
        _check_int_args(values[1:])
        _check_int_args(kwargs.values())
        if name == "join" and values:
            _estimate_join(values[1] if len(values) > 1 else kwargs.get("d", ""), values[0])
        elif name == "replace" and len(values) >= 3:
            _estimate_replace(values[0], values[1], values[2])
        elif name == "indent" and values and isinstance(values[0], str):
            width = values[1] if len(values) > 1 else kwargs.get("width", 4)
            pad = len(width) if isinstance(width, str) else int(width)
            _budget().check_size(len(values[0]) + pad * (values[0].count("\n") + 1), "string")
        elif name == "format" and values:
            _check_format_string(values[0])
        return _check_result(func(*args, **kwargs))

    return guarded


class _Environment(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset({"+", "*", "**", "%"})

    def __init__(self) -> None:
        super().__init__(
            trim_blocks=True,
            lstrip_blocks=True,
            extensions=["jinja2.ext.loopcontrols", _GenerationTracker],
            autoescape=False,
        )
        self.filters["tojson"] = _tojson
        self.filters = {name: _guard_filter(name, f) for name, f in self.filters.items()}
        self.globals.pop("lipsum", None)  # unbounded text generator, never used by templates
        self.globals.update(
            raise_exception=_raise_exception,
            strftime_now=_strftime_now,
            **{_LOOP_GUARD: _loop_guard, _CONCAT: _concat},
        )

    def _parse(self, source: str, name: str | None, filename: str | None) -> nodes.Template:
        tree = super()._parse(source, name, filename)
        result = _GuardTransformer(self).visit(tree)
        assert isinstance(result, nodes.Template)
        return result

    def unsafe_undefined(self, obj: Any, attribute: str) -> NoReturn:  # type: ignore[override]
        # Fail loudly: jinja's default renders the forbidden value as "" and carries on.
        raise SecurityError(
            f"access to attribute {attribute!r} of a {type(obj).__name__!r} object is not allowed"
        )

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        b = _budget()
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, str | list | tuple) and isinstance(n, int):
                    b.check_size(len(seq) * max(n, 0), "string or list")
        elif operator == "+":
            if isinstance(left, str | list | tuple) and isinstance(right, str | list | tuple):
                b.check_size(len(left) + len(right), "string or list")
        elif operator == "**":
            if (
                isinstance(left, int)
                and isinstance(right, int)
                and abs(left) > 1
                and right * abs(left).bit_length() > 1 << 16
            ):
                raise ChatTemplateError("chat template computed a power that is too large")
        elif operator == "%" and isinstance(left, str):
            _check_format_string(left)
        return _check_result(super().call_binop(context, operator, left, right))

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        _budget().step()
        if __obj not in (_loop_guard, _concat):
            _check_int_args(args)
            _check_int_args(v for k, v in kwargs.items() if not k.startswith("_"))
            target = getattr(__obj, "__wrapped__", __obj)
            owner = getattr(target, "__self__", None)
            method = getattr(target, "__name__", "")
            if isinstance(owner, str):
                if method == "join" and args:
                    _estimate_join(owner, args[0])
                elif method == "replace" and len(args) >= 2:
                    _estimate_replace(owner, args[0], args[1])
                elif method in ("format", "format_map"):
                    _check_format_string(owner)
        return _check_result(super().call(__context, __obj, *args, **kwargs))


# -- conversation shaping ---------------------------------------------------------------------


def _merge_leading_systems(
    messages: Sequence[Mapping[str, Any]],
) -> list[dict[str, Any]] | None:
    """The conversation with its leading run of system messages made one, or None when it
    does not open with two or more."""
    n = 0
    while n < len(messages) and messages[n].get("role") == "system":
        n += 1
    if n < 2:
        return None
    texts = [_text_of(m.get("content")) for m in messages[:n]]
    first = dict(messages[0])
    first["content"] = "\n\n".join(t for t in texts if t)
    return [first, *(dict(m) for m in messages[n:])]


def _text_of(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        return "".join(
            str(part.get("text", "")) for part in content
            if isinstance(part, Mapping) and part.get("type") in (None, "text", "input_text")
        )
    return str(content)


def _prepare_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    prepared: list[dict[str, Any]] = []
    for m in messages:
        msg = dict(m)
        if msg.get("content") is None:
            msg["content"] = ""
        calls = msg.get("tool_calls")
        if calls:
            msg["tool_calls"] = [_prepare_call(c) for c in calls]
        prepared.append(msg)
    return prepared


def _prepare_call(call: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(call)
    fn = out.get("function")
    if isinstance(fn, Mapping):
        fn = dict(fn)
        args = fn.get("arguments")
        if isinstance(args, str):
            # Templates index into arguments (`arguments.items()`), as with HF's tokenizer.
            try:
                parsed = json.loads(args)
            except ValueError:
                parsed = None
            if isinstance(parsed, dict):
                fn["arguments"] = parsed
        out["function"] = fn
    return out


class ControlTextGuard:
    """Keeps control-token text that messages and tools supply from becoming control
    tokens when the rendered prompt is tokenized with special-token parsing.

    :meth:`apply` swaps every control-token text inside the strings of the template's
    inputs (found by ``find``, e.g. ``Tokenizer.control_texts_in``) for a placeholder of
    private-use characters; after rendering, :meth:`restore` puts the texts back and
    returns the character spans they occupy, which the tokenizer reads as plain text
    (``Tokenizer.encode(plain=...)``). A placeholder a template escaped as JSON comes back
    as the text's JSON escape. Inputs without such text render exactly as before.
    """

    OPEN, CLOSE = "\ue000", "\ue001"
    # a placeholder as is, or as JSON escapes it (a backslash, "ue000", ...)
    _PLACED = re.compile("\ue000([0-9]+)\ue001|" + r"\\ue000([0-9]+)\\ue001")

    def __init__(self, find: Callable[[str], list[str]]) -> None:
        self._find = find
        self.texts: list[str] = []  # the control texts replaced, by placeholder number
        self._numbers: dict[str, int] = {}

    def apply(self, value: Any) -> Any:
        """``value`` (strings, lists and dicts of them) with control texts replaced."""
        if isinstance(value, str):
            return self._guard(value)
        if isinstance(value, dict):
            return {k: self.apply(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self.apply(v) for v in value]
        return value

    def _guard(self, text: str) -> str:
        # longest first; one placeholder per distinct text, so a message of a million
        # control texts is replaced in one pass per distinct one
        for found in self._find(text):
            number = self._numbers.get(found)
            if number is None:
                number = self._numbers[found] = len(self.texts)
                self.texts.append(found)
            text = text.replace(found, f"{self.OPEN}{number}{self.CLOSE}")
        return text

    def restored_length(self, rendered: str) -> int:
        """A lower bound of the length of :meth:`restore`'s text, in two passes over
        ``rendered`` whatever the number of placeholders in it: a placeholder gives way to
        a text at least as long as the shortest one replaced."""
        if not self.texts:
            return len(rendered)
        digits = len(str(len(self.texts) - 1))
        shortest = min(map(len, self.texts))
        length = len(rendered)
        # (an opening character may also be the message's own: counted as shrinking too)
        if shortest < digits + 2:
            length -= rendered.count(self.OPEN) * (digits + 2 - shortest)
        if shortest < digits + 12:
            length -= rendered.count("\\ue000") * (digits + 12 - shortest)
        return max(0, length)

    def restore(self, rendered: str) -> tuple[str, list[tuple[int, int]]]:
        """The rendered text with the control texts back, and their spans."""
        if not self.texts:
            return rendered, []
        out: list[str] = []
        spans: list[tuple[int, int]] = []
        pos = length = 0
        for match in self._PLACED.finditer(rendered):
            raw, escaped = match.group(1), match.group(2)
            index = int(raw if raw is not None else escaped)
            if index >= len(self.texts):
                continue  # not one of ours
            text = self.texts[index]
            if raw is None:
                text = json.dumps(text)[1:-1]
            out.append(rendered[pos : match.start()])
            length += match.start() - pos
            spans.append((length, length + len(text)))
            out.append(text)
            length += len(text)
            pos = match.end()
        out.append(rendered[pos:])
        return "".join(out), spans


def message_dicts(messages: Iterable[Message]) -> list[dict[str, Any]]:
    """OpenAI-shaped message dicts (what templates expect) from normalized messages."""
    out: list[dict[str, Any]] = []
    for m in messages:
        d: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.reasoning is not None:
            d["reasoning_content"] = m.reasoning
        if m.tool_calls:
            d["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                }
                for c in m.tool_calls
            ]
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            d["name"] = m.name
        out.append(d)
    return out


def tool_dicts(tools: Iterable[Tool]) -> list[dict[str, Any]]:
    """OpenAI-shaped tool declarations (``{"type": "function", "function": {...}}``)."""
    return [
        {
            "type": "function",
            "function": {
                "name": t.name,
                "description": t.description,
                "parameters": t.parameters or {"type": "object", "properties": {}},
            },
        }
        for t in tools
    ]


# -- the template -----------------------------------------------------------------------------

_ENV = _Environment()


class ChatTemplate:
    """A compiled chat template.

    ``render`` returns the prompt text. When ``drop_leading_bos`` is true (set by
    :meth:`from_gguf` for vocabularies that add BOS themselves) a ``bos_token`` the template
    writes at the start is removed, so that encoding with ``add_special=True`` yields exactly
    one BOS, as in llama.cpp.
    """

    def __init__(
        self,
        source: str,
        *,
        bos_token: str = "",
        eos_token: str = "",
        drop_leading_bos: bool = False,
        max_output_chars: int = DEFAULT_MAX_OUTPUT_CHARS,
        max_steps: int = DEFAULT_MAX_STEPS,
        timeout: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.drop_leading_bos = drop_leading_bos
        self.max_output_chars = max_output_chars
        self.max_steps = max_steps
        self.timeout = timeout
        try:
            self._template = _ENV.from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise ChatTemplateError(
                f"chat template syntax error at line {exc.lineno}: {exc.message}", status=500
            ) from None

    @classmethod
    def from_gguf(
        cls, gguf_file: GGUFFile, tokenizer: Tokenizer, fallback: str | None = None
    ) -> ChatTemplate:
        """The template stored in ``tokenizer.chat_template``, else ``fallback``."""
        source = gguf_file.get("tokenizer.chat_template")
        if not isinstance(source, str) or not source.strip():
            if fallback is None:
                raise ChatTemplateError(
                    f"{gguf_file.path} has no chat template (tokenizer.chat_template) and no "
                    "fallback template was given",
                    status=500,
                )
            source = fallback
        bos = tokenizer.token_text(tokenizer.bos_id) if tokenizer.bos_id is not None else ""
        eos = tokenizer.token_text(tokenizer.eos_id) if tokenizer.eos_id is not None else ""
        return cls(source, bos_token=bos, eos_token=eos, drop_leading_bos=tokenizer.add_bos)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        **template_kwargs: Any,
    ) -> str:
        """Render a conversation of OpenAI-shaped message dicts to prompt text.

        Raises :class:`~lmserve_core.errors.InvalidRequest` when the template calls
        ``raise_exception`` and :class:`ChatTemplateError` when rendering fails. A template
        that refuses a conversation opening with several system messages (Qwen3.5's allows
        one; a client's instructions and a developer message are two) gets them as one, their
        texts joined by a blank line, as llama.cpp's server does.
        """
        try:
            return self._render(messages, tools, add_generation_prompt, template_kwargs)
        except InvalidRequest:
            merged = _merge_leading_systems(messages)
            if merged is None:
                raise
            return self._render(merged, tools, add_generation_prompt, template_kwargs)

    def _render(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: list[dict[str, Any]] | None,
        add_generation_prompt: bool,
        template_kwargs: Mapping[str, Any],
    ) -> str:
        context = dict(template_kwargs)
        context.update(
            messages=_prepare_messages(messages),
            tools=tools,
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
        )
        token = _BUDGET.set(_Budget(self.max_steps, self.timeout, self.max_output_chars))
        chunks: list[str] = []
        total = 0
        try:
            for chunk in self._template.generate(context):
                total += len(chunk)
                if total > self.max_output_chars:
                    raise ChatTemplateError(
                        f"chat template output exceeds {self.max_output_chars} characters"
                    )
                chunks.append(chunk)
        except LmserveError:
            raise
        except SecurityError as exc:
            raise ChatTemplateError(f"chat template tried an unsafe operation: {exc}") from None
        except RecursionError:
            raise ChatTemplateError("chat template recursed too deeply") from None
        except MemoryError:
            raise ChatTemplateError("chat template ran out of memory") from None
        except Exception as exc:  # template bugs surface as arbitrary Python errors
            raise ChatTemplateError(f"chat template failed: {type(exc).__name__}: {exc}") from None
        finally:
            _BUDGET.reset(token)
        text = "".join(chunks)
        if self.drop_leading_bos and self.bos_token and text.startswith(self.bos_token):
            text = text[len(self.bos_token) :]
        return text


# -- fallback template ------------------------------------------------------------------------

# Generic ChatML, for GGUFs that carry no template; family templates belong to their plugins.
CHATML_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}
{{- messages[0].content + '\\n\\n' }}
{%- endif %}
{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n' }}
{{- 'You are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}
{%- for tool in tools %}
{{- '\\n' + (tool | tojson) }}
{%- endfor %}
{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and ' }}
{{- 'arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n' }}
{{- '{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages and messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}
{%- if not loop.first %}
{{- '<|im_start|>system\\n' + message.content + '<|im_end|>\\n' }}
{%- endif %}
{%- elif message.role == 'user' %}
{{- '<|im_start|>user\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}
{{- '\\n' + message.content }}
{%- endif %}
{%- for call in message.tool_calls or [] %}
{%- set fn = call.function if call.function is defined else call %}
{{- '\\n<tool_call>\\n{"name": "' + fn.name + '", "arguments": ' }}
{%- if fn.arguments is string %}
{{- fn.arguments }}
{%- else %}
{{- fn.arguments | tojson }}
{%- endif %}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
{{- '<|im_start|>user' }}
{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
{{- '<|im_end|>\\n' }}
{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
