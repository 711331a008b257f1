"""Speculative decoding: drafts, their verification in one pass, and what it must not change
(greedy text byte for byte, the sampled distribution, stop strings, grammars, the slot's
token shadow)."""

from __future__ import annotations

import collections
import math
from collections.abc import Sequence
from typing import Any

import numpy as np
import pytest
from scripted import (  # noqa: F401  (the fixtures)
    IM_END,
    PERSON_SCHEMA,
    ListSink,
    ScriptedModel,
    _gguf,
    _one_tokenizer,
    _tokenizer,
    chat,
    check_shadow,
    ids,
    make_backend,
    run,
)

from lmserve_core.backend import ServerSettings
from lmserve_core.gguf_chat import GGUFChatBackend
from lmserve_core.gguf_file import GGUFFile
from lmserve_core.request import Constraint, Message, NormalizedRequest, Sampling
from lmserve_core.sampling import ResolvedSampling, Sampler
from lmserve_core.settings import SpeculationSettings
from lmserve_core.speculative import FORCED, MAX_DRAFT, Pace, PromptLookup, VerifyCost

# ---------------------------------------------------------------------------- drafts


def test_prompt_lookup_proposes_what_followed_the_latest_repeat() -> None:
    drafter = PromptLookup(max_ngram=3, min_ngram=2).drafter()
    history = [5, 6, 7, 8, 9, 1, 2, 5, 6, 7, 3, 4, 5, 6]
    # "5 6" last appeared at 7..8, followed by 7 3 4 5 6
    assert drafter.propose(history, 3) == [7, 3, 4]
    assert drafter.evidence == 2  # "4 5 6" never appeared before
    assert drafter.propose([*history, 7], 2) == [3, 4]  # "5 6 7": the latest one
    assert drafter.evidence == 3
    assert drafter.propose([1, 2, 3, 4], 4) == []  # nothing repeats
    assert drafter.evidence is None
    assert drafter.propose([9, 9], 3) == []  # too short to match min_ngram
    assert drafter.propose(history, 0) == []


def _latest_longest_repeat(history: list[int], k: int, lo: int, hi: int) -> tuple[list[int], int | None]:
    """What follows the latest earlier occurrence of the longest tail of ``history``
    (``lo`` to ``hi`` tokens), found by trying every start."""
    for n in range(min(hi, len(history) - 1), lo - 1, -1):
        tail = history[len(history) - n :]
        for i in range(len(history) - n - 1, -1, -1):
            if history[i : i + n] == tail:
                return history[i + n : i + n + k], n
    return [], None


@pytest.mark.parametrize(("min_ngram", "max_ngram"), [(2, 5), (1, 8), (1, 1), (2, 2), (3, 4)])
def test_prompt_lookup_agrees_with_trying_every_start(
    min_ngram: int, max_ngram: int, rng: np.random.Generator
) -> None:
    for _ in range(300):
        drafter = PromptLookup(max_ngram=max_ngram, min_ngram=min_ngram).drafter()
        history = rng.integers(0, 4, size=int(rng.integers(1, 60))).tolist()
        for _grow in range(3):  # a generation's drafter follows its history as it grows
            want, evidence = _latest_longest_repeat(history, 4, min_ngram, max_ngram)
            assert drafter.propose(history, 4) == want
            assert drafter.evidence == evidence
            history.extend(rng.integers(0, 4, size=int(rng.integers(1, 3))).tolist())


def test_verify_passes_stay_on_decode_kernels() -> None:
    # the sampled token and MAX_DRAFT drafts: rows whose logits are those of plain decoding
    from lmserve_core.native import kernels

    assert 1 + MAX_DRAFT <= kernels.DECODE_MAX_ROWS


