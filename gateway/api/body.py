"""Reading a request body safely: a byte cap enforced while reading, strict UTF-8 JSON, a nesting limit."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
from starlette.requests import ClientDisconnect, Request

from gateway.errors import BodyTooLarge, ClientGone, InvalidRequest, RequestTimeout


async def read_body(request: Request, max_bytes: int, timeout_s: float) -> bytes:
    """The whole body, or BodyTooLarge as soon as it passes max_bytes (never holding more than that); ClientGone
    when the client disconnects before sending all of it; RequestTimeout when all of it takes longer than timeout_s
    (edge.body_timeout_s: a total, since a body sent a byte at a time is never silent for long)."""
    declared = request.headers.get("content-length")
    if declared is not None:
        if not declared.isdigit():
            raise InvalidRequest("Content-Length must be a non-negative integer.")
        if int(declared) > max_bytes:
            raise BodyTooLarge(f"Request body is {declared} bytes; the limit is {max_bytes} bytes.")
    chunks: list[bytes] = []
    size = 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > max_bytes:
                    raise BodyTooLarge(f"Request body exceeds the limit of {max_bytes} bytes.")
                chunks.append(chunk)
    except ClientDisconnect:
        # Not a failure of ours: the request ends as one access-log line with 499, like a client gone later.
        raise ClientGone(f"The client went away after {size} bytes of its request body.") from None
    except TimeoutError:
        raise RequestTimeout(
            f"The request body did not arrive within {timeout_s:g} s ({size} bytes came); send it faster."
        ) from None
    return b"".join(chunks)


def depth_exceeds(value: Any, limit: int) -> bool:
    # Iterative on purpose: a recursive walk of hostile input is how a parser-depth attack becomes a crash.
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        if isinstance(node, dict):
            children: Any = node.values()
        elif isinstance(node, list):
            children = node
        else:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return False


def parse_json_object(raw: bytes, max_depth: int) -> dict[str, Any]:
    if not raw:
        raise InvalidRequest("Request body is empty; expected a JSON object.")
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(f"Request body is not valid JSON (or not valid UTF-8): {exc}") from exc
    if not isinstance(value, dict):
        raise InvalidRequest("Request body must be a JSON object.")
    if depth_exceeds(value, max_depth):
        raise InvalidRequest(f"Request body nests deeper than {max_depth} levels.")
    return value
