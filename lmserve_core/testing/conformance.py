"""The family conformance suite: what every model family must show, run by each plugin on
its own models.

A plugin's test module subclasses :class:`FamilyConformance` and supplies two fixtures,
``kind`` (parametrized over its architectures) and ``subject`` (a :class:`Subject` of one
kind and tensor type); pytest then runs every ``test_*`` method below on each kind::

    class TestQwen35(FamilyConformance):
        @pytest.fixture(params=["qwen35", "qwen35moe"])
        def kind(self, request): return request.param

        @pytest.fixture
        def subject(self, kind, synthetic): return SUBJECTS(synthetic, kind)

The checks: logits against transformers in float32 (f32 and f16 KV caches, the reference
rounded where the f16 cache rounds), each tensor type against its own decoded weights,
greedy continuations equal to transformers', prefill equal to token-by-token decode, a batch
equal to each sequence alone, a cache resumed from a reused prefix equal to a cold one, a
recurrent cache's checkpoints equal to caches that read only their prefixes (and kept in one
pass where the layers can), a cache restored from its snapshot (the disk tier's bytes) equal
to a cold one, a KV prefix of the model's own rows equal to its tokens read first (or
refused where rows cannot stand for tokens), and through the served backend: speculative
decoding's greedy replies equal to plain decoding's, a second request resuming from the
first's cache equal to a cold one, concurrent requests with ``n`` choices and logprobs equal
to each alone, and a conversation restored from the disk tier by a new server equal to a
cold one.

The checks come in three parts, :class:`NumericsConformance` (against transformers),
:class:`CacheConformance` (our own paths against each other: no reference model needed) and
:class:`ServedConformance` (real servers), and :class:`FamilyConformance` is all three. A
family whose model does not fit one part (a block-diffusion model is not decoded token by
token) subclasses the parts that apply and says why in its test module.

torch, transformers and pytest are imported by the tests that use them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from lmserve_core.testing.numerics import (
    check_batched_decode,
    greedy,
    reference_greedy,
    stepped_logits,
)

__all__ = [
    "CacheConformance",
    "FamilyConformance",
    "NumericsConformance",
    "ServedConformance",
    "Subject",
    "check_routing",
    "synthetic_subjects",
]


@dataclass
class Subject:
    """One synthetic model of a family: ours on the GGUF, transformers on its weights.

    ``load(kv_type, n_batch)`` builds our model; ``hf`` is the transformers model holding
    exactly the GGUF's weights (float32, eval); ``rounding(kv)`` is a context in which the
    reference computes as a cache of type ``kv`` stores (a null context for f32);
    ``create_backend(path, settings)`` the family's backend factory.
    """

    path: str
    load: Callable[..., Any]
    hf: Any
    tokenizer: Any
    rounding: Callable[[str], Any] = field(default=lambda kv: contextlib.nullcontext())
    create_backend: Callable[..., Any] | None = None
    of_type: Callable[[str], Subject] | None = None  # the same model in another tensor type
    _models: dict[tuple[str, int], Any] = field(default_factory=dict)

    def model(self, kv: str = "f16", n_batch: int = 256) -> Any:
        key = (kv, n_batch)
        if key not in self._models:
            self._models[key] = self.load(kv_type=kv, n_batch=n_batch)
        return self._models[key]

    def ids(self, prompt: str) -> list[int]:
        return list(self.tokenizer.encode(prompt, add_special=True, parse_special=True))

    def theirs(self, ids: Sequence[int], kv: str = "f16") -> np.ndarray:
        import torch

        with torch.no_grad(), self.rounding(kv):
            return self.hf(torch.tensor([list(ids)])).logits[0].float().numpy()

    def mine(self, ids: Sequence[int], kv: str = "f16") -> np.ndarray:
        model = self.model(kv)
        return model.forward(model.new_cache(len(ids) + 8), list(ids), 0, all_logits=True)


def synthetic_subjects(
    load: Callable[..., Any],
    create_backend: Callable[..., Any],
    half_precision_kv: Callable[[str, Any], Any],
    *,
    prepare_hf: Callable[[Any], None] = lambda hf: None,
) -> Callable[..., Subject]:
    """``subject(synthetic, kind, type="f32")``: the synthetic model ``synthetic(kind=kind,
    type=type)`` (``synthetic`` the family's fixture) as a :class:`Subject`, loaded once per
    session. ``load(kind, gguf, kv_type=, n_batch=)`` builds our model on the opened file;
    ``half_precision_kv(kind, hf)`` is the reference's context for an f16 cache;
    ``prepare_hf(hf)`` adjusts the loaded transformers model."""
    from lmserve_core.gguf_file import GGUFFile
    from lmserve_core.tokenizer import Tokenizer

    subjects: dict[tuple[str, str], Subject] = {}

    def subject(synthetic: Callable[..., Any], kind: str, type: str = "f32") -> Subject:
        key = (kind, type)
        if key not in subjects:
            model = synthetic(kind=kind, type=type)
            path, _ = model
            gguf = GGUFFile.open(path)
            hf = model.load_hf()
            prepare_hf(hf)

            def rounding(kv: str) -> Any:
                return half_precision_kv(kind, hf) if kv == "f16" else contextlib.nullcontext()

            subjects[key] = Subject(
                path=str(path),
                load=lambda kv_type="f16", n_batch=256: load(
                    kind, gguf, kv_type=kv_type, n_batch=n_batch
                ),
                hf=hf,
                tokenizer=Tokenizer.from_gguf(gguf),
                rounding=rounding,
                create_backend=create_backend,
                of_type=lambda t: subject(synthetic, kind, t),
            )
        return subjects[key]

    return subject


def check_routing(
    subject: Subject, gates: Sequence[Any], ids: Sequence[int], *, atol: float
) -> Any:
    """Our experts and their weights for every layer and token equal those transformers'
    routers ``gates`` (one a layer; each returns ``(logits, weights, chosen)``) pick on the
    same prompt, f32 KV; returns our routing."""
    routed: list[tuple[np.ndarray, np.ndarray]] = []

    def record(_module: Any, _inputs: Any, output: Any) -> None:
        _, weights, chosen = output
        routed.append((chosen.numpy(), weights.float().numpy()))

    hooks = [gate.register_forward_hook(record) for gate in gates]
    try:
        subject.theirs(ids, "f32")
    finally:
        for hook in hooks:
            hook.remove()
    model = subject.model("f32")
    _, routing = model.forward_traced(model.new_cache(len(ids)), list(ids), 0)
    c = model.config
    assert routing.ids.shape == (c.n_layer, len(ids), c.n_expert_used)
    assert len(routed) == c.n_layer
    for layer, (chosen, weights) in enumerate(routed):
        # the same experts (as sets: torch.topk may order equal weights either way)
        assert (np.sort(routing.ids[layer], axis=1) == np.sort(chosen, axis=1)).all(), layer
        ours = np.take_along_axis(routing.weights[layer], np.argsort(routing.ids[layer]), 1)
        theirs = np.take_along_axis(weights, np.argsort(chosen, axis=1), axis=1)
        np.testing.assert_allclose(ours, theirs, rtol=0, atol=atol)
    print(f"routing: {c.n_layer} layers x {len(ids)} tokens x top-{c.n_expert_used} identical")
    return routing


class _Settings:
    """The bounds and prompts every part of the suite shares (a family overrides them)."""

    # max |ours - reference| of the logits, per KV cache type: a family sets its own bounds
    # (measured, with a margin) when its logits spread wider than the synthetic defaults
    LOGIT_ATOL: ClassVar[dict[str, float]] = {"f32": 1e-3, "f16": 5e-3}
    # the same computation cut into other pieces (chunks, resumed caches)
    PATH_ATOL: ClassVar[float] = 1e-3
    # the tensor types each kind is also checked in, against its own decoded weights
    TYPES: ClassVar[tuple[str, ...]] = ("f16", "q8_0")
    PROMPTS: ClassVar[tuple[str, ...]] = (
        "<|im_start|>user\nWhat is the capital of France? Answer in one word.<|im_end|>\n"
        "<|im_start|>assistant\n",
        "def fibonacci(n: int) -> list[int]:\n    out = [0, 1]\n    while len(out) < n:\n",
        "The history of the bicycle begins in the early nineteenth century, when inventors",
    )
    GREEDY_TOKENS: ClassVar[int] = 24
    # the batch (chunk) of the resumed-cache check: small, so a prompt is read in chunks
    RESUME_BATCH: ClassVar[int] = 16


class NumericsConformance(_Settings):
    """Logits, tensor types and greedy continuations against transformers."""

    def test_logits_match_transformers(self, subject: Subject) -> None:
        for kv in ("f32", "f16"):
            worst = 0.0
            for prompt in self.PROMPTS:
                ids = subject.ids(prompt)
                got, want = subject.mine(ids, kv), subject.theirs(ids, kv)
                assert got.shape == want.shape
                worst = max(worst, float(np.abs(got - want).max()))
                assert (got.argmax(axis=1) == want.argmax(axis=1)).all(), (kv, prompt)
            print(f"{kv} KV: max |diff| {worst:.3g}")
            assert worst <= self.LOGIT_ATOL[kv], kv

    def test_tensor_types_match_their_decoded_weights(self, subject: Subject) -> None:
        # the reference holds each file's decoded weights: only the kernels' decoding and
        # arithmetic are compared
        assert subject.of_type is not None, "the subject cannot load other tensor types"
        for type_name in self.TYPES:
            other = subject.of_type(type_name)
            ids = other.ids(self.PROMPTS[0] + self.PROMPTS[2])
            diff = float(np.abs(other.mine(ids, "f32") - other.theirs(ids, "f32")).max())
            print(f"{type_name}: max |diff| {diff:.3g}")
            assert diff <= self.LOGIT_ATOL["f16"], type_name

    def test_greedy_continuations_match_transformers(self, subject: Subject) -> None:
        for kv in ("f32", "f16"):
            for prompt in self.PROMPTS:
                ids = subject.ids(prompt)
                with subject.rounding(kv):
                    want = reference_greedy(subject.hf, ids, self.GREEDY_TOKENS, exact=True)
                got = greedy(subject.model(kv), ids, self.GREEDY_TOKENS)
                if got == want:
                    continue
                # only a near tie may flip a choice: at the first divergence the reference's
                # two candidates lie within the logits' bound of each other
                k = next(i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b)
                ref = subject.theirs(ids + want[:k], kv)[-1]
                gap = abs(float(ref[want[k]]) - float(ref[got[k]]))
                print(f"{kv}: diverges at {k} ({got[k]} against {want[k]}), gap {gap:.3g}")
                assert gap <= 2 * self.LOGIT_ATOL[kv], (kv, prompt)



class CacheConformance(_Settings):
    """Prefill, batches, resumed and restored caches against a cold pass of our own."""

    def test_prefill_equals_token_by_token_decode(self, subject: Subject) -> None:
        # f32 KV: a prompt's pass attends over the rows it computed, decode over stored ones
        ids = subject.ids(self.PROMPTS[0])
        stepped = stepped_logits(subject.model("f32"), ids)
        diff = float(np.abs(subject.mine(ids, "f32") - stepped).max())
        assert diff <= self.PATH_ATOL

    def test_batched_decode_equals_each_sequence_alone(self, subject: Subject) -> None:
        check_batched_decode(subject.model(), [subject.ids(p) for p in self.PROMPTS])

    def test_resumed_cache_equals_cold(self, subject: Subject) -> None:
        # a prompt read in several chunks; its cache cut back to what it can reuse of a
        # shorter common prefix; the rest read again, also into a copy of that prefix
        model = subject.model("f32", n_batch=self.RESUME_BATCH)
        ids = subject.ids(self.PROMPTS[0] + self.PROMPTS[1])
        n = len(ids)
        cold = model.forward(model.new_cache(n), ids, 0, all_logits=True)
        cache = model.new_cache(n)
        plan = getattr(cache, "plan", None)
        if plan is not None:
            plan(n)  # a recurrent cache keeps checkpoints where it is told to
        model.forward(cache, ids, 0)
        m = cache.reusable_prefix(n, n - 2)
        assert 0 < m <= n - 2
        copy = model.new_cache(n)
        model.copy_rows(cache, copy, m)
        cache.truncate(m)
        for c in (cache, copy):
            warm = model.forward(c, ids[m:], m, all_logits=True)
            assert np.abs(warm - cold[m:]).max() <= self.PATH_ATOL

    def test_checkpoints_inside_a_chunk_are_kept_in_the_same_pass(
        self, subject: Subject, monkeypatch: Any
    ) -> None:
        # a recurrent cache's planned checkpoints hold the states of a cache that read only
        # the prefix (to float32 summation order: other token counts, other tiles); a model
        # whose layers keep them as the pass goes by (checkpoints_in_pass) reads the prompt
        # in one pass, or two past the most one pass keeps, and the others stop at each
        from lmserve_core.kit.forward import MAX_CHECKPOINTS
        from lmserve_core.native import kernels

        model = subject.model()
        ids = subject.ids(self.PROMPTS[0] + self.PROMPTS[1])
        n = len(ids)
        if getattr(model.new_cache(n), "plan", None) is None:
            return  # no recurrent state: every position's rows are kept anyway
        # the C driver reads a long call in chunks of n_batch: checkpoints on their seams
        chunked = subject.model(n_batch=8)
        most = int(kernels.lib.LM_MAX_SNAPSHOTS)
        shared_many = tuple(range(2, 2 + 2 * (most + 1), 2))
        assert n > shared_many[-1] + 4
        passes: list[int] = []
        run = kernels.forward

        def counted(core: Any, cache: Any, tokens: Any, *args: Any, **kwargs: Any) -> Any:
            passes.append(len(tokens))
            return run(core, cache, tokens, *args, **kwargs)

        monkeypatch.setattr(kernels, "forward", counted)
        in_pass = bool(getattr(type(model), "checkpoints_in_pass", False))
        for reader, shared in ((model, (7, 12)), (model, shared_many), (chunked, (8, 13, 16))):
            passes.clear()
            cache = reader.new_cache(n)
            cache.plan(n, shared)
            reader.forward(cache, ids, 0)
            assert sum(passes) == n
            if in_pass:
                assert len(passes) == (1 if len(shared) + 2 <= most else 2)
            assert cache.pos == n
            assert len(cache.checkpoints) == min(MAX_CHECKPOINTS, len(shared) + 2)
            if len(shared) + 2 <= MAX_CHECKPOINTS:  # else the ordinary ones gave way
                assert {n - 4, n - 1} <= cache.checkpoints.keys()
            for p, state in cache.checkpoints.items():
                alone = model.new_cache(n)
                model.forward(alone, ids[:p], 0)
                want = alone.native.recurrent_state().view(np.float32)
                got = state.view(np.float32)
                bound = 1e-4 * max(1.0, float(np.abs(want).max()))
                assert np.abs(got - want).max() <= bound, (shared, p)

    def test_snapshot_restored_equals_cold(self, subject: Subject) -> None:
        model = subject.model("f32")
        ids = subject.ids(self.PROMPTS[1] + self.PROMPTS[2])
        n = len(ids)
        cold = model.forward(model.new_cache(n + 4), ids + ids[:4], 0, all_logits=True)[n:]
        cache = model.new_cache(n + 4)
        model.forward(cache, ids, 0)
        restored = model.new_cache(n + 4)
        restored.restore(n, cache.snapshot(n))
        warm = model.forward(restored, ids[:4], n, all_logits=True)
        # bit for bit what the cache itself gives next; the cold pass reads the rows in
        # another cut (one chunk), so float32 summation order only
        np.testing.assert_array_equal(warm, model.forward(cache, ids[:4], n, all_logits=True))
        assert np.abs(warm - cold).max() <= self.PATH_ATOL

    def test_prefix_rows_equal_their_tokens_read_first(self, subject: Subject) -> None:
        # a cartridge of the model's own rows for a document (the prefill init) stands for
        # the document: what follows reads bit for bit as after the document's tokens read
        # in the same chunk; a model whose rows cannot stand alone refuses one
        from lmserve_core.cartridge import Cartridge, CartridgeError
        from lmserve_core.cartridge.prefill import capture_rows
        from lmserve_core.cartridge.serve import PrefixedModel, PrefixRows, cartridge_geometry

        model = subject.model("f16")
        if not getattr(type(model), "serves_prefix_rows", False):
            with contextlib.suppress(CartridgeError):
                cartridge_geometry(model)
                raise AssertionError("a model without plain rows took a cartridge")
            return
        doc = subject.ids(self.PROMPTS[2])
        rest = list(subject.tokenizer.encode(self.PROMPTS[1], add_special=False))
        k, v = capture_rows(model, doc)
        served = PrefixedModel(model, PrefixRows(Cartridge(k=k, v=v)))
        got = served.forward(served.new_cache(len(rest)), rest, 0, all_logits=True)
        plain = model.new_cache(len(doc) + len(rest))
        model.forward(plain, doc, 0)
        np.testing.assert_array_equal(got, model.forward(plain, rest, len(doc), all_logits=True))


class ServedConformance(_Settings):
    """Real servers: speculative decoding, reuse, batched choices, the disk tier."""

    def test_speculative_and_reused_replies_equal_plain(self, subject: Subject) -> None:
        if subject.create_backend is None:
            import pytest

            pytest.skip("the subject has no backend factory")
        prompts = [
            "Repeat exactly: alpha beta gamma delta alpha beta gamma delta alpha beta",
            "Count from one to ten in words.",
        ]
        plain = self._replies(subject, prompts, spec=False)
        spec = self._replies(subject, prompts, spec=True)
        assert spec == plain
        # a draft model (the model drafting for itself) takes the same path
        assert self._replies(subject, prompts, spec=True, draft=True) == plain
        # the second round reused what the first left (every slot holds a conversation)
        assert all(cached > 0 for _, cached in spec[len(prompts) :])

    def test_batched_choices_and_logprobs_equal_alone(self, subject: Subject) -> None:
        # concurrent requests decode in one batch; n choices share their prompt's rows; the
        # greedy text and logprobs are what each request gets alone
        import concurrent.futures

        if subject.create_backend is None:
            import pytest

            pytest.skip("the subject has no backend factory")
        prompts = ["Name a color.", "Count from one to ten in words.", "Say hello."]
        alone = [self._ask(subject, [p], batch=1)[0] for p in prompts]
        with (
            self._client(subject, batch=4) as client,
            concurrent.futures.ThreadPoolExecutor(len(prompts)) as pool,
        ):
            together = list(pool.map(lambda p: self._post(client, p, n=2, logprobs=True), prompts))
        for one, both in zip(alone, together, strict=True):
            choices = both["choices"]
            assert len(choices) == 2
            want = one["choices"][0]["logprobs"]["content"]
            for choice in choices:
                got = choice["logprobs"]["content"]
                # the same tokens, or the same up to a near tie of the lone request's two best
                # (the prompt was read in other slices into the f16 cache: summation order and
                # the half-precision rounding boundaries it flips)
                pairs = enumerate(zip(got, want, strict=False))
                n = next((i for i, (a, b) in pairs if a["token"] != b["token"]), None)
                if n is None:
                    assert len(got) == len(want)
                    n = len(got)
                else:
                    best = [t["logprob"] for t in want[n]["top_logprobs"][:2]]
                    assert best[0] - best[1] <= 2 * self.LOGIT_ATOL["f16"], n
                np.testing.assert_allclose(
                    [t["logprob"] for t in got[:n]],
                    [t["logprob"] for t in want[:n]],
                    atol=self.LOGIT_ATOL["f16"],
                )

    def test_disk_tier_restores_across_a_restart(self, subject: Subject, tmp_path: Any) -> None:
        if subject.create_backend is None:
            import pytest

            pytest.skip("the subject has no backend factory")
        prompt = self.PROMPTS[2] + " " + self.PROMPTS[1]
        cold = self._ask(subject, [prompt], batch=1)[0]
        first = self._ask(subject, [prompt], batch=1, disk=tmp_path)[0]  # stored at the stop
        warm = self._ask(subject, [prompt], batch=1, disk=tmp_path)[0]  # a new server
        assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        text = [r["choices"][0]["message"]["content"] for r in (cold, first, warm)]
        assert text[0] == text[1] == text[2]

    def _replies(
        self, subject: Subject, prompts: Sequence[str], *, spec: bool, draft: bool = False
    ) -> list[tuple[str, int]]:
        out = self._ask(subject, [*prompts, *prompts], batch=1, spec=spec, draft=draft)
        return [
            (
                r["choices"][0]["message"]["content"] or "",
                r["usage"]["prompt_tokens_details"]["cached_tokens"],
            )
            for r in out
        ]

    def _client(
        self,
        subject: Subject,
        *,
        batch: int,
        spec: bool = False,
        draft: bool = False,
        disk: Any = None,
    ) -> Any:
        from lmserve_core.backend import ServerSettings
        from lmserve_core.settings import DiskSettings, SpeculationSettings
        from lmserve_core.testing.serving import serve

        settings = ServerSettings(
            ctx=1024, threads=2, kv_slots=4, batch=batch,
            speculation=SpeculationSettings(prompt_lookup=spec, draft=subject.path if draft else None),
            disk=DiskSettings(directory=None if disk is None else str(disk)),
        )
        assert subject.create_backend is not None
        return serve(subject.create_backend(subject.path, settings), settings)

    def _ask(
        self,
        subject: Subject,
        prompts: Sequence[str],
        *,
        batch: int,
        spec: bool = False,
        draft: bool = False,
        disk: Any = None,
    ) -> list[dict[str, Any]]:
        with self._client(subject, batch=batch, spec=spec, draft=draft, disk=disk) as client:
            return [self._post(client, p, logprobs=True) for p in prompts]

    @staticmethod
    def _post(client: Any, prompt: str, *, n: int = 1, logprobs: bool = False) -> dict[str, Any]:
        body = {
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": 24,
            "temperature": 0,
            "n": n,
            "logprobs": logprobs,
            "top_logprobs": 2 if logprobs else None,
            "chat_template_kwargs": {"enable_thinking": False},
        }
        r = client.post("/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        data: dict[str, Any] = r.json()
        return data


class FamilyConformance(NumericsConformance, CacheConformance, ServedConformance):
    """The checks every family passes; see the module's docstring."""
