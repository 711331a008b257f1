"""Chat templates: HF-compatible rendering, the fallbacks, the sandbox and its budgets."""

from __future__ import annotations

import json
import time

import pytest
from models import gemma3_path, smollm2_path
from templates import GEMMA_TEMPLATE

from lmserve_core.chat_template import (
    CHATML_TEMPLATE,
    ChatTemplate,
    ChatTemplateError,
    message_dicts,
    tool_dicts,
)
from lmserve_core.errors import InvalidRequest
from lmserve_core.gguf_file import GGUFFile
from lmserve_core.request import Message, Tool, ToolCall
from lmserve_core.tokenizer import Tokenizer

SYSTEM_USER = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Hi"},
]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
TOOL_CONVERSATION = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]


@pytest.fixture(scope="module")
def smollm2() -> tuple[GGUFFile, Tokenizer]:
    gf = GGUFFile.open(smollm2_path())
    return gf, Tokenizer.from_gguf(gf)


@pytest.fixture(scope="module")
def gemma3() -> tuple[GGUFFile, Tokenizer]:
    gf = GGUFFile.open(gemma3_path())
    return gf, Tokenizer.from_gguf(gf)


# -- real templates ----------------------------------------------------------------------------


def test_smollm2_template(smollm2: tuple[GGUFFile, Tokenizer]) -> None:
    template = ChatTemplate.from_gguf(*smollm2)
    assert template.render(SYSTEM_USER) == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    # Without a system turn the template supplies its own; no generation prompt on request.
    assert template.render(SYSTEM_USER[1:], add_generation_prompt=False) == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    )
    ids = smollm2[1].encode(template.render(SYSTEM_USER), parse_special=True)
    assert ids[0] == smollm2[1].token_id("<|im_start|>")


def test_gemma3_uses_fallback(gemma3: tuple[GGUFFile, Tokenizer]) -> None:
    gf, tok = gemma3
    assert gf.get("tokenizer.chat_template") is None
    with pytest.raises(ChatTemplateError, match="no chat template"):
        ChatTemplate.from_gguf(gf, tok)
    template = ChatTemplate.from_gguf(gf, tok, fallback=GEMMA_TEMPLATE)
    assert template.bos_token == "<bos>"
    text = template.render(SYSTEM_USER)
    # The vocabulary adds BOS itself, so the template's leading <bos> is dropped.
    assert text == "<start_of_turn>user\nYou are terse.\n\nHi<end_of_turn>\n<start_of_turn>model\n"
    ids = tok.encode(text, parse_special=True)
    assert ids[:2] == [tok.bos_id, tok.token_id("<start_of_turn>")]
    assert ids.count(tok.bos_id) == 1


def test_gemma_template_roles_and_tools() -> None:
    template = ChatTemplate(GEMMA_TEMPLATE, bos_token="<bos>")
    conversation = [*SYSTEM_USER, {"role": "assistant", "content": "Hello."}]
    assert template.render(conversation, add_generation_prompt=False) == (
        "<bos><start_of_turn>user\nYou are terse.\n\nHi<end_of_turn>\n"
        "<start_of_turn>model\nHello.<end_of_turn>\n"
    )
    text = template.render(TOOL_CONVERSATION, tools=[WEATHER_TOOL])
    assert '"name": "get_weather"' in text
    assert '{"name": "get_weather", "arguments": {"city": "Paris"}}' in text
    assert "<start_of_turn>user\n```tool_response\nsunny\n```<end_of_turn>" in text
    assert text.endswith("<start_of_turn>model\n")


def test_chatml_template_with_tools() -> None:
    template = ChatTemplate(CHATML_TEMPLATE)
    assert template.render(SYSTEM_USER) == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )
    text = template.render(
        [*TOOL_CONVERSATION, {"role": "tool", "tool_call_id": "call_2", "content": "warm"}],
        tools=[WEATHER_TOOL],
    )
    assert text.startswith("<|im_start|>system\n# Tools\n")
    assert json.dumps(WEATHER_TOOL, ensure_ascii=False) in text
    assert (
        '<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Paris"}}\n</tool_call><|im_end|>\n'
    ) in text
    # Consecutive tool results share one user turn.
    assert (
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n"
        "<tool_response>\nwarm\n</tool_response><|im_end|>\n"
    ) in text
    assert text.endswith("<|im_start|>assistant\n")


