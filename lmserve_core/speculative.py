"""Speculative decoding: where draft tokens come from, and how many to try.

A generation that decodes alone may guess its next few tokens cheaply and have the model
check them in one forward pass: the model writes the rows of the token it sampled and of
the drafts, and the chat path samples each position from those rows exactly as plain
decoding would, keeping the drafts that match (``Sampler.sample`` with ``draft``: greedy
keeps a draft when it is the best token, sampling with the request's own probability of
it, so the output distribution is unchanged). Every token still passes the stop strings,
the grammar, the reasoning router and the tool parser one at a time.

Draft sources stand behind :class:`DraftSource`: :class:`PromptLookup` finds the longest
recent n-gram of the conversation that repeats and proposes what followed it (no second
model: strong when the reply quotes the prompt, as code edits, extraction and tool calls
do); :class:`DraftModel` runs a smaller GGUF of the same vocabulary greedily. Under a grammar
(a JSON schema, a forced tool call), the tokens the grammar forces next are drafted before
either: the keys and punctuation of a schema cost verify rows, not decode steps.

:class:`Speculation` is the chat path's part that does it: the scheduler hands it each step
of a generation decoding alone; it asks the drafter, verifies the drafts in one pass and
keeps what sampling accepts, rewinding a state that cannot be cut back. :class:`VerifyCost`
and :class:`Pace` decide how many drafts a pass is worth.
"""

from __future__ import annotations

import collections
import math
import statistics
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import structlog

from .backend import HasModel
from .gguf_file import GGUFFile
from .model import ForwardModel, KVCache
from .settings import ServerSettings
from .tokenizer import Tokenizer

if TYPE_CHECKING:
    from .chat_schedule import Generation
    from .gguf_chat import GGUFChatBackend

log = structlog.get_logger("lmserve.gguf_chat")

# Most drafts verified in one pass: with the sampled token, 7 rows. A pass must stay within
# kernels.DECODE_MAX_ROWS (15) to keep the verification on decode's kernels, so that its
# logits are bit for bit those of plain decoding and greedy output is byte-identical; 7
# because a longer pass rarely pays for its rows (``Pace.best``).
MAX_DRAFT = 6

# The evidence of drafts that the request's grammar forces (the only tokens it allows next),
# for :class:`Pace` to estimate apart from the lookup's n-gram lengths (1 and up). They are
# verified like any draft: the model may still spell the same text in other tokens.
FORCED = 0


class Drafter(Protocol):
    """One generation's drafting state."""

    #: (Optional, False when absent.) True when a proposal costs next to nothing (a
    #: lookup): the chat path then asks for MAX_DRAFT tokens every pass and lets
    #: :class:`Pace` decide, from the proposal's ``evidence``, how many of them to verify.
    #: A costly drafter (a model) is told the number first.
    free: bool
    #: (Optional, None when absent.) How the last proposal was found, for :class:`Pace` to
    #: keep a separate acceptance estimate for each kind (the lookup: the length of the
    #: n-gram it matched); None when every proposal is alike.
    evidence: int | None

    def propose(self, history: Sequence[int], k: int) -> list[int]:
        """Up to ``k`` tokens likely to follow ``history`` (the prompt and every token
        generated so far, the last one included); [] when there is no good guess."""

    def close(self) -> None:
        """Release what the drafter holds."""


class DraftSource(Protocol):
    """Where a backend's drafts come from; one :class:`Drafter` per generation."""

    name: str

    def drafter(self) -> Drafter:
        """A drafter for a new generation."""


