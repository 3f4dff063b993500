"""A body's shape is bounded before anything reads it, and a huge one costs other tenants nothing (issue 45, item 4).

The proof runs one tenant's huge body beside another tenant's small requests, over HTTP to a real gateway, and
compares the small requests' latency while the big body is in flight with theirs while it is not, side by side:
100,000-item bodies the bounds refuse, and the largest body they accept, in a gateway process of its own (in this
process, the test's client and simulator would hold the GIL the gateway's loop waits for).
"""

from __future__ import annotations

import asyncio
import gc
import statistics
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from gateway.tenancy.tenants import hash_key
from tests.integration.conftest import GatewayFactory
from tests.integration.support import ALICE_KEY, BOB_KEY, MODEL, auth, chat_body, forwarded, metric

ITEMS = 100_000
WORDS = [{"role": "user", "content": "word"}] * ITEMS
BLOCKS = [{"role": "user", "content": [{"type": "text", "text": "word"}] * ITEMS}]
HUGE: dict[str, tuple[str, dict[str, Any]]] = {
    "responses input items": ("/v1/responses", {"model": MODEL, "input": WORDS}),
    "messages text blocks": ("/v1/messages", {"model": MODEL, "max_tokens": 16, "messages": BLOCKS}),
    "chat messages": ("/v1/chat/completions", {"model": MODEL, "messages": WORDS}),
}
# ~108,000 values, under limits.max_json_values, its lists under their caps: parsed, validated and read by the
# pipeline, which then refuses it for the model's 2,048-token window.
LARGEST = {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text", "text": "w"}] * 8}] * 4000}
ROUNDS = 4  # huge bodies, one after another, each with a pause before it
# The largest accepted: a stall of its that a small request meets comes now and then, not with every body.
LARGEST_ROUNDS = 8
PAUSE_S = 0.25  # between them: the small requests alone
EVERY_S = 0.01  # a small request starts this often, whatever the others are doing
ADDED_MS = 50  # the most a huge body may add to another tenant's request


@pytest.mark.alone
@pytest.mark.parametrize("shape", list(HUGE))
async def test_a_huge_body_adds_no_latency_to_another_tenants_requests(
    make_gateway: GatewayFactory, sim_url: str, shape: str
) -> None:
    path, body = HUGE[shape]
    alone, beside, took = await side_by_side(make_gateway({"sim": sim_url}), path, orjson.dumps(body))
    added_ms = (statistics.median(beside) - statistics.median(alone)) * 1000
    assert added_ms <= ADDED_MS, (
        f"bob's requests took {added_ms:.0f} ms more while alice's body was in flight (median of {len(beside)}, "
        f"against {len(alone)} alone; the slowest {max(beside) * 1000:.0f} ms); alice's took {took} ms"
    )


@pytest.mark.alone
async def test_the_largest_body_the_bounds_accept_delays_no_other_tenants_request_by_more_than_50_ms(
    make_gateway_process: GatewayFactory, sim_url: str, tokenizer_dir: Path
) -> None:
    config = {
        "backends": [{"name": "sim", "url": sim_url}],
        "models": [{"name": MODEL, "backends": ["sim"], "tokenizer": str(tokenizer_dir), "context_window": 2048}],
        "tenants": [
            {"id": "alice", "key_hashes": [hash_key(ALICE_KEY)]},
            {"id": "bob", "key_hashes": [hash_key(BOB_KEY)]},
        ],
    }
    gateway = make_gateway_process(config)
    alone, beside, took = await side_by_side(gateway, "/v1/chat/completions", orjson.dumps(LARGEST), LARGEST_ROUNDS)
    # The slow end, not the middle: each stall of the old code's (50-130 ms a body) met a tenth of the requests beside
    # it. The 95th percentile beside the body against the same alone, so that a core taken away from both now and then
    # (a busy neighbour, descheduled mid-collection) is not counted against the body; bench_bodies reports the max.
    added_ms = (p95(beside) - p95(alone)) * 1000
    median_ms = (statistics.median(beside) - statistics.median(alone)) * 1000
    assert added_ms <= ADDED_MS, (
        f"bob's requests took {added_ms:.0f} ms more at the 95th percentile while alice's body was in flight "
        f"({len(beside)} beside it, {len(alone)} alone, {median_ms:.0f} ms more at the median, the slowest "
        f"{max(beside) * 1000:.0f} ms against {max(alone) * 1000:.0f} ms alone); alice's took {took} ms"
    )


def p95(latencies: list[float]) -> float:
    return statistics.quantiles(latencies, n=20)[-1]


async def side_by_side(
    gateway: str, path: str, raw: bytes, rounds: int = ROUNDS
) -> tuple[list[float], list[float], list[int]]:
    """Bob's small requests, one every EVERY_S, while alice sends `raw` to `path` `rounds` times, a pause before each:
    (the latencies of those sent with no huge body in flight from their start to their end, of those sent while
    one was, the ms each huge body took). Each huge body is refused: by the bounds or for the model's window."""
    small = chat_body("Hi", max_tokens=1)
    in_flight: list[tuple[float, float]] = []  # when each of alice's huge bodies was sent, and when it was answered
    # This process is the clients and the simulator: the collector's full passes over all it has loaded (pytest,
    # the gateway's modules) held them up to ~200 ms, in any window. Frozen out of its sight, as a gateway does.
    gc.collect()
    gc.freeze()
    try:
        return await _side_by_side(gateway, path, raw, rounds, small, in_flight)
    finally:
        gc.unfreeze()


async def _side_by_side(
    gateway: str, path: str, raw: bytes, rounds: int, small: dict[str, Any], in_flight: list[tuple[float, float]]
) -> tuple[list[float], list[float], list[int]]:
    async with (
        httpx.AsyncClient(base_url=gateway, timeout=60) as alice,
        httpx.AsyncClient(base_url=gateway, timeout=60) as bob,
    ):

        async def small_request() -> tuple[float, float]:
            started = time.perf_counter()
            answer = await bob.post("/v1/chat/completions", json=small, headers=auth(BOB_KEY))
            assert answer.status_code == 200, answer.text
            return started, time.perf_counter()

        async def huge_request() -> None:
            started = time.perf_counter()
            answer = await alice.post(path, content=raw, headers=auth(ALICE_KEY) | JSON)
            in_flight.append((started, time.perf_counter()))
            assert answer.status_code in (400, 413), answer.text

        async def huge_tenant() -> None:
            for _ in range(rounds):
                await asyncio.sleep(PAUSE_S)
                await huge_request()

        for _ in range(5):  # connections open, the model's first counts made
            await small_request()
        await huge_request()  # the first one starts what checks large bodies: not measured
        in_flight.clear()
        spans: list[asyncio.Task[tuple[float, float]]] = []
        huge = asyncio.create_task(huge_tenant())
        while not huge.done():
            spans.append(asyncio.create_task(small_request()))
            await asyncio.sleep(EVERY_S)
        await huge
        timed = await asyncio.gather(*spans)
    # Beside: started while a huge body was in flight. Alone: no huge body in flight from its start to its end.
    beside = [end - start for start, end in timed if any(a <= start <= b for a, b in in_flight)]
    alone = [end - start for start, end in timed if not any(start <= b and a <= end for a, b in in_flight)]
    assert len(beside) >= 10 and len(alone) >= 10, (len(beside), len(alone))
    return alone, beside, [round((b - a) * 1000) for a, b in in_flight]


JSON = {"content-type": "application/json"}


SMALL_LIMITS = {"max_messages": 3, "max_content_parts": 2, "max_tools": 2, "max_json_values": 1024}
TEXT = {"type": "text", "text": "x"}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def turns(count: int, content: Any = "x") -> list[dict[str, Any]]:
    return [{"role": "user", "content": content}] * count


def workers_error(answer: httpx.Response) -> dict[str, Any]:
    error: dict[str, Any] = answer.json()["errors"][0]
    return error


# (route, body, status, the error's message starts so, where the API's error shape says which field)
REFUSED: list[tuple[str, dict[str, Any], int, str, str | None]] = [
    ("/v1/chat/completions", chat_body() | {"messages": turns(4)}, 400, "messages: 4 messages; at most 3", "messages"),
    ("/v1/chat/completions", chat_body() | {"messages": turns(1, [TEXT] * 3)}, 400,
     "messages[0].content: 3 content parts; at most 2", "messages[0].content"),
    ("/v1/chat/completions", chat_body(tools=[TOOL] * 3), 400, "tools: 3 tools; at most 2", "tools"),
    ("/v1/chat/completions", chat_body(logit_bias={str(n): 1 for n in range(1100)}), 413,
     "Request body holds at least 1", None),
    ("/v1/completions", {"model": MODEL, "prompt": [1] * 1100}, 413, "Request body holds at least 1", None),
    ("/v1/embeddings", {"model": MODEL, "input": ["x"] * 1100}, 413, "Request body holds at least 1", None),
    ("/v1/responses", {"model": MODEL, "input": turns(4)}, 400, "input: 4 input items; at most 3", "input"),
    ("/v1/responses", {"model": MODEL, "input": turns(1, [{"type": "input_text", "text": "x"}] * 3)}, 400,
     "input[0].content: 3 content parts; at most 2", "input[0].content"),
    ("/v1/messages", {"model": MODEL, "max_tokens": 8, "messages": turns(4)}, 400, "messages: 4 messages", None),
    ("/v1/messages", {"model": MODEL, "max_tokens": 8, "messages": turns(1), "system": [TEXT] * 3}, 400,
     "system: 3 system blocks; at most 2", None),
    ("/v1/messages", {"model": MODEL, "max_tokens": 8, "messages": turns(1, [TEXT] * 1100)}, 400,
     "messages[0].content: 1100 content blocks", None),
    ("/v1/messages/count_tokens", {"model": MODEL, "messages": turns(1, [TEXT] * 3)}, 400,
     "messages[0].content: 3 content blocks; at most 2", None),
    (f"/accounts/alice/ai/run/{MODEL}", {"messages": turns(4)}, 400, "messages: 4 messages", "/messages"),
    (f"/accounts/alice/ai/run/{MODEL}?queueRequest=true", {"requests": [{"messages": turns(n)} for n in (1, 4)]}, 400,
     "requests[1].messages: 4 messages", "/requests/1/messages"),
    (f"/accounts/alice/ai/run/{MODEL}", {"prompt": "x", "stop": ["x"] * 1100}, 413, "Request body holds", None),
]  # fmt: skip


@pytest.mark.parametrize("checked_by", ["the event loop", "a worker process"])
async def test_each_limit_is_refused_in_its_apis_own_error_and_nothing_is_forwarded(
    make_gateway: GatewayFactory, sim_url: str, checked_by: str
) -> None:
    inline = {"inline_json_values": 0} if checked_by == "a worker process" else {}
    gateway = make_gateway({"sim": sim_url}, limits=SMALL_LIMITS | inline)
    async with httpx.AsyncClient(base_url=gateway, timeout=30) as client:
        for path, body, status, said, where in REFUSED:
            answer = await client.post(path, json=body, headers=auth(ALICE_KEY))
            assert answer.status_code == status, (path, answer.text)
            if path.startswith("/accounts/"):
                error = workers_error(answer)
                assert error["code"] == (5006 if status == 400 else 3006), error
                assert error["message"].startswith(said), error
                assert error.get("source", {}).get("pointer") == where, error
            elif path.startswith("/v1/messages"):
                assert answer.json()["type"] == "error", answer.text
                error = answer.json()["error"]
                assert error["type"] == ("invalid_request_error" if status == 400 else "request_too_large"), error
                assert error["message"].startswith(said), error
            else:
                error = answer.json()["error"]
                assert error["message"].startswith(said) and error["param"] == where, error
                assert error["code"] == ("invalid_request" if status == 400 else "request_too_large"), error
        # Within every limit, the same routes serve as ever.
        answer = await client.post("/v1/chat/completions", json=chat_body(max_tokens=2), headers=auth(ALICE_KEY))
        assert answer.status_code == 200, answer.text
        shown = (await client.get("/metrics")).text
    assert len(forwarded(sim_url)) == 1
    assert metric(shown, "bulkhead_body_refusals_total", route="responses", limit="max_messages") == 1
    assert metric(shown, "bulkhead_body_refusals_total", route="messages", limit="max_messages") == 1
    assert metric(shown, "bulkhead_body_refusals_total", limit="max_json_values") == 4
    checked_off_loop = metric(shown, "bulkhead_body_check_seconds_count")
    assert checked_off_loop == (0 if not inline else len(REFUSED) + 1)
