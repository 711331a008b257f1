"""Context distillation: a self-study conversation, the teacher's top-k targets, the loss of the
student behind the cartridge, and the optimizer over its rows (see :mod:`.train`)."""

from __future__ import annotations

import json
import math
import os
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .torch_lm import Prefix, TorchLM

TOP_K = 20
TOP_MASS = 0.99


@dataclass
class Conversation:
    """One self-study example: the student's tokens (chat prompt without the chunk, then the
    answer), where the answer starts, and the teacher's top-k over each answer token."""

    student: list[int]
    start: int
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]
    question: str = ""
    answer: str = ""
    seed: int = 0

    def to_json(self) -> str:
        return json.dumps(asdict(self), separators=(",", ":"))

    @classmethod
    def from_json(cls, line: str) -> Conversation:
        return cls(**json.loads(line))


def teacher_targets(
    logits: Any, start: int, n: int, k: int = TOP_K
) -> tuple[list[list[int]], list[list[float]]]:
    """Top-``k`` log-probabilities predicting the ``n`` tokens from ``start`` (rows
    ``start-1 ..``), each truncated once 0.99 of the mass is covered."""
    import torch

    with torch.no_grad():
        lp = torch.log_softmax(logits[start - 1 : start - 1 + n].float(), dim=-1)
        vals, idx = lp.topk(k, dim=-1)
    ids_out, lp_out = [], []
    for row_v, row_i in zip(vals.tolist(), idx.tolist(), strict=True):
        mass, keep = 0.0, 0
        for x in row_v:
            keep += 1
            mass += math.exp(x)
            if mass >= TOP_MASS:
                break
        ids_out.append(row_i[:keep])
        lp_out.append(row_v[:keep])
    return ids_out, lp_out


def distill_loss(lm: TorchLM, prefix: tuple[Any, Any] | None, conv: Conversation) -> Any:
    """Teacher top-k cross-entropy of the student behind ``prefix``, mean over the answer."""
    torch = lm.torch
    logits = lm.logits(conv.student, prefix)
    n = len(conv.top_ids)
    lp = torch.log_softmax(logits[conv.start - 1 : conv.start - 1 + n], dim=-1)
    width = max(len(r) for r in conv.top_ids)
    ids = torch.zeros((n, width), dtype=torch.long)
    weight = torch.zeros((n, width))
    for r, (ri, rl) in enumerate(zip(conv.top_ids, conv.top_logprobs, strict=True)):
        ids[r, : len(ri)] = torch.tensor(ri)
        weight[r, : len(rl)] = torch.tensor(rl).exp()
    return -(weight * lp.gather(1, ids)).sum(-1).mean()


class Trainer:
    """Adam on the prefix rows over self-study conversations, with resumable state."""

    def __init__(self, lm: TorchLM, prefix: Prefix, lr: float) -> None:
        import torch

        self.lm, self.prefix = lm, prefix
        self.opt = torch.optim.Adam(prefix.params(), lr=lr)
        self.step_no = 0
        self.losses: list[float] = []

    def step(self, batch: Sequence[Conversation]) -> float:
        self.opt.zero_grad(set_to_none=True)
        total = 0.0
        for conv in batch:
            loss = distill_loss(self.lm, self.prefix.full(), conv) / len(batch)
            loss.backward()
            total += float(loss.detach())
        self.opt.step()
        self.step_no += 1
        self.losses.append(total)
        return total

    def held_out(
        self, convs: Sequence[Conversation], prefix: tuple[Any, Any] | None = None
    ) -> float:
        """Mean distillation loss over ``convs`` (behind the trained prefix by default)."""
        torch = self.lm.torch
        if not convs:
            return float("nan")
        with torch.no_grad():
            use = self.prefix.full() if prefix is None else prefix
            return sum(float(distill_loss(self.lm, use, c)) for c in convs) / len(convs)

    def save(self, path: Path) -> None:
        torch = self.lm.torch
        state = {
            "k": self.prefix.k.detach(),
            "v": self.prefix.v.detach(),
            "sink_k": self.prefix.sink_k,
            "sink_v": self.prefix.sink_v,
            "opt": self.opt.state_dict(),
            "step": self.step_no,
            "losses": self.losses,
        }
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        torch.save(state, tmp)
        os.replace(tmp, path)

    def load(self, path: Path) -> None:
        torch = self.lm.torch
        state = torch.load(path, weights_only=True)
        with torch.no_grad():
            if state["k"].shape != self.prefix.k.shape:
                raise ValueError(
                    f"{path}: a checkpoint of {state['k'].shape[2] + 1} rows, this run trains "
                    f"{self.prefix.p}"
                )
            self.prefix.k.copy_(state["k"])
            self.prefix.v.copy_(state["v"])
            self.prefix.sink_k.copy_(state["sink_k"])
            self.prefix.sink_v.copy_(state["sink_v"])
        self.opt.load_state_dict(state["opt"])
        self.step_no = int(state["step"])
        self.losses = list(state["losses"])


def batch_for(step: int, pool: Sequence[Conversation], size: int, seed: int) -> list[Conversation]:
    """The conversations of optimizer step ``step``: a function of the step alone, so a
    resumed run draws the same batches."""
    rng = random.Random(f"{seed}:batch:{step}")
    return [pool[rng.randrange(len(pool))] for _ in range(size)]