class VerifyCost:
    """What a verify pass of ``1 + k`` rows costs on this machine and model, in plain decode
    steps: ``1 + row * k``.

    ``row`` rests on a calibration (:meth:`calibrate`, at start-up), in which each verify
    pass is read against the one-row passes either side of it. Live passes only raise it
    (a long context, a machine whose further rows cost more under load): each verify pass
    is read against the one-row passes among the ``RECENT`` passes before it (their
    median; ``MIN_STEPS`` of them at least, else it is not read), and ``row`` is the larger
    of the calibration and the median of the readings among the last ``AGE`` passes (the
    last ``WINDOW`` of them, ``MIN_PASSES`` at least). A pass read against passes of its own
    moment, a slow spell of the machine reads neither as cheap rows nor as dear ones; a few
    passes that something else held up move no median; and readings age, so that one that
    nothing corrects (no drafting, hence no readings) does not outlive ``AGE`` passes.
    Without a calibration the live passes stand alone, and ``Pace.VERIFY_ROW_COST`` while
    there are too few. Readings are clamped to ``[ROW_MIN, ROW_MAX]``."""

    WINDOW = 15
    MIN_PASSES = 5
    RECENT = 6
    MIN_STEPS = 2
    AGE = 256
    ROW_MIN = 0.1
    ROW_MAX = 1.5
    # calibration: the verify passes' sizes, the context they follow, how many are read
    CALIBRATION_ROWS = (1 + MAX_DRAFT, 4)
    CALIBRATION_CONTEXT = 64
    CALIBRATION_PASSES = (10, 40)  # at least, at most (while within the time asked for)

    def __init__(self, calibrated: float | None = None) -> None:
        self.calibrated = None if calibrated is None else self._clamp(calibrated)
        self.measured: float | None = None  # the live passes' reading (None: too few)
        self.passes = 0
        # (pass number, seconds) of the last one-row passes; (pass number, reading) of the
        # last verify passes read against them
        self._steps: collections.deque[tuple[int, float]] = collections.deque(maxlen=self.RECENT)
        self._ratios: collections.deque[tuple[int, float]] = collections.deque(maxlen=self.WINDOW)

    @classmethod
    def _clamp(cls, row: float) -> float:
        return min(max(row, cls.ROW_MIN), cls.ROW_MAX)

    @property
    def row(self) -> float:
        measured = self.measured
        if self.calibrated is None:
            return Pace.VERIFY_ROW_COST if measured is None else measured
        return self.calibrated if measured is None else max(self.calibrated, measured)

    def observe(self, rows: int, seconds: float) -> None:
        """Record one pass of ``rows`` rows (the sampled token and its drafts) that took
        ``seconds``."""
        if rows < 1 or not seconds > 0.0 or not math.isfinite(seconds):
            return
        self.passes += 1
        ratios = self._ratios
        if ratios and ratios[0][0] <= self.passes - self.AGE:
            while ratios and ratios[0][0] <= self.passes - self.AGE:
                ratios.popleft()
            self._read()
        if rows == 1:
            self._steps.append((self.passes, seconds))
            return
        recent = [t for n, t in self._steps if n >= self.passes - self.RECENT]
        if len(recent) < self.MIN_STEPS:
            return
        ratios.append((self.passes, (seconds / statistics.median(recent) - 1.0) / (rows - 1)))
        self._read()

    def _read(self) -> None:
        ratios = self._ratios
        self.measured = (
            self._clamp(statistics.median(r for _, r in ratios))
            if len(ratios) >= self.MIN_PASSES
            else None
        )

    def calibrate(self, model: ForwardModel, seconds: float = 0.5) -> float:
        """Measure ``row`` on ``model``, on a cache of its own, for about ``seconds``: verify
        passes of each of ``CALIBRATION_ROWS`` rows in turn after ``CALIBRATION_CONTEXT``
        positions, each between two one-row passes and read against their mean; the median
        of the readings (``CALIBRATION_PASSES``: at least, at most). Passes read against
        their neighbours, because on a busy machine no pass of a size is spared for sure: the
        quickest of each size may come from moments apart. Returns the calibration."""
        sizes = self.CALIBRATION_ROWS
        n_ctx = self.CALIBRATION_CONTEXT
        tokens = [(1000 + 37 * i) % model.n_vocab for i in range(n_ctx)]
        cache = model.new_cache(n_ctx + max(sizes))
        rewind = not cache.kind.truncate  # a recurrent state goes back to the context

        def timed(n: int) -> float:
            if rewind:
                cache.mark()  # type: ignore[attr-defined]
            began = time.perf_counter()
            model.forward(cache, tokens[:n], n_ctx, all_logits=True)
            took = time.perf_counter() - began
            if rewind:
                cache.rewind()  # type: ignore[attr-defined]
            return took

        readings: list[float] = []
        try:
            model.forward(cache, tokens, 0)
            for n in sizes:
                timed(n)  # a warm-up
            least, most = self.CALIBRATION_PASSES
            started = time.perf_counter()
            before = timed(1)
            while len(readings) < least or (
                len(readings) < most and time.perf_counter() - started < seconds
            ):
                n = sizes[len(readings) % len(sizes)]
                took = timed(n)
                after = timed(1)
                readings.append((2.0 * took / (before + after) - 1.0) / (n - 1))
                before = after
        finally:
            close = getattr(cache, "close", None)
            if callable(close):
                close()
        self.calibrated = self._clamp(statistics.median(readings))
        return self.calibrated