def test_pace_follows_the_acceptance_and_pauses_when_drafts_do_not_pay() -> None:
    assert Pace.best(0.95, MAX_DRAFT) == MAX_DRAFT
    assert Pace.best(0.2, MAX_DRAFT) == 0  # a verify row costs more than it brings
    assert 0 < Pace.best(0.6, MAX_DRAFT) < MAX_DRAFT
    pace = Pace()
    assert pace.budget(100) > 0
    assert pace.budget(2) <= 2  # never past what the budget allows
    for _ in range(6):
        k = pace.budget(100)
        pace.update(k, k)
    assert pace.budget(100) == MAX_DRAFT and pace.rate() > 0.9
    while (k := pace.budget(100)) > 0:
        pace.update(k, 0)
    # a short pause: the backend's estimate (this generation's good start) still pays
    assert [pace.budget(100) for _ in range(Pace.SHORT_PAUSE)] == [0] * Pace.SHORT_PAUSE
    assert pace.budget(100) > 0  # tries again after the pause
    assert pace.proposed > 0 and pace.accepted > 0


def test_verify_cost_is_learnt_from_the_passes() -> None:
    cost = VerifyCost()
    for _ in range(20):  # one size only: no line to fit, the prior stands
        cost.observe(3, 0.030)
    assert cost.row == Pace.VERIFY_ROW_COST
    rng = np.random.default_rng(0)
    for _ in range(200):  # a step of 10 ms, each further row 2 ms (+-5% noise)
        rows = int(rng.integers(1, MAX_DRAFT + 2))
        cost.observe(rows, (0.008 + 0.002 * rows) * rng.uniform(0.95, 1.05))
    assert cost.row == pytest.approx(0.2, abs=0.03)
    cost.observe(0, 1.0)
    cost.observe(2, float("nan"))  # ignored
    assert cost.row == pytest.approx(0.2, abs=0.03)
    # cheaper rows pay for more drafts at the same acceptance
    assert Pace(cost).best(0.7, MAX_DRAFT, cost.row) > Pace.best(0.7, MAX_DRAFT)
    learnt = Pace(cost)
    assert learnt.budget(MAX_DRAFT) >= Pace().budget(MAX_DRAFT)


def _passes(cost: VerifyCost, rng: np.random.Generator, n: int, step: float, row: float) -> None:
    for _ in range(n):  # passes of every size, 5% noise
        rows = int(rng.integers(1, MAX_DRAFT + 2))
        cost.observe(rows, (step + step * row * (rows - 1)) * rng.uniform(0.95, 1.05))


def test_a_few_delayed_passes_do_not_stop_the_drafting(rng: np.random.Generator) -> None:
    cost = VerifyCost()
    _passes(cost, rng, 200, 0.004, 0.21)
    assert cost.row == pytest.approx(0.21, abs=0.03)
    # a reply with little to draft: one-row passes, and three verify passes that something
    # else on the machine held up ten times longer than they take
    for i in range(150):
        cost.observe(1, 0.004 * rng.uniform(0.95, 1.05))
        if i in (50, 90, 130):
            cost.observe(3, 0.030)
    assert cost.row == pytest.approx(0.21, abs=0.03)
    pace = Pace(cost)
    assert all(pace.budget(MAX_DRAFT, 8) > 0 for _ in range(50))


def test_after_a_pause_a_draft_is_verified_whatever_the_estimates(rng: np.random.Generator) -> None:
    cost = VerifyCost(calibrated=0.2)  # calibrated at a quiet start-up
    _passes(cost, rng, 100, 0.004, 1.5)  # then a busy machine: a further row costs 1.5 steps
    assert Pace.best(0.8, MAX_DRAFT, cost.row) == 0
    pace = Pace(cost)
    drafted = []
    for _ in range(600):  # the machine is itself again: each further row 0.2 of a step
        k = pace.budget(MAX_DRAFT, 8)
        cost.observe(1 + k, 0.004 * (1 + 0.2 * k) * rng.uniform(0.95, 1.05))
        if k:
            pace.update(k, k, 8)  # the drafts were right
        drafted.append(k)
    # the first chance and the pause after it, then the probe
    assert drafted[: Pace.PAUSE_TOKENS + 2] == [0] * (Pace.PAUSE_TOKENS + 1) + [1]
    assert cost.row == pytest.approx(0.2, abs=0.03)
    assert drafted[-20:] == [MAX_DRAFT] * 20


