"""Grammars of constrained decoding: a request's output constraint or forced tool call
compiled for llguidance, and the matchers that mask each token of the reply.

Part of preparing a request (:mod:`lmserve_core.chat_prepare` decides which grammar a reply
follows); the scheduler (:mod:`lmserve_core.chat_schedule`) masks and feeds the matcher as
it samples. A JSON schema's objects are closed (``tools.closed_schema``), and JSON comes in
one fixed layout.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import numpy as np

from .errors import InvalidRequest, Unsupported
from .request import Constraint, NormalizedRequest, ToolChoiceMode
from .tokenizer import Tokenizer
from .tools import closed_schema

# JSON output in one fixed, readable layout: free whitespace lets small models pad forever.
_JSON_OPTIONS: Any = {  # llguidance's JsonCompileOptions
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}


class Grammars:
    """Compiles grammars over one vocabulary; the llguidance tokenizer is built once, on
    first use (walking a large vocabulary takes a while)."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, stop_ids: frozenset[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size  # the ids a mask may allow
        self.stop_ids = stop_ids  # the end tokens of the matcher, never a probe token
        self._ll: Any = None
        self._lock = threading.Lock()

    def compile(self, constraint: Constraint) -> str:
        """The llguidance grammar of ``constraint``."""
        field = field_of(constraint)
        try:
            import llguidance
        except ImportError:
            raise Unsupported(
                "constrained decoding needs the llguidance package (pip install "
                "'lmserve-core[grammar]')",
                param=field,
            ) from None
        M = llguidance.LLMatcher
        try:
            if constraint.kind == "json_schema":
                # Non-strict schemas promise no enforcement: tolerate keywords llguidance
                # does not implement instead of refusing the request. Objects are closed
                # either way (closed_schema): left open, a small model adds keys until
                # the token bound.
                grammar = M.grammar_from_json_schema(
                    closed_source(constraint.source or "{}"),
                    defaults=_JSON_OPTIONS,
                    overrides={"lenient": not constraint.strict},
                )
            elif constraint.kind == "json_object":
                grammar = M.grammar_from_json_schema(
                    json.dumps({"type": "object"}), defaults=_JSON_OPTIONS
                )
            elif constraint.kind == "regex":
                grammar = M.grammar_from_regex(constraint.source)
            elif constraint.kind == "lark":
                grammar = M.grammar_from_lark(constraint.source)
            else:
                raise Unsupported(f"unknown constraint kind {constraint.kind!r}")
        except ValueError as exc:
            raise InvalidRequest(
                f"invalid {constraint.kind} constraint: {exc}", param=field, code="invalid_grammar"
            ) from None
        return str(grammar)

    def matcher(self, grammar: str, kind: str, field: str | None = None) -> Any:
        """A fresh matcher of ``grammar`` (from :meth:`compile`), tried on its first token;
        ``kind`` names the constraint in the error of a grammar that does not compile, and
        ``field`` is the request field that error and that of a grammar past llguidance's
        limits name."""
        import llguidance

        matcher = llguidance.LLMatcher(self.ll_tokenizer(), grammar, log_level=0)
        if matcher.is_error():
            raise InvalidRequest(
                f"invalid {kind} constraint: {matcher.get_error()}",
                param=field,
                code="invalid_grammar",
            )
        self._try_first_token(matcher, field)
        return matcher

    def _try_first_token(self, matcher: Any, field: str | None) -> None:
        """Compute ``matcher``'s first mask and feed a copy of it one token the mask allows
        (not an end token): the lexer builds its first states, and a grammar too large for
        llguidance's limits (``a{1000000}``: too many expressions) fails now."""
        bits = np.empty((self.ll_tokenizer().vocab_size + 31) // 32, dtype=np.int32)
        matcher.unsafe_compute_mask_ptr(bits.ctypes.data, bits.nbytes)
        if matcher.is_error():
            raise grammar_limit(matcher, field, 0)
        allowed = np.flatnonzero(
            np.unpackbits(bits.view(np.uint8), bitorder="little")[: self.vocab_size]
        )
        token = next((int(t) for t in allowed if int(t) not in self.stop_ids), None)
        if token is None:
            return
        probe = matcher.deep_copy()
        if not probe.consume_token(token) or probe.is_error():
            raise grammar_limit(probe, field, 0)

    def ll_tokenizer(self) -> Any:
        # Walking the vocabulary takes a while on large vocabularies: once per backend.
        with self._lock:
            if self._ll is None:
                import llguidance

                self._ll = llguidance.LLTokenizer(
                    llguidance.TokenizerWrapper(_GrammarVocabulary(self.tokenizer)),
                    eos_token=sorted(self.stop_ids),
                )
            return self._ll

    def mask_words(self) -> np.ndarray:
        """A buffer for one token mask (32 tokens a word)."""
        return np.empty((self.ll_tokenizer().vocab_size + 31) // 32, dtype=np.int32)


def closed_source(source: str) -> str:
    """A JSON schema's text with its objects closed (``tools.closed_schema``); text that is
    no JSON stays as it is, for the grammar compiler to refuse."""
    try:
        schema = json.loads(source)
    except ValueError:
        return source
    return json.dumps(closed_schema(schema), ensure_ascii=False)


def either_grammar(first: str, second: str) -> str:
    """An llguidance grammar whose sentences are those of ``first`` or of ``second`` (each
    as :meth:`Grammars.compile` gives it: a top-level grammar's JSON, or lark)."""

    def part(grammar: str, name: str) -> dict[str, Any]:
        try:
            top = json.loads(grammar)
        except ValueError:
            return {"name": name, "lark_grammar": grammar}
        parts = top.get("grammars") if isinstance(top, dict) else None
        if not isinstance(parts, list) or len(parts) != 1 or not isinstance(parts[0], dict):
            raise ValueError("a grammar of several parts cannot be joined")
        return {**parts[0], "name": name}

    lark = {"lark_grammar": "start: @first | @second"}
    return json.dumps({"grammars": [lark, part(first, "first"), part(second, "second")]})


# The field a constraint came from when the dialect did not say (Chat Completions' names).
_CONSTRAINT_FIELDS = {
    "json_schema": "response_format",
    "json_object": "response_format",
    "regex": "regex",
    "lark": "lark",
}


def field_of(constraint: Constraint) -> str:
    """The request field ``constraint`` came from."""
    return constraint.field or _CONSTRAINT_FIELDS.get(constraint.kind, "response_format")


def grammar_field(request: NormalizedRequest) -> str | None:
    """The field the grammar of ``request``'s reply comes from: a forced call's, else its
    output constraint's (also when calls may come instead)."""
    if forces_call(request):
        return "tool_choice"
    return field_of(request.constraint) if request.constraint is not None else None


def grammar_limit(matcher: Any, field: str | None, tokens: int) -> InvalidRequest:
    """The 400 of a grammar that llguidance gave up on ``tokens`` tokens into the reply
    (a parser or lexer limit): the request's own content, named by its field."""
    detail = (matcher.get_error() or "the grammar failed").strip().splitlines()[0]
    where = "at the start of the reply" if tokens == 0 else f"after {tokens} tokens of the reply"
    name = f"'{field}'" if field else "the grammar"
    return InvalidRequest(
        f"{name}: the grammar exceeded a parser limit {where}: {detail}",
        param=field,
        code="grammar_too_complex",
    )


def forces_call(request: NormalizedRequest) -> bool:
    """True when the request forces a tool call (required, or a named tool)."""
    return bool(request.tools) and request.tool_choice.mode in (
        ToolChoiceMode.REQUIRED,
        ToolChoiceMode.NAMED,
    )


class _GrammarVocabulary:
    """The vocabulary as llguidance's ``TokenizerWrapper`` reads it."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        n = tokenizer.vocab_size
        self.eos_token_id = tokenizer.eos_id
        self.bos_token_id = tokenizer.bos_id
        self.tokens = [tokenizer.token_bytes(i) for i in range(n)]
        self.special_token_ids = [i for i in range(n) if tokenizer.is_special(i)]
        self._tokenizer = tokenizer

    def __call__(self, text: str | bytes) -> list[int]:
        if isinstance(text, bytes):
            raise TypeError("text, not bytes")  # tells the wrapper to hand over str
        return self._tokenizer.encode(text, add_special=False)