# -- what HF templates rely on ------------------------------------------------------------------


def test_tool_call_arguments_become_dicts() -> None:
    src = "{% for m in messages %}{% for c in m.tool_calls or [] %}{{ c.function.arguments.city }}|{{ c.function.arguments is mapping }}{% endfor %}{% endfor %}"  # noqa: E501
    assert ChatTemplate(src).render(TOOL_CONVERSATION) == "Paris|True"
    broken = [{"role": "assistant", "content": "", "tool_calls": [
        {"id": "x", "type": "function", "function": {"name": "f", "arguments": "{not json"}}
    ]}]  # fmt: skip
    src = "{{ messages[0].tool_calls[0].function.arguments }}"
    assert ChatTemplate(src).render(broken) == "{not json"


def test_raise_exception_is_a_400() -> None:
    template = ChatTemplate("{{ raise_exception('Conversation roles must alternate') }}")
    with pytest.raises(InvalidRequest) as info:
        template.render(SYSTEM_USER)
    assert info.value.status == 400
    assert "Conversation roles must alternate" in info.value.message


def test_tojson_filter() -> None:
    template = ChatTemplate(
        "{{ x | tojson }}|{{ x | tojson(indent=2) }}|{{ x | tojson(ensure_ascii=True) }}"
    )  # noqa: E501
    out = template.render([], x={"k": "é"})
    assert out == '{"k": "é"}|{\n  "k": "é"\n}|{"k": "\\u00e9"}'


def test_helpers_and_extensions() -> None:
    src = (
        "{{ strftime_now('%Y') }}|{{ bos_token }}{{ eos_token }}|"
        "{% for i in range(10) %}{% if i == 3 %}{% break %}{% endif %}{{ i }}{% endfor %}|"
        "{% generation %}gen{% endgeneration %}|{{ enable_thinking }}|{{ tools is none }}"
    )
    out = ChatTemplate(src, bos_token="<s>", eos_token="</s>").render([], enable_thinking=False)
    assert out == f"{time.strftime('%Y')}|<s></s>|012|gen|False|True"


def test_trim_and_lstrip_blocks() -> None:
    src = (
        "{% for m in messages %}\n    {% if true %}\n{{ m.content }}\n    {% endif %}\n{% endfor %}"
    )
    assert ChatTemplate(src).render(SYSTEM_USER) == "You are terse.\nHi\n"


def test_message_and_tool_dicts() -> None:
    messages = [
        Message(role="assistant", content="", reasoning="thinking",
                tool_calls=[ToolCall(id="c1", name="f", arguments='{"a": 1}')]),
        Message(role="tool", content="42", tool_call_id="c1", name="f"),
    ]  # fmt: skip
    assert message_dicts(messages) == [
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "thinking",
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
            ],
        },
        {"role": "tool", "content": "42", "tool_call_id": "c1", "name": "f"},
    ]
    assert tool_dicts([Tool(name="f", description="d")]) == [
        {
            "type": "function",
            "function": {
                "name": "f",
                "description": "d",
                "parameters": {"type": "object", "properties": {}},
            },
        }
    ]


# -- hostile templates --------------------------------------------------------------------------

ESCAPES = {
    "mro": "{{ ''.__class__.__mro__[1].__subclasses__() }}",
    "subclasses": "{{ [].__class__.__base__.__subclasses__() }}",
    "globals": "{{ raise_exception.__globals__ }}",
    "cycler globals": "{{ cycler.__init__.__globals__.os.popen('id').read() }}",
    "joiner globals": "{{ joiner.__init__.__globals__ }}",
    "namespace init": "{{ namespace.__init__ }}",
    "self": "{{ self.__init__.__globals__ }}",
    "getitem dunder": "{{ ''['__class__'] }}",
    "attr filter": "{{ '' | attr('__class__') }}",
    "list mutation": "{{ messages.append(1) }}",
    "dict mutation": "{{ messages[0].update({'role': 'x'}) }}",
}


@pytest.mark.parametrize("source", list(ESCAPES.values()), ids=list(ESCAPES))
def test_sandbox_blocks_escapes(source: str) -> None:
    with pytest.raises(ChatTemplateError, match="unsafe operation"):
        ChatTemplate(source).render(SYSTEM_USER)