def test_pace_keeps_an_estimate_for_each_kind_of_evidence() -> None:
    pace = Pace()
    for _ in range(8):  # long matches are right, short ones wrong
        if (k := pace.budget(MAX_DRAFT, 8)) > 0:
            pace.update(k, k, 8)
        if (k := pace.budget(MAX_DRAFT, 2)) > 0:
            pace.update(k, 0, 2)
    assert pace.rate(8) > 0.9 and pace.rate(2) < 0.6
    assert pace.budget(MAX_DRAFT, 8) == MAX_DRAFT
    assert pace.budget(MAX_DRAFT, 2) == 0  # paused for short matches only
    assert pace.budget(MAX_DRAFT, 8) == MAX_DRAFT


def test_a_draft_leaves_the_sampled_distribution_unchanged() -> None:
    probs = np.array([0.4, 0.3, 0.15, 0.1, 0.05])
    logits = np.log(probs).astype(np.float32)
    n = 20000
    for draft in (0, 3, 4):
        for resolved in (
            ResolvedSampling(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, repeat_penalty=1.0,
                             seed=11),
            ResolvedSampling(temperature=0.7, top_p=0.9, top_k=4, min_p=0.0, repeat_penalty=1.0,
                             seed=12),
        ):
            sampler = Sampler(resolved, probs.size)
            counts = collections.Counter(sampler.sample(logits, draft=draft) for _ in range(n))
            want = _chain_probs(probs, resolved)
            chi2 = sum(
                (counts.get(i, 0) - n * p) ** 2 / (n * p) for i, p in enumerate(want) if p > 0
            )
            assert all(counts.get(i, 0) == 0 for i, p in enumerate(want) if p == 0)
            # 4 degrees of freedom at most: p = 0.001 is at 18.5
            assert chi2 < 18.5, (draft, resolved, counts)


def _chain_probs(probs: np.ndarray, r: ResolvedSampling) -> np.ndarray:
    """The distribution sampling draws from (probs sorted descending, as here)."""
    keep = np.arange(probs.size) < (r.top_k if r.top_k else probs.size)
    p = np.where(keep, probs, 0.0)
    if r.top_p < 1.0:
        cum = np.cumsum(p) / p.sum()
        cut = int(np.searchsorted(cum, r.top_p, side="left")) + 1
        p[cut:] = 0.0
    w = np.where(p > 0, p ** (1.0 / r.temperature), 0.0)
    return w / w.sum()


def test_greedy_draft_is_kept_only_when_it_is_the_best() -> None:
    logits = np.array([0.1, 2.0, 1.0], np.float32)
    sampler = Sampler(
        ResolvedSampling(temperature=0.0, top_p=1.0, top_k=0, min_p=0.0, repeat_penalty=1.0), 3
    )
    assert sampler.sample(logits, draft=1) == 1
    assert sampler.sample(logits, draft=2) == 1


# ---------------------------------------------------------------------------- the chat path


class FixedDrafts:
    """A draft source proposing the same tokens every time."""

    name = "fixed"

    def __init__(self, tokens: Sequence[int]) -> None:
        self.tokens = list(tokens)

    def drafter(self) -> Any:
        tokens = self.tokens

        class _Drafter:
            def propose(self, history: Sequence[int], k: int) -> list[int]:
                return tokens[:k]

            def close(self) -> None:
                pass

        return _Drafter()


def spec_backend(gguf: GGUFFile, script: Sequence[int] = (), **kw: Any) -> GGUFChatBackend:
    backend = make_backend(gguf, script, **kw)
    backend.drafts = PromptLookup()
    return backend


def test_greedy_with_drafts_is_byte_identical_and_takes_fewer_passes(gguf: GGUFFile) -> None:
    b0 = make_backend(gguf)
    quoted = "def add(a, b):\n    return a + b\n"
    script = ids(b0, "Here it is:\n" + quoted) + [IM_END]
    request = chat(f"Repeat this code exactly:\n{quoted}", max_tokens=80)
    plain, alone = run(make_backend(gguf, script), request)
    backend = spec_backend(gguf, script)
    finish, sink = run(backend, chat(f"Repeat this code exactly:\n{quoted}", max_tokens=80))
    assert sink.text == alone.text and finish == plain
    calls = backend.model.forward_calls  # type: ignore[attr-defined]
    verified = [n for _, n in calls[1:] if n > 1]
    assert verified, "the quoted code was drafted"
    assert len(calls) < plain.usage.completion_tokens  # fewer passes than tokens
    assert backend.verify_cost.passes == len(calls) - 1  # every pass after the prompt
    check_shadow(backend)