class Acceptance:
    """How the drafts of each kind of evidence fared over the recent passes of every
    generation of a backend (from ``Pace.PRIOR``, decaying by ``DECAY`` a pass of that
    kind): where a new generation's estimates start, instead of learning each kind again
    from a guess."""

    DECAY = 0.9

    def __init__(self) -> None:
        self._kinds: dict[int | None, tuple[float, float]] = {}

    def rate(self, evidence: int | None = None) -> float | None:
        """The chance that a draft of this kind is accepted; None before any was tried."""
        kind = self._kinds.get(evidence)
        return None if kind is None else kind[0] / kind[1]

    def update(self, evidence: int | None, accepted: int, missed: int) -> None:
        prior = (Pace.PRIOR * Pace.PRIOR_WEIGHT, Pace.PRIOR_WEIGHT)
        hits, trials = self._kinds.get(evidence, prior)
        self._kinds[evidence] = (
            self.DECAY * hits + accepted,
            self.DECAY * trials + accepted + missed,
        )


class _Rate:
    """A decaying estimate of the chance that a draft is accepted."""

    def __init__(self, value: float, weight: float) -> None:
        self.hits, self.trials = value * weight, weight
        self.paused = 0
        self.pauses = 0  # pauses with no draft accepted since (each twice as long)
        self.probe = False  # the pause is over: verify one draft whatever the estimates

    @property
    def value(self) -> float:
        return self.hits / self.trials


class Pace:
    """How many drafts one generation tries next.

    A verify pass of ``1 + k`` rows costs ``1 + c * k`` decode steps, ``c`` the backend's
    :class:`VerifyCost`, and with each draft accepted with probability ``a`` it yields
    ``1 + a + ... + a^k`` tokens. ``a`` is estimated from the generation's recent passes
    (an accepted draft is a hit, the rejected one a miss, decaying by ``DECAY`` a pass),
    separately for each kind of ``evidence`` a proposal comes with: a lookup that matched
    eight tokens of context is right far more often than one that matched two. A kind's
    estimate starts from what the backend's recent generations found for it
    (:class:`Acceptance`, worth ``PRIOR_WEIGHT`` drafts; ``PRIOR`` before any), so that a
    new generation does not pay again for what the last one learnt.

    ``k`` maximises tokens per cost, and must beat plain decoding by ``MARGIN``: a pass
    that would gain less is within the error of the estimates, and a wrong guess there
    costs more than a right one gains. When no ``k`` does for a kind, proposals of that
    kind are skipped for a while, then the kind starts again from the backend's estimate,
    with one draft at least (a probe: were the estimates wrong, only passes that verify
    something can correct them). The pause is ``SHORT_PAUSE`` chances when the backend's
    estimate pays (a bad spell of this generation: a quoted text left for a while),
    ``PAUSE_TOKENS`` when it does not (free text, whose lookups are mostly refused), and
    twice as long after each pause that no accepted draft followed, up to
    ``MAX_DOUBLINGS`` times: drafts refused again and again are probed ever more rarely.
    """

    VERIFY_ROW_COST = 0.4
    PAUSE_TOKENS = 16
    MAX_DOUBLINGS = 3
    SHORT_PAUSE = 4
    DECAY = 0.7
    PRIOR = 0.8  # before any draft of a kind was tried: try at once
    PRIOR_WEIGHT = 2.0
    MARGIN = 0.05

    def __init__(self, cost: VerifyCost | None = None, shared: Acceptance | None = None) -> None:
        self.proposed = 0
        self.accepted = 0
        self.cost = cost if cost is not None else VerifyCost()  # a fresh one: the prior
        self.shared = shared if shared is not None else Acceptance()
        self._rates: dict[int | None, _Rate] = {}

    def _prior(self, evidence: int | None) -> float:
        rate = self.shared.rate(evidence)
        return self.PRIOR if rate is None else rate

    def _rate(self, evidence: int | None) -> _Rate:
        rate = self._rates.get(evidence)
        if rate is None:
            rate = self._rates[evidence] = _Rate(self._prior(evidence), self.PRIOR_WEIGHT)
        return rate

    def rate(self, evidence: int | None = None) -> float:
        """The estimated chance that a draft of this kind is accepted."""
        return self._rate(evidence).value

    def budget(self, most: int, evidence: int | None = None) -> int:
        """Drafts to verify now (0: decode plainly this step)."""
        rate = self._rate(evidence)
        if rate.paused > 0:
            rate.paused -= 1
            rate.probe = rate.paused == 0
            return 0
        k = self.best(rate.value, min(most, MAX_DRAFT), self.cost.row)
        probe, rate.probe = rate.probe, False
        if k > 0 or most <= 0:
            return k
        if probe:
            return 1  # its pass refreshes the rate and the cost, right or wrong as they were
        # a pause: short when the backend's estimate pays (a bad spell of this generation's)
        prior = self._prior(evidence)
        short = self.best(prior, min(most, MAX_DRAFT), self.cost.row) > 0
        pause = self.SHORT_PAUSE if short else self.PAUSE_TOKENS
        rate.paused = pause << min(rate.pauses, self.MAX_DOUBLINGS)
        rate.pauses += 1
        rate.hits, rate.trials = prior * self.PRIOR_WEIGHT, self.PRIOR_WEIGHT
        return 0

    @classmethod
    def best(
        cls, a: float, most: int, row: float | None = None, margin: float | None = None
    ) -> int:
        """The number of drafts that yields most tokens per cost at acceptance ``a``, a
        verify row costing ``row`` decode steps (default ``VERIFY_ROW_COST``); 0 unless it
        beats plain decoding by ``margin`` (default ``MARGIN``)."""
        row = cls.VERIFY_ROW_COST if row is None else row
        margin = cls.MARGIN if margin is None else margin
        best_k, best_gain = 0, 1.0 + margin
        expected = 0.0
        for k in range(1, most + 1):
            expected += a**k
            gain = (1.0 + expected) / (1.0 + row * k)
            if gain > best_gain:
                best_k, best_gain = k, gain
        return best_k

    def update(self, proposed: int, accepted: int, evidence: int | None = None) -> None:
        self.proposed += proposed
        self.accepted += accepted
        missed = 1 if accepted < proposed else 0
        rate = self._rate(evidence)
        rate.hits = self.DECAY * rate.hits + accepted
        rate.trials = self.DECAY * rate.trials + accepted + missed
        if accepted:
            rate.pauses = 0
        self.shared.update(evidence, accepted, missed)