@pytest.mark.parametrize("source", ["{{ open('/etc/passwd').read() }}", "{{ os.system('id') }}"])
def test_no_builtins(source: str) -> None:
    with pytest.raises(ChatTemplateError):
        ChatTemplate(source).render(SYSTEM_USER)


RUNAWAYS = {
    "nested loops": "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",  # noqa: E501
    "string repeat": "{{ 'a' * 1000000000 }}",
    "list repeat": "{{ ([1] * 100000) * 100000 }}",
    "doubling concat": (
        "{% set ns = namespace(s='ab') %}{% for i in range(64) %}"
        "{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s | length }}"
    ),
    "doubling plus": (
        "{% set ns = namespace(s='ab') %}{% for i in range(64) %}"
        "{% set ns.s = ns.s + ns.s %}{% endfor %}"
    ),
    "output flood": "{% for i in range(100000) %}{{ 'x' * 100000 }}{% endfor %}",
    "infinite recursion": "{% macro f(n) %}{{ f(n) }}{% endmacro %}{{ f(1) }}",
    "exponential recursion": (
        "{% macro f(n) %}{% if n > 0 %}{{ f(n - 1) }}{{ f(n - 1) }}{% endif %}{% endmacro %}"
        "{{ f(40) }}"
    ),
    "center method": "{{ 'x'.center(1000000000) }}",
    "center filter": "{{ 'x' | center(1000000000) }}",
    "huge power": "{{ 2 ** 1000000000 }}",
    "printf width": "{{ '%0999999999d' % 1 }}",
    "format width": "{{ '{:>999999999}'.format(1) }}",
    "join": "{{ ''.join(['a' * 1000000] * 100) }}",
    "join filter": "{{ (['a' * 1000000] * 100) | join }}",
    "replace": "{{ ('a' * 100000).replace('a', 'a' * 1000) }}",
    "indent": "{{ ('\\n' * 100000) | indent(100000) }}",
    "tojson indent": "{{ messages | tojson(indent=100000) }}",
}


@pytest.mark.parametrize("source", list(RUNAWAYS.values()), ids=list(RUNAWAYS))
def test_runaway_templates_fail_fast(source: str) -> None:
    template = ChatTemplate(source, timeout=1.0)
    start = time.monotonic()
    with pytest.raises(ChatTemplateError):
        template.render(SYSTEM_USER)
    assert time.monotonic() - start < 4.0


def test_step_budget_and_output_cap_are_configurable() -> None:
    loop = "{% for i in range(1000) %}{{ i }}{% endfor %}"
    assert ChatTemplate(loop).render([]).startswith("0123")
    with pytest.raises(ChatTemplateError, match="budget of 100 "):
        ChatTemplate(loop, max_steps=100).render([])
    with pytest.raises(ChatTemplateError, match="output exceeds 50 characters"):
        ChatTemplate(loop, max_output_chars=50).render([])


def test_syntax_error_at_load() -> None:
    with pytest.raises(ChatTemplateError, match="syntax error at line 2") as info:
        ChatTemplate("ok\n{% for m in messages %}{{ m.content }}")
    assert info.value.status == 500


def test_template_bugs_become_template_errors() -> None:
    with pytest.raises(ChatTemplateError, match="chat template failed"):
        ChatTemplate("{{ messages[0].content + 1 }}").render(SYSTEM_USER)


def test_a_template_that_allows_one_system_message_gets_a_leading_run_as_one() -> None:
    # Qwen3.5's template raises on a system message past the first; a client's instructions
    # plus a developer message are two
    source = (
        "{%- for m in messages %}{%- if m.role == 'system' and not loop.first %}"
        "{{- raise_exception('System message must be at the beginning.') }}{%- endif %}"
        "<{{ m.role }}>{{ m.content }}</{{ m.role }}>{%- endfor %}"
    )
    template = ChatTemplate(source)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "system", "content": [{"type": "text", "text": "Use tools."}]},
        {"role": "user", "content": "Hi"},
    ]
    assert template.render(messages, add_generation_prompt=False) == (
        "<system>Be brief.\n\nUse tools.</system><user>Hi</user>"
    )
    # a system message later in the conversation is still the template's to refuse
    with pytest.raises(InvalidRequest, match="must be at the beginning"):
        template.render([messages[2], messages[0]], add_generation_prompt=False)
