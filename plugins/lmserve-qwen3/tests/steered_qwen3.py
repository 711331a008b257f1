"""A plugin for a real ``lmserve`` process: the ``qwen3`` backend with every reply steered
to the script in ``$LMSERVE_STEER`` (see steering.Steer; special tokens such as
``<|im_end|>`` are parsed, so a script can end its turn).

    LMSERVE_STEER='<think>hm</think>hi<|im_end|>' PYTHONPATH=plugins/lmserve-qwen3/tests \\
        lmserve --plugin steered_qwen3 --backend qwen3-steered synthetic-qwen3.gguf
"""

from __future__ import annotations

import os
from typing import Any

from steering import Steer

from lmserve_core import hookimpl


def create_backend(model: str | None, settings: Any) -> Any:
    from lmserve_qwen3.plugin import create_backend as qwen3

    backend = qwen3(model, settings)
    Steer(backend).say(os.environ.get("LMSERVE_STEER", ""))
    return backend


@hookimpl
def register_backends(register: Any) -> None:
    register("qwen3-steered", create_backend, description="qwen3, replies steered to a script")
