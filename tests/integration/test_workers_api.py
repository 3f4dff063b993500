"""The Workers-style surface and the async (queued) API, on the same pipeline as /v1."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import redis

from gateway.api.workers import workers_answer
from gateway.api.workers_shapes import workers_result
from gateway.pipeline.outcome import Answer
from gateway.tenancy.tenants import hash_key
from isolation.markers import MARKER_PATTERN
from tests.integration.support import ALICE_KEY, BOB_KEY, MODEL, auth, chat_body, forwarded, metric
from tests.integration.tenant_support import until
from tests.redis_server import own_redis

RUN = f"/accounts/alice/ai/run/{MODEL}"


async def test_run_chat_and_prompt_in_the_workers_envelope(
    client: httpx.AsyncClient, gateway_url: str, sim_url: str
) -> None:
    chat = await client.post(
        f"{gateway_url}{RUN}", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}, headers=auth()
    )
    assert chat.status_code == 200, chat.text
    body = chat.json()
    assert body["success"] is True and body["errors"] == [] and body["messages"] == []
    assert body["result"]["response"] and body["result"]["usage"]["completion_tokens"] == 3
    prompt = await client.post(f"{gateway_url}{RUN}", json={"prompt": "Once", "max_tokens": 2}, headers=auth())
    assert prompt.json()["result"]["usage"]["completion_tokens"] == 2
    raw = await client.post(
        f"{gateway_url}{RUN}", json={"prompt": "Once", "raw": True, "options": {"rejectIfBusy": True}}, headers=auth()
    )
    assert raw.status_code == 200, raw.text
    sent = forwarded(sim_url)
    # The same pipeline: the tenant's marker and salt went upstream exactly as on /v1.
    first = sent[0]["body"]["messages"][0]["content"]
    marker = MARKER_PATTERN.match(first)
    assert "cache_salt" in sent[0]["body"] and marker is not None and first == f"{marker.group()}\nhi"
    # As on Workers AI: a prompt is templated as a user turn, unless `raw`; without max_tokens, 256 tokens.
    assert sent[1]["path"] == "/v1/chat/completions" and sent[1]["body"]["messages"][-1]["content"].endswith("Once")
    assert sent[2]["path"] == "/v1/completions" and sent[2]["body"]["max_tokens"] == 256


async def test_workers_style_tools_go_upstream_as_openai_tools(
    client: httpx.AsyncClient, gateway_url: str, sim_url: str
) -> None:
    weather = {"name": "weather", "description": "The weather in a city", "parameters": {"type": "object"}}
    body = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [weather], "max_tokens": 3}
    answer = await client.post(f"{gateway_url}{RUN}", json=body, headers=auth())
    assert answer.status_code == 200, answer.text
    assert forwarded(sim_url)[0]["body"]["tools"] == [{"type": "function", "function": weather}]


COUNTRY = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}


async def test_json_mode_runs_as_the_engines_named_schema_and_an_answer_not_json_is_unmet(
    client: httpx.AsyncClient, module_gateway: str, shared_sim: str
) -> None:
    """Workers AI's JSON mode gives the schema itself; the engine (vLLM) takes it named. The simulator answers
    words, never JSON: the documented error, "JSON Mode couldn't be met"."""
    asked = {"type": "json_schema", "json_schema": COUNTRY}

    async def unmet() -> float:
        exposition = (await client.get(f"{module_gateway}/metrics")).text
        return metric(exposition, "bulkhead_requests_total", route="chat", status="422")

    before = await unmet()
    answer = await client.post(
        f"{module_gateway}{RUN}", json={"prompt": "Tell me about India.", "response_format": asked}, headers=auth()
    )
    assert answer.status_code == 422, answer.text
    body = answer.json()
    assert body["success"] is False and body["result"] is None
    [error] = body["errors"]
    assert (error["code"], error["type"]) == (8007, "json_mode_unmet")
    assert error["message"].startswith("JSON Mode couldn't be met") and "max_tokens" not in error["message"]
    cut = await client.post(
        f"{module_gateway}{RUN}",
        json={"prompt": "x", "response_format": {"type": "json_object"}, "max_tokens": 2},
        headers=auth(),
    )
    assert cut.status_code == 422 and "max_tokens" in cut.json()["errors"][0]["message"]
    assert await unmet() == before + 2  # the metric (and the access log) say what the client got
    sent = [record["body"]["response_format"] for record in forwarded(shared_sim)]
    assert sent == [
        {"type": "json_schema", "json_schema": {"name": "json_mode", "schema": COUNTRY}},
        {"type": "json_object"},
    ]


def _rendered(content: str, json_mode: bool = True) -> Any:
    choice = {"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}
    usage = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
    response = workers_answer(Answer(200, {"choices": [choice], "usage": usage}), json_mode)
    return orjson.loads(response.body)


def test_json_modes_response_is_the_parsed_json_unless_decoding_could_reveal_what_the_scan_did_not_see() -> None:
    assert _rendered('{"name": "India", "capital": "New Delhi"}')["result"]["response"] == {
        "name": "India",
        "capital": "New Delhi",
    }
    assert _rendered("[1, 2]")["result"]["response"] == [1, 2]
    assert _rendered('{"name": "India"}', json_mode=False)["result"]["response"] == '{"name": "India"}'
    # As a tool call's arguments: a \u escape, or JSON deeper than 64 levels, stays the text that was scanned.
    escaped = '{"name": "\\u0043NRY"}'
    assert _rendered(escaped)["result"]["response"] == escaped
    deep = "[" * 70 + "]" * 70
    assert _rendered(deep)["result"]["response"] == deep
    unmet = _rendered('{"name": "Ind')
    assert unmet["success"] is False and unmet["errors"][0]["code"] == 8007


async def test_temperature_and_top_p_take_workers_ais_ranges_and_run_in_the_engines(
    client: httpx.AsyncClient, module_gateway: str, shared_sim: str
) -> None:
    sent: list[tuple[Any, Any]] = []
    for temperature, top_p in ((4.5, 1.7), (0, 0), (0.7, 0.9), (5, 2)):
        body = {"prompt": "x", "max_tokens": 1, "temperature": temperature, "top_p": top_p}
        answer = await client.post(f"{module_gateway}{RUN}", json=body, headers=auth())
        assert answer.status_code == 200, answer.text
        record = forwarded(shared_sim)[-1]["body"]
        sent.append((record["temperature"], record["top_p"]))
    assert sent == [(2, 1), (0, 0.001), (0.7, 0.9), (2, 1)]
    for field, value in (("temperature", 5.5), ("top_p", 2.1), ("top_p", -1)):
        refused = await client.post(f"{module_gateway}{RUN}", json={"prompt": "x", field: value}, headers=auth())
        assert refused.status_code == 400 and refused.json()["errors"][0]["source"] == {"pointer": f"/{field}"}
    assert len(forwarded(shared_sim)) == 4
    # /v1 keeps OpenAI's ranges.
    openai_side = await client.post(
        f"{module_gateway}/v1/chat/completions", json={**chat_body(), "temperature": 4.5}, headers=auth()
    )
    assert openai_side.status_code == 400


def test_a_tool_call_is_rendered_as_workers_ai_renders_it() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}
    broken = {"id": "c2", "type": "function", "function": {"name": "weather", "arguments": "{not json"}}
    message = {"role": "assistant", "content": None, "tool_calls": [call, broken]}
    usage = {"prompt_tokens": 5, "completion_tokens": 2, "total_tokens": 7}
    assert workers_result({"choices": [{"index": 0, "message": message}], "usage": usage}) == {
        "response": "",
        "tool_calls": [
            {"name": "weather", "arguments": {"city": "Paris"}},
            {"name": "weather", "arguments": "{not json"},
        ],
        "usage": usage,
    }


async def test_errors_come_in_the_envelope(client: httpx.AsyncClient, gateway_url: str, sim_url: str) -> None:
    other_account = await client.post(
        f"{gateway_url}/accounts/bob/ai/run/{MODEL}", json={"prompt": "x"}, headers=auth(ALICE_KEY)
    )
    assert other_account.status_code == 403
    assert other_account.json()["success"] is False
    bad = await client.post(f"{gateway_url}{RUN}", json={"prompt": "x", "max_tokens": 0}, headers=auth())
    assert bad.status_code == 400
    assert bad.json()["success"] is False and "max_tokens" in bad.json()["errors"][0]["message"]
    neither = await client.post(f"{gateway_url}{RUN}", json={"max_tokens": 3}, headers=auth())
    assert neither.status_code == 400 and neither.json()["errors"][0]["code"] == 3003
    assert forwarded(sim_url) == []


async def test_run_streams_response_lines(client: httpx.AsyncClient, gateway_url: str) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
    async with client.stream("POST", f"{gateway_url}{RUN}", json=body, headers=auth()) as response:
        text = (await response.aread()).decode()
    events = [e.removeprefix("data: ") for e in text.split("\n\n") if e]
    assert events[-1] == "[DONE]"
    lines = [orjson.loads(e) for e in events[:-1]]
    assert all(set(line) <= {"response", "usage"} for line in lines)
    assert len([line for line in lines if line["response"]]) == 4
    # As Workers AI's streams end: an empty response with the usage, then [DONE].
    assert lines[-1]["response"] == "" and lines[-1]["usage"]["completion_tokens"] == 4


async def wait_done(client: httpx.AsyncClient, url: str, key: str, timeout: float = 30) -> dict[str, Any]:
    """Poll a queued request (GET) until it is finished; its `responses` and `usage`."""
    deadline = time.monotonic() + timeout
    while True:
        polled = (await client.get(url, headers=auth(key))).json()
        if "responses" in polled["result"]:
            result: dict[str, Any] = polled["result"]
            return result
        assert polled["result"]["status"] in ("queued", "running"), polled
        assert time.monotonic() < deadline, polled
        await asyncio.sleep(0.1)


async def test_queued_batch_in_memory(client: httpx.AsyncClient, gateway_url: str, sim_url: str) -> None:
    batch = {"requests": [{"prompt": f"item {n}", "max_tokens": 2} for n in range(3)]}
    accepted = await client.post(f"{gateway_url}{RUN}?queueRequest=true", json=batch, headers=auth())
    assert accepted.status_code == 200
    request_id = accepted.json()["result"]["request_id"]
    assert accepted.json()["result"] == {"status": "queued", "request_id": request_id, "model": MODEL}
    poll = f"{gateway_url}{RUN}/requests/{request_id}"
    done = await wait_done(client, poll, ALICE_KEY)
    assert [r["success"] for r in done["responses"]] == [True, True, True]
    assert all(r["result"]["usage"]["completion_tokens"] == 2 for r in done["responses"])
    assert done["usage"]["completion_tokens"] == 6
    assert len(forwarded(sim_url)) == 3
    # Tenant-scoped: another tenant gets 404 (not 403) on both surfaces.
    assert (
        await client.get(f"{gateway_url}/accounts/bob/ai/run/{MODEL}/requests/{request_id}", headers=auth(BOB_KEY))
    ).status_code == 404
    assert (await client.get(f"{gateway_url}/v1/requests/{request_id}", headers=auth(BOB_KEY))).status_code == 404
    openai_side = (await client.get(f"{gateway_url}/v1/requests/{request_id}", headers=auth())).json()
    assert openai_side["status"] == "done" and len(openai_side["results"]) == 3


async def test_a_bad_item_refuses_the_whole_batch(client: httpx.AsyncClient, gateway_url: str, sim_url: str) -> None:
    batch = {"queueRequest": True, "requests": [{"prompt": "ok"}, {"prompt": "bad", "max_tokens": -1}]}
    refused = await client.post(f"{gateway_url}{RUN}", json=batch, headers=auth())
    assert refused.status_code == 400 and refused.json()["success"] is False
    await assert_only_a_later_job_ran(client, gateway_url, sim_url)


async def assert_only_a_later_job_ran(client: httpx.AsyncClient, gateway_url: str, sim_url: str) -> None:
    """The witness that nothing alice sent before reached the engine: a job of hers queued now, done, is all it got.
    The gateway's one queue worker takes a tenant's jobs in the order they came: one queued before would have run
    first."""
    after = await client.post(f"{gateway_url}{RUN}?queueRequest=true", json={"prompt": "after"}, headers=auth())
    await wait_done(client, f"{gateway_url}{RUN}/requests/{after.json()['result']['request_id']}", ALICE_KEY)
    [only] = forwarded(sim_url)
    assert only["body"]["messages"][-1]["content"].endswith("after"), only


def queue_config(redis_url: str, sim_url: str, tokenizer_dir: Path, **extra: Any) -> dict[str, Any]:
    """Settings for a gateway with Redis in front of one simulator, tenant alice (limits and queue in `extra`)."""
    limits = extra.pop("limits", {})
    return {
        "redis_url": redis_url,
        "backends": [{"name": "sim", "url": sim_url}],
        "models": [{"name": MODEL, "backends": ["sim"], "tokenizer": str(tokenizer_dir)}],
        "tenants": [{"id": "alice", "key_hashes": [hash_key(ALICE_KEY)], "limits": limits}],
        **extra,
    }


def worker_process(config: Path, log: Path | None = None) -> subprocess.Popen[bytes]:
    """`bulkhead worker` on that config; `log=path` keeps its log (stderr) in that file."""
    with open(log or os.devnull, "wb") as stderr:
        return subprocess.Popen(
            [sys.executable, "-m", "gateway", "worker", "--config", str(config), "--workers", "1"],
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )


def stopped(process: subprocess.Popen[bytes]) -> bool:
    """SIGTERM, then whether it exited within 10 s; one that did not is killed, never left to outlive the test."""
    if process.poll() is not None:
        return True
    process.terminate()
    try:
        process.wait(timeout=10)
        return True
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        return False


async def test_a_killed_worker_leaves_its_job_to_another(
    client: httpx.AsyncClient, make_gateway_process: Any, make_sim: Any, tokenizer_dir: Path, tmp_path: Path
) -> None:
    sim_url = make_sim(ttft_ms=700)
    # A Redis of the test's own: another test's workers on a shared one could take this job.
    with own_redis() as server:
        config = queue_config(server.url, sim_url, tokenizer_dir, queue={"workers": 0, "reclaim_after_s": 1.0})
        gateway_url = make_gateway_process(config)
        config_file = tmp_path / "worker.yaml"
        config_file.write_text(orjson.dumps(config).decode())
        first = worker_process(config_file)
        second: subprocess.Popen[bytes] | None = None
        try:
            batch = {"requests": [{"prompt": f"item {n}", "max_tokens": 2} for n in range(4)]}
            accepted = await client.post(f"{gateway_url}{RUN}?queueRequest=true", json=batch, headers=auth())
            request_id = accepted.json()["result"]["request_id"]
            poll = f"{gateway_url}{RUN}/requests/{request_id}"
            deadline = time.monotonic() + 20
            while (await client.get(poll, headers=auth())).json()["result"]["status"] != "running":
                assert time.monotonic() < deadline, "the first worker never took the job"
                await asyncio.sleep(0.05)
            # Mid-job: the second item has reached the engine, so the first is done and stored.
            await until(lambda: len(forwarded(sim_url)) >= 2, timeout=20, every=0.02)
            first.send_signal(signal.SIGKILL)
            first.wait(timeout=10)
            second = worker_process(config_file)
            done = await wait_done(client, poll, ALICE_KEY, timeout=40)
            assert len(done["responses"]) == 4 and all(r["success"] for r in done["responses"])
            assert len(set(orjson.dumps(r["result"]) for r in done["responses"])) == 4, "exactly one result per item"
            requests = forwarded(sim_url)
            assert 4 <= len(requests) <= 5, "at most the item in flight when the worker died ran twice"
        finally:
            for process in (first, second):
                if process is not None:
                    assert stopped(process), "a queue worker kept running 10 s after SIGTERM"


async def test_redis_restarted_under_load(
    client: httpx.AsyncClient, make_gateway_process: Any, make_sim: Any, tokenizer_dir: Path
) -> None:
    """Every accepted async job completes, and serving goes on through the outage (fail_open)."""
    sim_url = make_sim(ttft_ms=50)
    with own_redis() as server:
        config = queue_config(
            server.url,
            sim_url,
            tokenizer_dir,
            limits={"requests_per_minute": 100000},
            queue={"workers": 1, "reclaim_after_s": 1.0},
            upstream={"health_interval_s": 0.5},
        )
        gateway_url = make_gateway_process(config)
        accepted: list[str] = []
        statuses: list[int] = []

        stop_loading = asyncio.Event()

        async def load(stop: asyncio.Event) -> None:
            n = 0
            while not stop.is_set():
                n += 1
                chat = await client.post(
                    f"{gateway_url}/v1/chat/completions",
                    json={"model": MODEL, "messages": [{"role": "user", "content": f"turn {n}"}], "max_tokens": 2},
                    headers=auth(),
                )
                statuses.append(chat.status_code)
                queued = await client.post(
                    f"{gateway_url}{RUN}?queueRequest=true",
                    json={"prompt": f"job {n}", "max_tokens": 2},
                    headers=auth(),
                )
                if queued.status_code == 200:
                    accepted.append(queued.json()["result"]["request_id"])
                else:
                    assert queued.status_code == 429 and queued.json()["errors"][0]["type"] == "queue_unavailable"

        loader = asyncio.create_task(load(stop_loading))
        await until(lambda: len(accepted) >= 3, timeout=20)  # under load before the outage
        server.stop()
        served, queued = len(statuses), len(accepted)
        await until(lambda: len(statuses) >= served + 5, timeout=20)  # answers while Redis is down
        server.start()
        await until(lambda: len(accepted) >= queued + 3, timeout=30)  # and jobs queued once it is back
        stop_loading.set()
        await loader
        assert statuses and set(statuses) == {200}, "serving went on while Redis was down"
        assert len(accepted) > 5
        for request_id in accepted:
            done = await wait_done(client, f"{gateway_url}{RUN}/requests/{request_id}", ALICE_KEY, timeout=30)
            assert done["responses"][0]["success"] is True


async def test_a_live_worker_keeps_its_long_job(
    client: httpx.AsyncClient, make_gateway_process: Any, make_sim: Any, tokenizer_dir: Path
) -> None:
    """A job running longer than reclaim_after_s is not taken over while its worker is alive: no item runs twice."""
    sim_url = make_sim(ttft_ms=600)
    with own_redis() as server:
        config = queue_config(server.url, sim_url, tokenizer_dir, queue={"workers": 2, "reclaim_after_s": 1.0})
        gateway_url = make_gateway_process(config)
        batch = {"requests": [{"prompt": f"slow item {n}", "max_tokens": 2} for n in range(4)]}
        accepted = await client.post(f"{gateway_url}{RUN}?queueRequest=true", json=batch, headers=auth())
        request_id = accepted.json()["result"]["request_id"]
        done = await wait_done(client, f"{gateway_url}{RUN}/requests/{request_id}", ALICE_KEY, timeout=30)
        assert [r["success"] for r in done["responses"]] == [True] * 4
        # Taken over, the job would have been started again (gateway/jobs/queue.py counts each start in its hash),
        # and its items still to run sent again: a second worker's claim can come no later than the job's end.
        store = redis.Redis.from_url(server.url)
        assert store.hget(f"bulkhead:job:alice:{request_id}", "attempts") == b"1"
        store.close()
        assert len(forwarded(sim_url)) == 4
