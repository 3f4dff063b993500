"""The engine's own count of the prompt it was forwarded: how an answer whose usage differs from the gateway's count is
told to be the gateway's bug or an isolation event.

The usage check is there for the incident's signature: an engine that answered from a prompt other than the one it
was sent (a one-token placeholder for an over-long prompt, with HTTP 200). A gateway that renders some request shape
a few tokens otherwise than the engine does makes a difference too, with nothing wrong on the engine; reported as an
isolation event it would suspend a sound replica and page for a leak on every such request. The replica that
answered tells them apart: asked to count, with its /tokenize, exactly the request it was forwarded, it says the
number its usage said when it read that prompt and only counts it otherwise than the gateway (a count drift: the
gateway's bug, a metric and a log line that name the request's shape, and the answer goes out), and another number
when the answer is not of that prompt (the isolation event it always was).
"""

from __future__ import annotations

from typing import Any

import orjson

from gateway.errors import BackendBadResponse, InvalidRequest, UpstreamError
from gateway.upstream.backends import Replica
from gateway.upstream.proxy import Upstream

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"
# What vLLM's /tokenize takes of a chat request (TokenizeChatRequest) and renders the same way its chat route does.
CHAT_FIELDS = ("messages", "tools", "add_generation_prompt", "continue_final_message", "add_special_tokens")
# A chat request's own fields vLLM's chat route passes to the template among chat_template_kwargs
# (ChatCompletionRequest.build_chat_params); /tokenize takes them only there.
TEMPLATE_FIELDS = ("documents", "reasoning_effort")
# The shape of a request, for the operator who must find which of them the gateway renders otherwise: the parts of a
# chat request a template renders apart. A fixed set, so the metric's labels stay bounded.
MESSAGE_FEATURES = {
    "name": "names",
    "tool_calls": "tool_calls",
    "reasoning": "reasoning",
    "reasoning_content": "reasoning",
}
# A /tokenize answer lists the prompt's token ids: each at most 11 bytes written ("4294967295,"), and a prompt renders
# to at most about one token per byte of the request that asks for its count. Beyond that, and the base for the
# template's own text and the answer's other fields, a backend would only grow the gateway's memory.
TOKENIZE_BYTES_PER_BYTE = 16
TOKENIZE_BASE_BYTES = 1 << 20


def tokenize_bound(body: bytes) -> int:
    """The most bytes an honest /tokenize answer to `body` takes."""
    return TOKENIZE_BASE_BYTES + TOKENIZE_BYTES_PER_BYTE * len(body)


def tokenize_body(path: str, forwarded: bytes) -> bytes | None:
    """The /tokenize request that counts the prompt of `forwarded` (the body sent to `path`) as the engine did; None
    for what /tokenize cannot count (token ids, embeddings' inputs)."""
    payload = orjson.loads(forwarded)
    if path == COMPLETIONS_PATH:
        prompt = payload.get("prompt")
        if not isinstance(prompt, str):
            return None
        return orjson.dumps({"model": payload.get("model"), "prompt": prompt})
    if path != CHAT_PATH:
        return None
    body: dict[str, Any] = {"model": payload.get("model")}
    body.update((name, payload[name]) for name in CHAT_FIELDS if name in payload)
    kwargs = dict(payload.get("chat_template_kwargs") or {})
    kwargs.update((name, payload[name]) for name in TEMPLATE_FIELDS if payload.get(name) is not None)
    if payload.get("reasoning_effort") is not None and "enable_thinking" not in (
        payload.get("chat_template_kwargs") or {}
    ):
        kwargs["enable_thinking"] = payload["reasoning_effort"] != "none"
    if kwargs:
        body["chat_template_kwargs"] = kwargs
    return orjson.dumps(body)


async def ask_count(upstream: Upstream, replica: Replica, body: bytes) -> int:
    """`replica`'s count of a /tokenize request."""
    try:
        response = await upstream.open(replica, "/tokenize", body, "tokenize")
    except InvalidRequest as refusal:
        # Not the backend's words: they can quote the prompt as sent, the tenant's own secret marker included.
        status = refusal.status
        generic = InvalidRequest(f"The backend refused to count this prompt (HTTP {status}).", code=refusal.code)
        generic.status = refusal.status
        raise generic from refusal
    bound = tokenize_bound(body)
    try:
        raw = await response.read(bound + 1)
        if len(raw) > bound:
            raise BackendBadResponse(f"Backend '{replica.name}' answered /tokenize with more than {bound} bytes.")
        answer = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise UpstreamError(f"Backend '{replica.name}' answered /tokenize with something not JSON.") from exc
    finally:
        await response.aclose()
    count = answer.get("count") if isinstance(answer, dict) else None
    if not isinstance(count, int):
        raise UpstreamError(f"Backend '{replica.name}' answered /tokenize without a count.")
    return count


def shape(path: str, forwarded: bytes) -> str:
    """The request's shape as the engine got it: "completion", or "chat" and the parts its template renders apart
    ("chat:parts+system+tools"), never a word of what the tenant wrote."""
    if path != CHAT_PATH:
        return "completion"
    payload = orjson.loads(forwarded)
    features: set[str] = set()
    for message in payload.get("messages") or ():
        if not isinstance(message, dict):
            continue
        role = message.get("role")
        if role in ("system", "developer", "tool"):
            features.add("tool_results" if role == "tool" else str(role))
        if isinstance(message.get("content"), list):
            features.add("parts")
        features.update(feature for field, feature in MESSAGE_FEATURES.items() if message.get(field))
    if payload.get("tools"):
        features.add("tools")
    if payload.get("continue_final_message"):
        features.add("prefill")
    if any(payload.get(name) for name in ("chat_template_kwargs", *TEMPLATE_FIELDS)):
        features.add("template_kwargs")
    return "chat:" + "+".join(sorted(features)) if features else "chat"