class PromptLookup:
    """Drafts from the conversation itself: the tokens that followed the most recent
    earlier occurrence of its last ``n`` tokens, for the longest ``n`` from ``max_ngram``
    down to ``min_ngram`` that occurs; ``n`` is the proposal's evidence."""

    name = "prompt-lookup"

    def __init__(self, max_ngram: int = 8, min_ngram: int = 2) -> None:
        if not 1 <= min_ngram <= max_ngram:
            raise ValueError("need 1 <= min_ngram <= max_ngram")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def drafter(self) -> Drafter:
        return _LookupDrafter(self.max_ngram, self.min_ngram)


class _LookupDrafter:
    free = True

    def __init__(self, max_ngram: int, min_ngram: int) -> None:
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram
        self.evidence: int | None = None
        self._ids: list[int] = []  # the history so far
        # where each token, and each pair of tokens, ends in it (ascending)
        self._ones: dict[int, list[int]] = {}
        self._pairs: dict[tuple[int, int], list[int]] = {}

    def _sync(self, history: Sequence[int]) -> list[int]:
        """The history, indexing only what is new since the last call."""
        ids, n_hist = self._ids, len(history)
        if len(ids) > n_hist or (ids and ids[-1] != history[len(ids) - 1]):
            self.close()  # a different history: start over
            ids = self._ids
        ones, pairs = self._ones, self._pairs
        for at in range(len(ids), n_hist):
            tok = int(history[at])
            ones.setdefault(tok, []).append(at)
            if at:
                pairs.setdefault((ids[-1], tok), []).append(at)
            ids.append(tok)
        return ids

    def propose(self, history: Sequence[int], k: int) -> list[int]:
        n_hist = len(history)
        self.evidence = None
        if k <= 0 or n_hist <= self.min_ngram:
            return []
        ids = self._sync(history)
        last = n_hist - 1
        # the earlier positions (before the last token) where the history's last `depth`
        # tokens end too, narrowed one token further back at a time; the latest end of the
        # longest match is taken
        cap = min(self.max_ngram, last)
        ends, depth = (self._pairs[ids[-2], ids[-1]][:-1], 2) if cap >= 2 else ([], 1)
        if not ends:
            ends, depth = self._ones[ids[-1]][:-1], 1
            if not ends:
                return []
        found = ends
        while depth < cap:
            want = ids[last - depth]
            ends = [e for e in ends if e >= depth and ids[e - depth] == want]
            if not ends:
                break
            found, depth = ends, depth + 1
        if depth < self.min_ngram:
            return []
        start = found[-1] + 1
        self.evidence = depth
        return ids[start : start + k]

    def close(self) -> None:
        self._ids, self._ones, self._pairs = [], {}, {}


