"""Server-sent events, framed the two ways vLLM frames them.

OpenAI's chat and completion chunks go out as bare `data:` lines and the stream ends with `data: [DONE]`; the
Responses and Anthropic Messages APIs name each event in an `event:` line before its data, and send no [DONE]
(vllm/entrypoints/openai/responses/api_router.py, vllm/entrypoints/anthropic/serving.py).
"""

from __future__ import annotations

from typing import Any

import orjson

DONE = b"data: [DONE]\n\n"


def data_event(payload: Any) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


def named_event(name: str, payload: Any) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + orjson.dumps(payload) + b"\n\n"
