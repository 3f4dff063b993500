"""The audited endpoint over HTTP: every request goes through the budget, every answer is read defensively.

The endpoint may be anything that speaks OpenAI's API, healthy or broken, so nothing it returns is trusted to
have a shape: bodies are parsed as far as they go and what could not be parsed is kept as an excerpt. httpx
errors are mapped here to the audit's errors (discovery) or recorded as a request's outcome (probes).
"""

from __future__ import annotations

import asyncio
from typing import Any

import httpx
import orjson

from isolation.audit.budget import Budget
from isolation.audit.config import Identity
from isolation.audit.errors import Unreachable
from isolation.audit.exchange import Exchange, Prompt

REQUEST_TIMEOUT_S = 60.0  # a 2×limit prompt on a slow engine still gets its 400 well within this
MAX_STREAM_BYTES = 1 << 20  # an answer is a few hundred tokens; past this a stream is cut, the audit bounded
EXCERPT_CHARS = 400
RETRIES_ON_429 = 3
DEFAULT_RETRY_WAIT_S = 1.0
MAX_RETRY_WAIT_S = 10.0


def _json(raw: bytes) -> Any:
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None


def error_message(body: Any) -> str | None:
    """OpenAI's `{"error": {"message": ...}}`, or the other shapes servers use (`{"detail": ...}`, a string)."""
    if not isinstance(body, dict):
        return None
    error = body.get("error", body.get("detail"))
    if isinstance(error, dict):
        message = error.get("message")
        return str(message) if message is not None else orjson.dumps(error).decode()
    return str(error) if error is not None else None


class Endpoint:
    def __init__(
        self, client: httpx.AsyncClient, base_url: str, model: str, budget: Budget, *, salts: bool = True
    ) -> None:
        self.client = client
        self.base_url = base_url
        self.model = model
        self.budget = budget
        self.salts = salts  # cleared by discovery when the endpoint refuses the cache_salt field
        self.failures = 0  # chat requests that got no HTTP answer at all

    def _timeout(self) -> httpx.Timeout:
        return httpx.Timeout(max(0.1, min(REQUEST_TIMEOUT_S, self.budget.remaining_s())))

    async def get(self, path: str, identity: Identity | None = None) -> httpx.Response:
        await self.budget.acquire()
        headers = identity.headers() if identity else {}
        try:
            return await self.client.get(self.base_url + path, headers=headers, timeout=self._timeout())
        except httpx.HTTPError as exc:
            raise Unreachable(f"GET {path}: {type(exc).__name__}: {exc}") from exc

    async def post(self, path: str, body: dict[str, Any], identity: Identity | None = None) -> httpx.Response:
        await self.budget.acquire()
        headers = identity.headers() if identity else {}
        try:
            return await self.client.post(self.base_url + path, json=body, headers=headers, timeout=self._timeout())
        except httpx.HTTPError as exc:
            raise Unreachable(f"POST {path}: {type(exc).__name__}: {exc}") from exc

    def chat_body(self, identity: Identity, prompt: Prompt, max_tokens: int, stream: bool) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": self.model,
            "messages": [{"role": "user", "content": prompt.content}],
            "max_tokens": max_tokens,
            "temperature": 0,
            "user": identity.user,
        }
        if identity.cache_salt and self.salts:
            body["cache_salt"] = identity.cache_salt
        if stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        return body

    async def chat(
        self, identity: Identity, prompt: Prompt, *, max_tokens: int, stream: bool, paid: bool = False
    ) -> Exchange:
        """Send one chat completion; any outcome, transport failures included, comes back as an Exchange.

        `paid`: the caller already took this request's turn from the budget (several at once, to start them
        together). A 429 is waited out and retried a few times, each retry from the budget: a gateway's rate
        or concurrency limit says nothing about isolation, and reading it as a refusal would skip probes.
        """
        for attempt in range(RETRIES_ON_429 + 1):
            if not paid or attempt > 0:
                await self.budget.acquire()
            exchange = await self._send(identity, prompt, max_tokens, stream)
            if exchange.status != 429 or attempt == RETRIES_ON_429:
                break
            await asyncio.sleep(min(exchange.retry_after_s, MAX_RETRY_WAIT_S, self.budget.remaining_s()))
        if exchange.status == 0:
            self.failures += 1
        return exchange

    async def _send(self, identity: Identity, prompt: Prompt, max_tokens: int, stream: bool) -> Exchange:
        exchange = Exchange(identity=identity.name, prompt=prompt, max_tokens=max_tokens, stream=stream)
        body = self.chat_body(identity, prompt, max_tokens, stream)
        url = f"{self.base_url}/v1/chat/completions"
        headers = identity.headers()
        try:
            if stream:
                async with self.client.stream("POST", url, json=body, headers=headers, timeout=self._timeout()) as got:
                    exchange.status = got.status_code
                    if got.status_code != 200:
                        _refusal(exchange, got, await got.aread())
                    else:
                        await _read_stream(exchange, got)
            else:
                response = await self.client.post(url, json=body, headers=headers, timeout=self._timeout())
                exchange.status = response.status_code
                if response.status_code != 200:
                    _refusal(exchange, response, response.content)
                else:
                    _read_body(exchange, response.content)
        except httpx.HTTPError as exc:
            exchange.status = 0
            exchange.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
        return exchange


def _refusal(exchange: Exchange, response: httpx.Response, raw: bytes) -> None:
    text = raw[:EXCERPT_CHARS].decode("utf-8", "replace")
    try:
        exchange.retry_after_s = float(response.headers.get("retry-after", DEFAULT_RETRY_WAIT_S))
    except ValueError:
        pass  # an HTTP date: the default wait will do
    exchange.error = error_message(_json(raw)) or text or f"HTTP {exchange.status}"
    exchange.body_excerpt = text


def _take_choices(exchange: Exchange, choices: Any, key: str) -> None:
    if not isinstance(choices, list):
        return
    for choice in choices:
        holder = choice.get(key) if isinstance(choice, dict) else None
        if not isinstance(holder, dict):
            continue
        # Reasoning text is an answer too: a leak does not care which field it lands in.
        for name in ("content", "reasoning_content", "reasoning"):
            value = holder.get(name)
            if isinstance(value, str):
                exchange.text += value


def _read_body(exchange: Exchange, raw: bytes) -> None:
    body = _json(raw)
    if not isinstance(body, dict):
        exchange.error = "the 200 answer is not a JSON object"
        exchange.body_excerpt = raw[:EXCERPT_CHARS].decode("utf-8", "replace")
        return
    _take_choices(exchange, body.get("choices"), "message")
    usage = body.get("usage")
    exchange.usage = usage if isinstance(usage, dict) else None
    if "error" in body:
        exchange.error = error_message(body)


async def _read_stream(exchange: Exchange, response: httpx.Response) -> None:
    read = 0
    async for line in response.aiter_lines():
        read += len(line) + 1
        if read > MAX_STREAM_BYTES:
            exchange.error = f"stream cut after {MAX_STREAM_BYTES} bytes"
            return
        if not line.startswith("data:"):
            continue
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            return
        chunk = _json(data.encode())
        if not isinstance(chunk, dict):
            exchange.error = exchange.error or "a stream event is not a JSON object"
            continue
        if "error" in chunk:
            exchange.error = error_message(chunk)
            continue
        if isinstance(chunk.get("id"), str):
            exchange.chunk_ids.append(chunk["id"])
        _take_choices(exchange, chunk.get("choices"), "delta")
        if isinstance(chunk.get("usage"), dict):
            exchange.usage = chunk["usage"]