def test_noise_greedy_with_wrong_drafts_is_unchanged(gguf: GGUFFile) -> None:
    # the model's replies are position-seeded noise: every draft is wrong
    request = chat("word " * 30, max_tokens=40)
    plain, alone = run(make_backend(gguf), request)
    backend = make_backend(gguf)
    backend.drafts = FixedDrafts([11, 12, 13])  # type: ignore[assignment]
    finish, sink = run(backend, chat("word " * 30, max_tokens=40))
    assert sink.text == alone.text and finish == plain
    check_shadow(backend)


def test_stop_strings_and_grammar_apply_to_accepted_tokens(gguf: GGUFFile) -> None:
    pytest.importorskip("llguidance")
    b0 = make_backend(gguf)
    reply = "alpha beta gamma delta epsilon"
    script = ids(b0, reply) + [IM_END]
    drafts = ids(b0, reply)[1:]
    for kwargs in (
        {"stop": [" gamma"]},
        {"constraint": Constraint(kind="regex", source="alpha beta( gamma)?")},
    ):
        plain, alone = run(make_backend(gguf, script), chat("go", max_tokens=20, **kwargs))
        backend = make_backend(gguf, script)
        backend.drafts = FixedDrafts(drafts)  # type: ignore[assignment]
        finish, sink = run(backend, chat("go", max_tokens=20, **kwargs))
        assert sink.text == alone.text and finish == plain
        assert sink.text in ("alpha beta", "alpha beta gamma")
        check_shadow(backend)


def test_tokens_a_grammar_forces_are_drafted(gguf: GGUFFile) -> None:
    """Under a JSON schema the keys and punctuation are the only tokens allowed: they are
    verified as drafts even when the drafter has nothing, and the reply is that of plain
    decoding."""
    pytest.importorskip("llguidance")
    import json

    b0 = make_backend(gguf)
    reply = '{"name": "Ada", "age": 36, "email": "ada@example.com"}'
    script = ids(b0, reply) + [IM_END]

    def request() -> NormalizedRequest:
        return chat("who?", max_tokens=60,
                    constraint=Constraint(kind="json_schema", source=json.dumps(PERSON_SCHEMA)))

    plain, alone = run(make_backend(gguf, script), request())
    assert json.loads(alone.text) == json.loads(reply)
    backend = make_backend(gguf, script)
    backend.drafts = FixedDrafts([])  # type: ignore[assignment]
    paces: list[Pace] = []
    original = backend.speculation.speculate

    def spy(gen: Any, tokens: list[int]) -> None:
        paces.append(gen.pace)
        original(gen, tokens)

    backend.speculation.speculate = spy  # type: ignore[method-assign]
    finish, sink = run(backend, request())
    assert sink.text == alone.text and finish == plain
    calls = backend.model.forward_calls  # type: ignore[attr-defined]
    assert any(n > 1 for _, n in calls[1:]), "the forced tokens were drafted"
    assert len(calls) < plain.usage.completion_tokens
    pace = paces[-1]
    assert pace.accepted > 0 and pace.rate(FORCED) > 0.8
    check_shadow(backend)


