"""Question-answer accuracy of a model with or without a cartridge (see :mod:`.train`)."""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from .file import Cartridge
from .study import CONTEXT_PROMPT, Model


@dataclass
class QA:
    question: str
    answer: str  # the reply is right when it contains this (case-insensitive)


def read_questions(path: str | os.PathLike[str], doc: str | None = None) -> list[QA]:
    """Held-out questions: a JSON list, or JSON lines, of ``{"question", "answer"}``; with
    ``doc``, only those whose ``"doc"`` (when they name one) is ``doc``."""
    text = Path(path).read_text()
    rows = (
        json.loads(text)
        if text.lstrip().startswith("[")
        else [json.loads(line) for line in text.splitlines() if line.strip()]
    )
    return [
        QA(str(r["question"]), str(r["answer"]))
        for r in rows
        if doc is None or r.get("doc") in (None, doc)
    ]


def answers(
    model: Model,
    questions: Sequence[str],
    cartridge: Cartridge | None,
    *,
    context: str | None = None,
    max_new: int = 32,
    via: str = "engine",
) -> list[str]:
    """The model's greedy replies to ``questions`` behind ``cartridge`` (none: bare), with
    ``context`` as a system message when given; ``via`` "engine" (lmserve's forward pass,
    the cartridge served as ``--cartridge`` serves it) or "torch" (the training copy)."""
    prompts = []
    for q in questions:
        messages = []
        if context is not None:
            messages.append({"role": "system", "content": CONTEXT_PROMPT.format(chunk=context)})
        messages.append({"role": "user", "content": q})
        prompts.append(model.prompt(messages))
    if via == "torch":
        prefix = None if cartridge is None else model.lm.from_cartridge(cartridge)
        got = []
        for at in range(0, len(prompts), 16):
            got.extend(model.lm.generate(prompts[at : at + 16], prefix, max_new, model.stop))
        return [model.decode(g) for g in got]
    from .serve import prefixed

    engine = None if cartridge is None else prefixed(model.backend.model, cartridge)
    rng = random.Random(0)
    return [model.decode(model.sample(q, max_new, 0.0, rng, engine=engine)) for q in prompts]


def accuracy(
    model: Model,
    questions: Sequence[QA],
    cartridge: Cartridge | None,
    *,
    context: str | None = None,
    via: str = "engine",
    log: Callable[[str], None] | None = None,
) -> float:
    """The share of ``questions`` whose greedy reply contains the expected answer."""
    if not questions:
        return float("nan")
    replies = answers(model, [qa.question for qa in questions], cartridge, context=context, via=via)
    right = 0
    for qa, reply in zip(questions, replies, strict=True):
        ok = qa.answer.lower() in reply.lower()
        right += ok
        if log is not None:
            log(f"  [{'ok' if ok else '--'}] {qa.question} -> {reply.strip()[:100]!r}")
    return right / len(questions)
