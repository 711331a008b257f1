"""The OpenAI Responses API against a running lmserve."""

import os

from openai import OpenAI

client = OpenAI(
    base_url=os.environ.get("LMSERVE_URL", "http://127.0.0.1:8080") + "/v1",
    api_key=os.environ.get("LMSERVE_API_KEY", "unused"),
)
final = None
with client.responses.stream(
    model="any",
    instructions="Answer in one sentence.",
    input="What is a GGUF file?",
    max_output_tokens=64,
) as stream:
    for event in stream:
        if event.type == "response.output_text.delta":
            print(event.delta, end="", flush=True)
        # A reply cut off by max_output_tokens ends with `response.incomplete`, as on
        # OpenAI's API; the SDK's get_final_response() accepts only `response.completed`.
        elif event.type in ("response.completed", "response.incomplete"):
            final = event.response
print()
if final is not None:
    print(final.status, final.usage)