class DraftModel:
    """Drafts from a smaller model of the same vocabulary, greedy, on its own cache."""

    name = "draft-model"

    def __init__(self, model: ForwardModel, n_ctx: int, owner: Any = None) -> None:
        self.model = model
        self.n_ctx = n_ctx
        self.owner = owner  # what keeps the model alive (its backend), closed with it

    def drafter(self) -> Drafter:
        return _ModelDrafter(self.model, self.n_ctx)

    def close(self) -> None:
        close = getattr(self.owner, "close", None)
        if callable(close):
            close()


class _ModelDrafter:
    free = False
    evidence: int | None = None

    def __init__(self, model: ForwardModel, n_ctx: int) -> None:
        self.model = model
        self.n_ctx = n_ctx
        self._cache: KVCache | None = None
        self._rows: list[int] = []  # the tokens whose rows the draft cache holds

    def propose(self, history: Sequence[int], k: int) -> list[int]:
        n = len(history)
        if k <= 0 or n + k > self.n_ctx:
            return []
        if self._cache is None:
            self._cache = self.model.new_cache(self.n_ctx)
        keep = 0
        rows = self._rows
        limit = min(len(rows), n - 1)
        while keep < limit and rows[keep] == history[keep]:
            keep += 1
        keep = self._cache.reusable_prefix(len(rows), keep) if keep else 0
        self._cache.truncate(keep)
        del rows[keep:]
        logits = self.model.forward(self._cache, list(history[keep:]), keep)
        rows.extend(history[keep:])
        # a state that cannot be cut back (a recurrent cache) is remembered here, at the end
        # of the history, and returned to after drafting: the next history continues it
        mark = getattr(self._cache, "mark", None) if not self._cache.kind.truncate else None
        if mark is not None:
            mark()
        out: list[int] = []
        for _ in range(k):
            tok = int(np.argmax(logits))
            out.append(tok)
            if len(out) == k:
                break
            logits = self.model.forward(self._cache, [tok], len(rows))
            rows.append(tok)
        if mark is not None:
            self._cache.rewind()  # type: ignore[attr-defined]
            del rows[n:]
        return out

    def close(self) -> None:
        close = getattr(self._cache, "close", None)
        if callable(close):
            close()
        self._cache = None
        self._rows = []


