"""Steering a synthetic model's replies: the real forward pass runs (kernels, KV cache and
positions stay honest) and the logit of the next scripted token gets a large bias, so a
model with random weights "says" the script and the server's parsers, grammars and
encoders see the tokens a real model would write.

``steered_qwen3`` (beside this file) serves such a model from a real ``lmserve`` process.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


class Steer:
    """Biases the logit of the next scripted token on top of the real forward pass.

    The prefill of a request gives the logits of reply token 0 and each later forward call
    those of the next one. ``then`` replaces the script once the server itself feeds the
    model a closing ``</think>`` (a reasoning budget ran out), so the reply can go on from
    wherever the server cut the reasoning. ``always`` is a token biased at every step: with
    a grammar, the model takes it as soon as the grammar allows.
    """

    BIAS = 100.0  # the synthetic model's logits are of order 10: the script always wins

    def __init__(self, backend: Any) -> None:
        self.tokenizer = backend.tokenizer
        self.close_id = backend.tokenizer.token_id("</think>")
        self.reset()
        forward, prefill = backend.model.forward, backend.scheduler.prefill_some

        def steered_prefill(gen: Any, shared: bool) -> None:
            if gen.slot is None:  # a new request starts reading its prompt
                self._k, self.steps = 0, []
            was, self._prefilling = gen.prefilled, True
            try:
                prefill(gen, shared)
            finally:
                self._prefilling = False
            if gen.prefilled and not was and gen.logits is not None:
                gen.logits = self._bias(gen.logits)

        def steered_forward(cache: Any, tokens: Sequence[int], pos: int, **kwargs: Any) -> Any:
            logits = forward(cache, tokens, pos, **kwargs)
            if self._prefilling:
                return logits
            self.steps.append(list(tokens))
            if self.then is not None and len(tokens) > 1 and self.close_id in tokens:
                self.script, self.then, self._k = self.then, None, 0
            return self._bias(logits)

        backend.scheduler.prefill_some = steered_prefill
        backend.model.forward = steered_forward

    def reset(self) -> None:
        self.script: list[int] = []
        self.then: list[int] | None = None
        self.always: int | None = None
        self.steps: list[list[int]] = []  # the tokens of each decode step, as fed
        self._k = 0
        self._prefilling = False

    def ids(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, parse_special=True)

    def say(self, text: str, then: str | None = None) -> None:
        self.script = self.ids(text)
        self.then = None if then is None else self.ids(then)

    def _bias(self, logits: np.ndarray) -> np.ndarray:
        out = np.array(logits, dtype=np.float32)  # never write into the model's buffer
        if self._k < len(self.script):
            out[self.script[self._k]] += self.BIAS
        if self.always is not None:
            out[self.always] += self.BIAS
        self._k += 1
        return out