def test_a_free_drafter_proposes_in_full_and_the_pace_trims_by_its_evidence(
    gguf: GGUFFile,
) -> None:
    b0 = make_backend(gguf)
    script = ids(b0, "one two three four five six seven eight nine ten eleven") + [IM_END]
    asked: list[int] = []
    verified: list[int] = []

    class Free:
        name = "free"

        def drafter(self) -> Any:
            class _Drafter:
                free = True
                evidence = 5

                def propose(self, history: Sequence[int], k: int) -> list[int]:
                    asked.append(k)
                    # the rest of the script after the part of it that ends the history
                    for j in range(min(len(script), len(history)), 0, -1):
                        if list(history[-j:]) == script[:j]:
                            return script[j : j + k]
                    return []

                def close(self) -> None:
                    pass

            return _Drafter()

    backend = make_backend(gguf, script)
    backend.drafts = Free()  # type: ignore[assignment]
    original = backend.speculation.speculate

    def spy(gen: Any, tokens: list[int]) -> None:
        before = len(gen.kv.tokens)
        original(gen, tokens)
        verified.append(len(gen.kv.tokens) - before)

    backend.speculation.speculate = spy  # type: ignore[method-assign]
    finish, sink = run(backend, chat("count", max_tokens=40))
    plain, alone = run(make_backend(gguf, script), chat("count", max_tokens=40))
    assert sink.text == alone.text and finish == plain
    assert asked and max(asked) == MAX_DRAFT  # asked for the most it may verify
    assert max(verified) > 1  # and the drafts were taken
    check_shadow(backend)


def test_max_tokens_bounds_the_drafts(gguf: GGUFFile) -> None:
    b0 = make_backend(gguf)
    script = ids(b0, "one two three four five six seven eight") + [IM_END]
    backend = make_backend(gguf, script)
    backend.drafts = FixedDrafts(script[1:])  # type: ignore[assignment]
    finish, sink = run(backend, chat("count", max_tokens=5))
    assert finish.reason == "length" and finish.usage.completion_tokens == 5
    plain, alone = run(make_backend(gguf, script), chat("count", max_tokens=5))
    assert sink.text == alone.text
    check_shadow(backend)


class MarkovModel(ScriptedModel):
    """A small-vocabulary model: after the prompt, the next token is one of four, with
    probabilities that depend on the previous token."""

    def __init__(self, n_vocab: int, words: Sequence[int], prompt_len: int) -> None:
        super().__init__(n_vocab)
        self.words = list(words)
        self.prompt_len = prompt_len
        rng = np.random.default_rng(5)
        self.table = {w: rng.dirichlet(np.ones(len(words)) * 0.8) for w in [-1, *words]}

    def logits(self, seq: np.ndarray) -> np.ndarray:
        prev = int(seq[-1]) if len(seq) > self.prompt_len else -1
        probs = self.table.get(prev, self.table[-1])
        out = np.full(self.n_vocab, -1e9, np.float32)
        out[self.words] = np.log(probs)
        return out


def test_sampled_sequences_keep_their_distribution_with_drafts(gguf: GGUFFile) -> None:
    b0 = make_backend(gguf)
    words = [ids(b0, w)[0] for w in (" red", " green", " blue", " gold")]
    request0 = chat("colours")
    b0.validate(request0)
    prompt_len = request0.prompt_tokens
    assert prompt_len is not None

    def sequences(drafts: Any, seed0: int, n: int) -> collections.Counter:
        model = MarkovModel(49152, words, prompt_len)
        backend = make_backend(gguf, model=model)
        backend.drafts = drafts
        out: collections.Counter = collections.Counter()
        for i in range(n):
            request = NormalizedRequest(
                id=f"s{i}", dialect="chat", messages=[Message(role="user", content="colours")],
                sampling=Sampling(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, seed=seed0 + i),
                max_tokens=3,
            )
            sink = ListSink()
            backend.validate(request)
            backend.generate(request, sink)
            out[sink.text] += 1
        return out

    n = 1500
    plain = sequences(None, 0, n)
    drafted = sequences(FixedDrafts([words[0], words[1], words[0]]), 10_000, n)
    # the exact distribution of 3-token replies
    model = MarkovModel(49152, words, prompt_len)
    exact: dict[str, float] = {}
    for a in words:
        for b in words:
            for c in words:
                p = (model.table[-1][words.index(a)] * model.table[a][words.index(b)]
                     * model.table[b][words.index(c)])
                exact[b0.detokenize([a, b, c])] = p
    for counts in (plain, drafted):
        assert sum(counts.values()) == n
        expected = {k: n * p for k, p in exact.items()}
        # pool rare outcomes so every cell expects at least 5
        common = [k for k, e in expected.items() if e >= 5]
        rest_e = sum(e for k, e in expected.items() if k not in common)
        rest_o = sum(v for k, v in counts.items() if k not in common)
        chi2 = sum((counts.get(k, 0) - expected[k]) ** 2 / expected[k] for k in common)
        dof = len(common)
        if rest_e > 0:
            chi2 += (rest_o - rest_e) ** 2 / rest_e
        # p = 0.001 of a chi-square with dof degrees of freedom, by Wilson-Hilferty
        z = 3.09
        bound = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
        assert chi2 < bound, (chi2, bound)


