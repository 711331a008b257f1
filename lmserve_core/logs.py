"""structlog configuration: readable lines on a terminal, one JSON object per line elsewhere.

``--log-format auto`` (the default) picks by where stderr goes: a terminal gets structlog's
console lines, coloured unless ``NO_COLOR`` is set or the terminal is "dumb", and progress
bars (:mod:`lmserve_core.progress`; not on a "dumb" terminal); a file, a pipe or a service
manager's journal gets JSON lines. ``console`` and ``json`` force one or the other.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import MutableMapping
from dataclasses import dataclass
from typing import Any, TextIO

import structlog

from . import progress

FORMATS = ("auto", "console", "json")


@dataclass(frozen=True, slots=True)
class Output:
    """Where the logs go and how they are written."""

    stream: Any  # TextIO, or progress.Terminal around one
    json: bool  # one JSON object per line (else readable lines)
    terminal: bool  # the stream is a terminal (a line can be redrawn)
    colors: bool


_output: Output | None = None


def output() -> Output:
    """The output :func:`configure` set up last (before it: stderr, readable)."""
    return _output or Output(sys.stderr, json=False, terminal=False, colors=False)


def is_terminal(stream: Any) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError, OSError):  # no isatty, or closed
        return False


def use_colors(stream: Any) -> bool:
    """Colours on ``stream``: a terminal, not a "dumb" one, and ``NO_COLOR`` unset or
    empty (https://no-color.org)."""
    if os.environ.get("NO_COLOR") or os.environ.get("TERM") == "dumb":
        return False
    return is_terminal(stream)


def resolve(log_format: str, stream: Any) -> Output:
    """The output ``--log-format`` (auto, console or json) gives on ``stream``."""
    if log_format not in FORMATS:
        raise ValueError(f"log format must be one of {', '.join(FORMATS)}, got {log_format!r}")
    terminal = is_terminal(stream)
    json = log_format == "json" or (log_format == "auto" and not terminal)
    return Output(stream, json=json, terminal=terminal, colors=not json and use_colors(stream))


def _short_uvicorn_name(
    _: Any, __: str, event: MutableMapping[str, Any]
) -> MutableMapping[str, Any]:
    # uvicorn logs everything but access lines as "uvicorn.error"
    if event.get("logger") == "uvicorn.error":
        event["logger"] = "uvicorn"
    return event


def configure(
    level: str = "info", *, log_format: str = "auto", stream: TextIO | None = None
) -> Output:
    """Configure structlog for ``stream`` (default stderr), and route the standard
    library's loggers (uvicorn) through the same renderer so every line of the server's
    output has one format. Returns the output chosen."""
    global _output
    numeric = logging.getLevelName(level.upper())
    if not isinstance(numeric, int):
        numeric = logging.INFO
    out = resolve(log_format, stream if stream is not None else sys.stderr)
    # a bar is redrawn with an escape sequence a "dumb" terminal does not know
    bars = out.terminal and not out.json and os.environ.get("TERM") != "dumb"
    if bars:  # log lines clear a progress bar before they are written
        out = Output(progress.Terminal(out.stream), json=False, terminal=True, colors=out.colors)
    progress.configure(out.stream if bars else None, readable=not out.json)
    _output = out

    renderer: structlog.types.Processor
    stamp = structlog.processors.TimeStamper(fmt="iso", utc=True)
    foreign: list[structlog.types.Processor] = [structlog.stdlib.add_logger_name]
    if out.json:
        renderer = structlog.processors.JSONRenderer()
    else:
        renderer = structlog.dev.ConsoleRenderer(
            colors=out.colors, exception_formatter=structlog.dev.plain_traceback
        )
        stamp = structlog.processors.TimeStamper(fmt="%Y-%m-%d %H:%M:%S", utc=False)
        foreign.append(_short_uvicorn_name)
    shared: list[structlog.types.Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        stamp,
    ]
    handler = logging.StreamHandler(out.stream)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
            foreign_pre_chain=[*foreign, *shared],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(numeric)
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers[:] = []
        logging.getLogger(name).propagate = True
    structlog.configure(
        processors=[
            *shared,
            # the console renderer writes a traceback itself
            *([structlog.processors.format_exc_info] if out.json else []),
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=out.stream),
        cache_logger_on_first_use=True,
    )
    return out