class Speculation:
    """A backend's speculative decoding: each step of a generation decoding alone writes its
    sampled token with drafts after it, and keeps as many as sampling accepts. It reads the
    backend's ``drafts``, ``verify_cost`` and model, and the scheduler's ``advance`` and
    ``write_one``."""

    def __init__(self, chat: GGUFChatBackend) -> None:
        self.chat = chat

    def calibrate(self) -> None:
        """Measure what a verify row costs on this machine (``VerifyCost.calibrate``);
        without it, the generations' own passes tell."""
        chat = self.chat
        started = time.perf_counter()
        try:
            row = chat.verify_cost.calibrate(chat.model)
        except Exception:  # a model that cannot run the calibration still speculates
            log.exception("spec_calibration_failed", model=chat.model_id)
            return
        log.info(
            "spec_calibration",
            model=chat.model_id,
            row_cost=round(row, 3),
            seconds=round(time.perf_counter() - started, 2),
        )

    def speculate(self, gen: Generation, tokens: list[int]) -> None:
        """Write ``tokens`` (one sampled token) with drafts after it in one pass, and take
        as many of the drafts as sampling from the rows written accepts."""
        assert gen.pace is not None and gen.drafter is not None
        chat = self.chat
        slot = gen.kv
        pace, drafter = gen.pace, gen.drafter
        most = min(
            gen.prepared.max_tokens - len(gen.generated),
            chat.context_length - len(slot.tokens) - 1,
            MAX_DRAFT,
        )
        drafts: list[int] = []
        forced = self.grammar_drafts(gen, most)
        if forced:
            evidence: int | None = FORCED
            drafts = forced[: pace.budget(len(forced), evidence)]
        elif getattr(drafter, "free", False):
            # propose first: how many to verify depends on how the proposal was found
            if most > 0:
                drafts = drafter.propose(gen.prepared.tokens + gen.generated, most)
            evidence = getattr(drafter, "evidence", None)
            if drafts:
                drafts = drafts[: pace.budget(len(drafts), evidence)]
        else:
            evidence = None
            k = pace.budget(most)
            if k > 0:
                drafts = drafter.propose(gen.prepared.tokens + gen.generated, k)[:k]
        started = time.perf_counter()
        if not drafts:
            chat.scheduler.write_one(gen, tokens)
            chat.verify_cost.observe(len(tokens), time.perf_counter() - started)
            return
        # a state that cannot be cut back is remembered, to return to if drafts are refused
        rewind = not slot.cache.kind.truncate
        if rewind:
            slot.cache.mark()  # type: ignore[attr-defined]
        rows = chat.model.forward(slot.cache, tokens + drafts, len(slot.tokens), all_logits=True)
        chat.verify_cost.observe(len(tokens) + len(drafts), time.perf_counter() - started)
        written = list(tokens)  # the rows that hold this sequence's tokens
        accepted = 0
        for i, draft in enumerate(drafts):
            step = chat.scheduler.advance(gen, rows[i], draft)
            if step is None:
                break  # ended (the rows past the shadow are not part of it)
            if step[0] != draft:
                gen.todo = step  # a correction: its row is written next step
                break
            accepted += 1
            written.append(draft)
            if len(step) > 1:
                gen.todo = step[1:]  # the tokens closing a think block follow it
                break
        else:
            gen.logits = rows[len(drafts)]
        pace.update(len(drafts), accepted, evidence)
        if rewind and len(written) < len(tokens) + len(drafts):
            # the state went past the rows kept: back to before the pass, then the kept rows
            chat.model.forward(slot.cache, written, slot.cache.rewind())  # type: ignore[attr-defined]
        slot.tokens.extend(written)

    @staticmethod
    def grammar_drafts(gen: Generation, most: int) -> list[int]:
        """Up to ``most`` tokens that the request's grammar allows alone from here (the keys
        and punctuation of a JSON schema): drafts that only the model's choosing another
        tokenization of the same text can reject."""
        matcher = gen.prepared.matcher
        if matcher is None or most <= 0 or matcher.is_stopped():
            return []
        return [int(t) for t in matcher.compute_ff_tokens()[:most]]


def draft_source(
    settings: ServerSettings, context_length: int, tokenizer: Tokenizer, model_id: str
) -> DraftSource | None:
    """Speculative decoding's drafts: a draft model (``spec_draft``, a GGUF path), the
    conversation itself (``spec``), or none."""
    path = settings.speculation.draft
    if not path:
        return PromptLookup() if settings.speculation.prompt_lookup else None
    from . import plugins

    draft_gguf = GGUFFile.open(path)
    spec = plugins.backend_for_architecture(draft_gguf.architecture)
    draft_gguf.close()
    if spec is None:
        raise ValueError(f"no installed family serves the draft's {draft_gguf.architecture!r}")
    draft_settings = ServerSettings(
        ctx=context_length,
        threads=settings.threads,
        kv_slots=1,
        kv_type=settings.kv_type,
        batch=1,
    )
    draft = spec.factory(str(path), draft_settings)
    if not isinstance(draft, HasModel):
        draft.close()
        raise ValueError(f"the draft model {path}: its backend {spec.name} has no model to draft")
    model, theirs = draft.model, draft.tokenizer
    n = tokenizer.vocab_size
    if (
        model is None
        or theirs is None
        or theirs.vocab_size != n
        or any(theirs.token_bytes(i) != tokenizer.token_bytes(i) for i in range(n))
    ):
        draft.close()
        raise ValueError(f"the draft model {path} does not share this model's vocabulary")
    log.info("draft_model", path=str(path), backend=spec.name, model=model_id)
    return DraftModel(model, context_length, owner=draft)