def _flagged(gguf: GGUFFile, model: ScriptedModel, **spec: Any) -> GGUFChatBackend:
    """A backend given speculation settings, as the command line's flags give them."""
    return GGUFChatBackend(
        name="fake", gguf=gguf, model=model,  # type: ignore[arg-type]
        conventions=make_backend(gguf).conventions,
        settings=ServerSettings(ctx=512, speculation=SpeculationSettings(**spec)),
    )


def test_spec_flag_reaches_the_backend(gguf: GGUFFile) -> None:
    model = ScriptedModel(49152)
    backend = _flagged(gguf, model, prompt_lookup=True)
    assert isinstance(backend.drafts, PromptLookup)
    # the verify cost is calibrated at start-up, on a cache of its own
    cost = backend.verify_cost
    assert cost.calibrated is not None
    assert VerifyCost.ROW_MIN <= cost.calibrated <= VerifyCost.ROW_MAX
    assert not any(slot.allocated for slot in backend.slots.slots)
    assert make_backend(gguf).verify_cost.calibrated is None  # no drafts: no calibration
    with pytest.raises(ValueError, match="vocabulary|serves|No such file|not a"):
        _flagged(gguf, model, draft="/nonexistent.gguf")

    class Broken(ScriptedModel):
        def forward(self, *args: Any, **kw: Any) -> np.ndarray:
            raise RuntimeError("no")

    # a model the calibration fails on still serves, its verify cost from the live passes
    assert _flagged(gguf, Broken(49152), prompt_lookup=True).verify_cost.calibrated is None


def test_logit_bias_holds_under_speculation_and_grammars(gguf: GGUFFile) -> None:
    """A request's logit bias moves greedy output; drafts are verified against the biased
    logits, so speculation changes nothing; a grammar still has its way with a banned token."""
    from lmserve_core.errors import InvalidRequest

    b0 = make_backend(gguf)
    reply = "alpha beta gamma delta"
    script = ids(b0, reply) + [IM_END]
    swap = ids(b0, " omega")[0]
    bias = {script[1]: -100.0, swap: 1.0}  # ban " beta", favour " omega" a little
    biased = Sampling(temperature=0.0, logit_bias=bias)
    _, unbiased = run(make_backend(gguf, script), chat("go", max_tokens=20))
    plain, alone = run(make_backend(gguf, script), chat("go", max_tokens=20, sampling=biased))
    assert unbiased.text == reply and alone.text == "alpha omega gamma delta"
    for drafts in (script[1:], ids(b0, alone.text)[1:]):  # the unbiased reply, the biased one
        backend = make_backend(gguf, script)
        backend.drafts = FixedDrafts(drafts)  # type: ignore[assignment]
        finish, sink = run(backend, chat("go", max_tokens=20, sampling=biased))
        assert sink.text == alone.text and finish == plain
        check_shadow(backend)
    # a grammar that needs the banned text gets it (spelled in tokens the bias leaves alone)
    pytest.importorskip("llguidance")
    regex = Constraint(kind="regex", source="alpha beta( gamma)?")
    _, sink = run(make_backend(gguf, script), chat("go", max_tokens=20, sampling=biased,
                                                   constraint=regex))
    assert sink.text in ("alpha beta", "alpha beta gamma")
    # ids outside the vocabulary are refused before generation, naming the field
    with pytest.raises(InvalidRequest) as info:
        b0.validate(chat("go", sampling=Sampling(logit_bias={49152: 1.0})))
    assert info.value.param == "logit_bias" and "49152" in info.value.message
