"""Chat with a running lmserve through the official OpenAI SDK (streaming)."""

import os

from openai import OpenAI

client = OpenAI(
    base_url=os.environ.get("LMSERVE_URL", "http://127.0.0.1:8080") + "/v1",
    api_key=os.environ.get("LMSERVE_API_KEY", "unused"),
)
stream = client.chat.completions.create(
    model="any",
    messages=[{"role": "user", "content": "Write a haiku about lighthouses."}],
    max_tokens=64,
    stream=True,
)
for chunk in stream:
    if chunk.choices and chunk.choices[0].delta.content:
        print(chunk.choices[0].delta.content, end="", flush=True)
print()
