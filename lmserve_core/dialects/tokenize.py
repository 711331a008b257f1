"""llama.cpp's ``POST /tokenize`` and ``POST /detokenize``.

They call the backend's tokenizer directly (in a worker thread, off the event loop) and
never go through the generation queue.
"""

from __future__ import annotations

from typing import Any

import msgspec
from anyio import to_thread
from litestar import post
from litestar.params import JSONBody

from ..backend import HasVocabulary
from ..errors import InvalidRequest, LmserveError
from ..server import Server, ServerDep


class TokenizeRequest(msgspec.Struct):
    """``{content, add_special, parse_special, with_pieces}`` as llama.cpp takes it."""

    content: str
    add_special: bool = False
    parse_special: bool = True
    with_pieces: bool = False


class DetokenizeRequest(msgspec.Struct):
    tokens: list[int] = []


def _piece_json(piece: bytes) -> str | list[int]:
    """llama.cpp's rule: the text when the bytes are valid UTF-8, else the byte values."""
    try:
        return piece.decode("utf-8")
    except UnicodeDecodeError:
        return list(piece)


def _check_ids(server: Server, ids: list[int]) -> None:
    backend = server.backend
    vocab = backend.vocab_size if isinstance(backend, HasVocabulary) else None
    for i, token in enumerate(ids):
        if token < 0 or (isinstance(vocab, int) and token >= vocab):
            raise InvalidRequest(f"'tokens[{i}]': token id {token} is out of range", param="tokens")


def _tokenizer_call(fn: Any, *args: Any, **kwargs: Any) -> Any:
    try:
        return fn(*args, **kwargs)
    except LmserveError:
        raise
    except (IndexError, KeyError, ValueError, OverflowError) as exc:
        # Tokenizers report unknown ids this way when the backend gives no vocab size.
        raise InvalidRequest(f"'tokens': {exc}", param="tokens") from exc


@post(["/tokenize"], status_code=200)
async def tokenize(data: JSONBody[TokenizeRequest], server: ServerDep) -> dict[str, Any]:
    """Token ids of ``content``; with ``with_pieces``, each id with its text piece."""
    backend = server.backend

    def run() -> dict[str, Any]:
        ids = backend.tokenize(
            data.content, add_special=data.add_special, parse_special=data.parse_special
        )
        if not data.with_pieces:
            return {"tokens": ids}
        return {"tokens": [{"id": t, "piece": _piece_json(backend.token_piece(t))} for t in ids]}

    result: dict[str, Any] = await to_thread.run_sync(run)
    return result


@post(["/detokenize"], status_code=200)
async def detokenize(data: JSONBody[DetokenizeRequest], server: ServerDep) -> dict[str, str]:
    """The text of a list of token ids."""
    _check_ids(server, data.tokens)
    content: str = await to_thread.run_sync(
        lambda: _tokenizer_call(server.backend.detokenize, list(data.tokens))
    )
    return {"content": content}


routes = [tokenize, detokenize]
