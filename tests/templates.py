"""Chat templates of model families whose test GGUFs carry none of their own."""

GEMMA_TEMPLATE = """\
{{- bos_token }}
{%- if messages and messages[0].role == 'system' %}
{%- set first_user_prefix = messages[0].content + '\\n\\n' %}
{%- set loop_messages = messages[1:] %}
{%- else %}
{%- set first_user_prefix = '' %}
{%- set loop_messages = messages %}
{%- endif %}
{%- if tools %}
{%- set ns = namespace(tools='You can call these functions. To call one, reply with only '
    ~ '```tool_call\\n{"name": <function-name>, "arguments": <args-json-object>}\\n```\\n') %}
{%- for tool in tools %}
{%- set ns.tools = ns.tools ~ (tool | tojson) ~ '\\n' %}
{%- endfor %}
{%- set first_user_prefix = first_user_prefix ~ ns.tools ~ '\\n' %}
{%- endif %}
{%- for message in loop_messages %}
{%- set role = 'model' if message.role == 'assistant' else 'user' %}
{{- '<start_of_turn>' ~ role ~ '\\n' ~ (first_user_prefix if loop.first else '') }}
{%- if message.role == 'tool' %}
{{- '```tool_response\\n' ~ message.content ~ '\\n```' }}
{%- else %}
{{- message.content | trim }}
{%- endif %}
{%- for call in message.tool_calls or [] %}
{%- set fn = call.function if call.function is defined else call %}
{{- '\\n```tool_call\\n' ~ ({'name': fn.name, 'arguments': fn.arguments} | tojson) ~ '\\n```' }}
{%- endfor %}
{{- '<end_of_turn>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<start_of_turn>model\\n' }}
{%- endif %}
"""
