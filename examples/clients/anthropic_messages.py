"""Talk to a running lmserve through the official Anthropic SDK (streaming)."""

import os

from anthropic import Anthropic

client = Anthropic(
    base_url=os.environ.get("LMSERVE_URL", "http://127.0.0.1:8080"),
    api_key=os.environ.get("LMSERVE_API_KEY", "unused"),
)
with client.messages.stream(
    model="any",
    max_tokens=64,
    messages=[{"role": "user", "content": "Name three uses of a lighthouse."}],
) as stream:
    for text in stream.text_stream:
        print(text, end="", flush=True)
print()
print(stream.get_final_message().usage)
