"""A GGUF's general.sampling.* keys replace the family's recommended sampling."""

from __future__ import annotations

from types import SimpleNamespace

from lmserve_core.backend import SamplingDefaults
from lmserve_core.gguf_chat import file_sampling
from lmserve_core.model import FamilyConventions

FAMILY = FamilyConventions(
    sampling=SamplingDefaults(temperature=0.7, top_k=20, top_p=0.8, min_p=0.0),
    thinking_sampling=SamplingDefaults(temperature=0.6, top_k=20, top_p=0.95, min_p=0.0),
)


def gguf(**meta: object) -> object:
    return SimpleNamespace(metadata={f"general.sampling.{k}": v for k, v in meta.items()})


def test_file_values_replace_the_family_defaults_thinking_or_not() -> None:
    got = file_sampling(gguf(temp=1.0, top_k=40, top_p=0.9, min_p=0.05, penalty_repeat=1.1),
                        FAMILY)
    want = SamplingDefaults(temperature=1.0, top_k=40, top_p=0.9, min_p=0.05, repeat_penalty=1.1)
    assert got.sampling == want
    assert got.thinking_sampling == want


def test_keys_the_file_leaves_out_keep_the_family_values() -> None:
    got = file_sampling(gguf(temp=1.0), FAMILY)
    assert got.sampling == SamplingDefaults(temperature=1.0, top_k=20, top_p=0.8, min_p=0.0)
    assert got.thinking_sampling is not None and got.thinking_sampling.top_p == 0.95


def test_absurd_values_are_ignored() -> None:
    bad = gguf(temp=-1.0, top_k=2.5, top_p=3.0, min_p=-0.1, penalty_repeat="x")
    assert file_sampling(bad, FAMILY) is FAMILY
    assert file_sampling(gguf(top_k=True), FAMILY) is FAMILY
    assert file_sampling(gguf(temp=float("nan")), FAMILY) is FAMILY


def test_a_file_without_the_keys_keeps_the_family_conventions() -> None:
    assert file_sampling(gguf(), FAMILY) is FAMILY
