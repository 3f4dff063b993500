"""Canary checks on every text an OpenAI-style answer carries, streamed or whole.

Every choice's content, reasoning text and tool-call arguments are scanned, each as its own stream (a marker
split across chunks of one field is found; fields never run into each other). The tenant's own marker is
stripped; another tenant's is a leak, handled by the deployment's policy.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from isolation.leaks import REDACTED, LeakPolicy
from isolation.markers import MarkerRegistry, Owner
from isolation.scanner import Hit, StreamScanner, apply_edits

TEXT_FIELDS = ("content", "reasoning_content", "reasoning", "text")

LeakHandler = Callable[[Owner], Awaitable[None]]


class LeakBlocked(Exception):
    """Another tenant's marker was found and the policy is to block: the answer must not go out."""


def _text_slots(choice: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any], str]]:
    """(scanner key, the dict holding a text, the text's key) for every text of one choice."""
    index = choice.get("index", 0)
    for holder in (choice, choice.get("delta"), choice.get("message")):
        if not isinstance(holder, dict):
            continue
        for name in TEXT_FIELDS:
            if isinstance(holder.get(name), str):
                yield f"{index}:{name}", holder, name
        calls = holder.get("tool_calls")
        if isinstance(calls, list):
            for position, call in enumerate(calls):
                function = call.get("function") if isinstance(call, dict) else None
                if isinstance(function, dict) and isinstance(function.get("arguments"), str):
                    yield f"{index}:tool:{call.get('index', position)}", function, "arguments"


def place(choice: dict[str, Any], field: str, text: str) -> None:
    """Append text to one of a streamed choice's texts, by the scanner key's field part."""
    if field == "text":
        choice["text"] = (choice.get("text") or "") + text
        return
    delta = choice.setdefault("delta", {})
    if not field.startswith("tool:"):
        delta[field] = (delta.get(field) or "") + text
        return
    index = int(field[len("tool:") :])
    calls = delta.setdefault("tool_calls", [])
    call = next((c for c in calls if c.get("index") == index), None)
    if call is None:
        call = {"index": index, "function": {"arguments": ""}}
        calls.append(call)
    function = call.setdefault("function", {})
    function["arguments"] = (function.get("arguments") or "") + text


class OutputGuard:
    def __init__(self, registry: MarkerRegistry, tenant: str, policy: LeakPolicy, on_leak: LeakHandler) -> None:
        self._registry = registry
        self._tenant = tenant
        self._policy = policy
        self._on_leak = on_leak
        self._scanners: dict[str, StreamScanner] = {}
        self._reported: set[str] = set()
        self._unknown: set[bytes] = set()

    async def check_chunk(self, chunk: dict[str, Any]) -> bool:
        """Scan and edit one streamed chunk in place; True when it changed."""
        changed = False
        for choice in chunk.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            for key, holder, name in _text_slots(choice):
                scanner = self._scanners.setdefault(key, StreamScanner())
                original = holder[name]
                released = await self._release(scanner, original)
                if released != original:
                    holder[name] = released
                    changed = True
            if choice.get("finish_reason") is not None:
                # Nothing more comes for this choice: what was held goes out with its last chunk, even when that
                # chunk carries none of the fields (OpenAI's closing chunk has `delta: {}`).
                prefix = f"{choice.get('index', 0)}:"
                for key in [k for k in self._scanners if k.startswith(prefix)]:
                    rest = self._scanners.pop(key).flush()
                    if rest:
                        place(choice, key.partition(":")[2], rest)
                        changed = True
        return changed

    async def check_body(self, body: dict[str, Any]) -> bool:
        """Scan and edit a whole (non-streamed) answer in place; True when it changed."""
        changed = False
        for choice in body.get("choices") or ():
            if not isinstance(choice, dict):
                continue
            for _, holder, name in _text_slots(choice):
                scanner = StreamScanner()
                original = holder[name]
                released = await self._release(scanner, original) + scanner.flush()
                if released != original:
                    holder[name] = released
                    changed = True
        return changed

    def held(self) -> dict[str, str]:
        """What is still held back at the end of a stream, by scanner key; empties the scanners."""
        return {key: rest for key, scanner in self._scanners.items() if (rest := scanner.flush())}

    async def _release(self, scanner: StreamScanner, piece: str) -> str:
        scan = scanner.scan(piece)
        released = scan.text[: scan.release]
        if not scan.hits:
            return released
        edits: list[tuple[Hit, str]] = []
        for hit in scan.hits:
            if hit.normal in self._unknown:
                continue
            owner = await self._registry.resolve(hit.normal)
            if owner is None:
                # A model can be made to write marker-shaped strings over and over: ask the store once per answer.
                self._unknown.add(hit.normal)
                continue
            if owner.tenant == self._tenant:
                edits.append((hit, ""))
                continue
            if owner.tenant not in self._reported:  # one event per victim and answer, however often it shows
                self._reported.add(owner.tenant)
                await self._on_leak(owner)
            if self._policy is LeakPolicy.BLOCK:
                raise LeakBlocked
            if self._policy is LeakPolicy.REDACT:
                edits.append((hit, REDACTED))
        return apply_edits(released, edits)
