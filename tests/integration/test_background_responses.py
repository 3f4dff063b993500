"""Background responses (`background: true`, issue 46): answered at once as `queued`, run from the durable queue by
a worker, polled by id until they finish, cancellable while pending (a running one stopped in the engine, and
charged what it generated), their events streamed and resumed from any of them; in memory and on Redis (across two
instances), through the `openai` SDK's `client.responses`."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import openai
import orjson
import pytest

from gateway.tenancy.tenants import hash_key
from tests.integration.support import ALICE_KEY, BOB_KEY, MODEL, auth, forwarded, metric
from tests.redis_server import redis_server

RESPONSES = "/v1/responses"


@pytest.fixture(params=["memory", "redis"])
def state(request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    """Where the queue and the stored responses are kept: this process, or a Redis shared by instances."""
    if request.param == "memory":
        yield {}
        return
    with redis_server() as url:
        yield {"redis_url": url, "redis_key_prefix": f"t-{uuid.uuid4().hex[:8]}:"}


def sdk(gateway_url: str, key: str = ALICE_KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway_url}/v1", api_key=key, max_retries=0)


def instances(make_gateway: Any, backends: dict[str, str], state: dict[str, Any], **settings: Any) -> tuple[str, str]:
    """Two instances over one Redis, or the one instance that holds the memory state twice."""
    first = make_gateway(backends, **state, **settings)
    return first, make_gateway(backends, **state, **settings) if state else first


def until(what: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, "not in time"
        time.sleep(0.05)


def scraped(url: str, name: str, **labels: str) -> float:
    return metric(httpx.get(f"{url}/metrics").text, name, **labels)


def sse(raw: bytes) -> list[dict[str, Any]]:
    return [orjson.loads(line[6:]) for line in raw.decode().splitlines() if line.startswith("data: ")]


def until_finished(client: openai.OpenAI, response_id: str, timeout: float = 20.0) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        polled = client.responses.retrieve(response_id)
        if polled.status not in ("queued", "in_progress"):
            return polled
        assert time.monotonic() < deadline, f"still {polled.status}"
        time.sleep(0.05)


def test_a_background_response_is_queued_then_polled_to_its_end_and_continued(
    make_gateway: Any, sim_url: str, state: dict[str, Any]
) -> None:
    gateway_url = make_gateway({"sim": sim_url}, **state)
    with sdk(gateway_url) as client:
        queued = client.responses.create(model=MODEL, input="My name is Ada.", background=True, max_output_tokens=4)
        assert (queued.status, queued.background, queued.output) == ("queued", True, [])
        done = until_finished(client, queued.id)
        assert done.status == "incomplete" and done.output_text and done.usage is not None
        assert done.usage.output_tokens == 4 and done.background is True and done.id == queued.id
        assert client.responses.retrieve(queued.id).model_dump() == done.model_dump(), "stored once, read the same"
        again = client.responses.create(model=MODEL, input="And my name?", previous_response_id=queued.id)
        assert again.status in ("completed", "incomplete")
        items = [item.type for item in client.responses.input_items.list(again.id)]
        assert items.count("message") == 3, "its history: the background turn's input and output, then the new input"
    with sdk(gateway_url, BOB_KEY) as other, pytest.raises(openai.NotFoundError):
        other.responses.retrieve(queued.id)  # another tenant's: no such response
    assert len(forwarded(sim_url)) == 2, "each ran once"


def test_a_pending_background_response_is_cancelled_for_good_and_continues_nothing(
    make_gateway: Any, make_sim: Any, state: dict[str, Any]
) -> None:
    sim_url = make_sim(ttft_ms=1500)  # the first is still running when the rest are asked of it
    gateway_url = make_gateway({"sim": sim_url}, **state)
    with sdk(gateway_url) as client:
        running = client.responses.create(model=MODEL, input="One", background=True, max_output_tokens=2)
        waiting = client.responses.create(model=MODEL, input="Two", background=True, max_output_tokens=2)
        with pytest.raises(openai.BadRequestError, match="is queued|is in_progress"):
            client.responses.create(model=MODEL, input="Three", previous_response_id=waiting.id)
        assert client.responses.cancel(waiting.id).status == "cancelled"
        assert client.responses.cancel(running.id).status == "cancelled"
        time.sleep(2.0)  # its worker stops the running one meanwhile; a worker asks before running the other
        assert client.responses.retrieve(running.id).status == "cancelled", "no worker stores over a cancellation"
        assert client.responses.retrieve(waiting.id).status == "cancelled"
        with pytest.raises(openai.BadRequestError, match="is cancelled"):
            client.responses.create(model=MODEL, input="Three", previous_response_id=running.id)
        answered = client.responses.create(model=MODEL, input="Now", max_output_tokens=1)
        with pytest.raises(openai.BadRequestError) as refused:
            client.responses.cancel(answered.id)
        assert refused.value.code == "not_cancellable"
    asked = [record["body"]["messages"][-1]["content"].rsplit("\n", 1)[-1] for record in forwarded(sim_url)]
    assert "One" in asked and "Two" not in asked, "the one cancelled while queued never ran"


def test_an_unstored_background_response_is_refused_before_anything_is_queued(make_gateway: Any, sim_url: str) -> None:
    gateway_url = make_gateway({"sim": sim_url})
    body = {"model": MODEL, "input": "Hello", "background": True, "store": False}
    refused = httpx.post(f"{gateway_url}{RESPONSES}", json=body, headers=auth())
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "background"
    time.sleep(0.3)
    assert forwarded(sim_url) == []


TOKENS_PER_MINUTE = 1200  # room for one story's reservation (its prompt and 400 tokens), refilled 20 a second


def test_cancelling_a_running_background_response_stops_its_engine_and_charges_what_it_generated(
    make_gateway: Any, make_sim: Any, state: dict[str, Any]
) -> None:
    sim = make_sim(tokens_per_s=40, output_tokens=400)  # 10 s for the whole answer
    limits = {"tokens_per_minute": TOKENS_PER_MINUTE}
    tenants = [{"id": "alice", "key_hashes": [hash_key(ALICE_KEY)], "limits": limits}]
    first, other = instances(make_gateway, {"sim": sim}, state, tenants=tenants)
    with sdk(first) as client, sdk(other) as elsewhere:
        story = client.responses.create(model=MODEL, input="A long story.", background=True, max_output_tokens=400)
        until(lambda: client.responses.retrieve(story.id).status == "in_progress")
        until(lambda: scraped(sim, "vllm:num_requests_running") == 1)
        time.sleep(1.0)  # some 40 tokens into its 400
        # With Redis, asked of another instance than, maybe, the one whose worker runs it.
        assert elsewhere.responses.cancel(story.id).status == "cancelled"
        asked = time.monotonic()
        until(
            lambda: metric(httpx.get(f"{sim}/metrics").text, "vllm:request_success_total", finished_reason="abort") == 1
        )
        assert time.monotonic() - asked < 2.0, "the worker noticed within its watch's interval"
        assert client.responses.retrieve(story.id).status == "cancelled"
        generated = scraped(sim, "vllm:generation_tokens_total")
        assert 0 < generated < 200
        # What the engine reported before it stopped is charged, not the 400 tokens reserved for the answer.
        charged = sum(scraped(url, "bulkhead_tokens_total", kind="completion") for url in {first, other})
        assert 0 < charged <= generated
        after = httpx.post(
            f"{first}/v1/chat/completions",
            json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1},
            headers=auth(),
        )
        assert int(after.headers["x-ratelimit-remaining-tokens"]) > TOKENS_PER_MINUTE - 200
        # The worker is free: the next one runs to its end.
        next_one = client.responses.create(model=MODEL, input="Hi", background=True, max_output_tokens=4)
        assert until_finished(client, next_one.id).status == "incomplete"


def test_one_stopped_before_the_engine_said_anything_is_charged_its_prompt_alone(
    make_gateway: Any, make_sim: Any
) -> None:
    sim = make_sim(ttft_ms=3000)  # the engine reads the prompt for 3 s
    limits = {"tokens_per_minute": TOKENS_PER_MINUTE}
    gateway_url = make_gateway(
        {"sim": sim}, tenants=[{"id": "alice", "key_hashes": [hash_key(ALICE_KEY)], "limits": limits}]
    )
    with sdk(gateway_url) as client:
        story = client.responses.create(model=MODEL, input="A long story.", background=True, max_output_tokens=400)
        until(lambda: scraped(sim, "vllm:num_requests_running") == 1)
        assert client.responses.cancel(story.id).status == "cancelled"
        until(lambda: scraped(sim, "vllm:request_success_total", finished_reason="abort") == 1)
    assert scraped(gateway_url, "bulkhead_tokens_total", kind="completion") == 0
    after = httpx.post(
        f"{gateway_url}/v1/chat/completions",
        json={"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1},
        headers=auth(),
    )
    # Its prompt (some 30 tokens with the gateway's marker) and this one's, not the 400 reserved for its answer.
    assert int(after.headers["x-ratelimit-remaining-tokens"]) > TOKENS_PER_MINUTE - 100


def test_a_background_response_is_streamed_and_resumed_after_any_event_from_any_instance(
    make_gateway: Any, sim_url: str, state: dict[str, Any]
) -> None:
    first, other = instances(make_gateway, {"sim": sim_url}, state)
    with sdk(first) as client, sdk(other) as elsewhere:
        streamed = list(client.responses.create(model=MODEL, input="Hello", background=True, stream=True))
        kinds = [event.type for event in streamed]
        assert kinds[:3] == ["response.created", "response.queued", "response.in_progress"]
        assert kinds[-1] == "response.completed" and "response.output_text.delta" in kinds
        assert [event.sequence_number for event in streamed] == list(range(len(streamed)))
        made = streamed[0].response
        assert (made.status, made.background, made.output) == ("queued", True, [])
        final = streamed[-1].response  # type: ignore[union-attr]
        assert elsewhere.responses.retrieve(final.id).model_dump() == final.model_dump(), "what was stored"
        again = list(elsewhere.responses.retrieve(final.id, stream=True))
        assert [event.model_dump() for event in again] == [event.model_dump() for event in streamed]
        resumed = list(elsewhere.responses.retrieve(final.id, stream=True, starting_after=4))
        assert [event.model_dump() for event in resumed] == [event.model_dump() for event in streamed[5:]]
        with elsewhere.responses.stream(response_id=final.id, starting_after=2) as helper:
            assert [event.sequence_number for event in helper][0] == 3
            assert helper.get_final_response().output_text == final.output_text


def test_a_pending_background_responses_stream_waits_with_keepalives_then_ends_as_it_did(
    make_gateway: Any, make_sim: Any
) -> None:
    sim = make_sim(ttft_ms=1500)
    gateway_url = make_gateway({"sim": sim}, responses={"stream_keepalive_s": 0.2})
    body = {"model": MODEL, "input": "Hello", "background": True, "max_output_tokens": 3}
    with httpx.stream("POST", f"{gateway_url}{RESPONSES}", json={**body, "stream": True}, headers=auth()) as raw:
        lines = [line for line in raw.iter_lines() if line and not line.startswith("event: ")]
    assert raw.headers["content-type"].startswith("text/event-stream") and raw.headers["x-request-id"]
    kinds = [orjson.loads(line[6:])["type"] if line.startswith("data: ") else line for line in lines]
    assert kinds[:2] == ["response.created", "response.queued"] and ": keep-alive" in kinds
    assert kinds.index(": keep-alive") < kinds.index("response.output_item.added"), "sent while the engine worked"
    assert kinds[-1] == "response.incomplete", "cut off by max_output_tokens, as the current specification ends it"
    queued = httpx.post(f"{gateway_url}{RESPONSES}", json=body, headers=auth()).json()
    httpx.post(f"{gateway_url}{RESPONSES}/{queued['id']}/cancel", headers=auth()).raise_for_status()
    replayed = sse(httpx.get(f"{gateway_url}{RESPONSES}/{queued['id']}?stream=true", headers=auth()).content)
    assert [event["type"] for event in replayed][:2] == ["response.created", "response.queued"]
    assert replayed[-1]["type"] == "error" and replayed[-1]["code"] == "response_cancelled"


@pytest.mark.parametrize(
    ("query", "param"),
    [("stream=true", "stream"), ("starting_after=3", "starting_after"), ("stream=yes", "stream"),
     ("stream=true&starting_after=-1", "starting_after")],
    ids=["not-background", "without-stream", "not-a-bool", "not-a-number"],
)  # fmt: skip
def test_a_stream_that_cannot_be_made_is_refused(make_gateway: Any, sim_url: str, query: str, param: str) -> None:
    gateway_url = make_gateway({"sim": sim_url})
    answered = httpx.post(f"{gateway_url}{RESPONSES}", json={"model": MODEL, "input": "Hi"}, headers=auth()).json()
    refused = httpx.get(f"{gateway_url}{RESPONSES}/{answered['id']}?{query}", headers=auth())
    assert refused.status_code == 400 and refused.json()["error"]["param"] == param


def test_a_tenant_follows_at_most_its_concurrency_cap_of_streams_at_once(make_gateway: Any, make_sim: Any) -> None:
    sim = make_sim(ttft_ms=1500)
    limits = {"max_concurrent_requests": 1}
    gateway_url = make_gateway(
        {"sim": sim}, tenants=[{"id": "alice", "key_hashes": [hash_key(ALICE_KEY)], "limits": limits}]
    )
    body = {"model": MODEL, "input": "Hello", "background": True, "stream": True, "max_output_tokens": 2}
    with httpx.stream("POST", f"{gateway_url}{RESPONSES}", json=body, headers=auth()) as first:
        lines = first.iter_lines()  # held: a line iterator let go closes the connection
        made = orjson.loads(next(line for line in lines if line.startswith("data: "))[6:])
        refused = httpx.post(f"{gateway_url}{RESPONSES}", json=body, headers=auth())
        assert refused.status_code == 429 and refused.json()["error"]["code"] == "concurrency_limit_exceeded"
        followed = httpx.get(f"{gateway_url}{RESPONSES}/{made['response']['id']}?stream=true", headers=auth())
        assert followed.status_code == 429
        rest = list(lines)
    assert "response.incomplete" in [line for line in rest if line][-1]
    again = httpx.get(f"{gateway_url}{RESPONSES}/{made['response']['id']}?stream=true", headers=auth())
    assert again.status_code == 200 and sse(again.content)[-1]["type"] == "response.incomplete"
    assert len(forwarded(sim)) == 1, "the refused one was never queued"


def test_a_tenant_without_a_concurrency_cap_follows_at_most_the_instances_bound_of_streams(
    make_gateway: Any, make_sim: Any
) -> None:
    """The stored responses' routes take no rate limit: without max_concurrent_requests, a tenant's open follows are
    bounded by responses.max_follows_per_tenant, each holding a connection and a store read a second."""
    sim = make_sim(ttft_ms=1500)
    gateway_url = make_gateway({"sim": sim}, responses={"max_follows_per_tenant": 1})
    body = {"model": MODEL, "input": "Hello", "background": True, "max_output_tokens": 2}
    made = httpx.post(f"{gateway_url}{RESPONSES}", json=body, headers=auth()).json()
    with httpx.stream("GET", f"{gateway_url}{RESPONSES}/{made['id']}?stream=true", headers=auth()) as first:
        lines = first.iter_lines()  # held: a line iterator let go closes the connection
        assert next(line for line in lines if line.startswith("data: "))
        second = httpx.get(f"{gateway_url}{RESPONSES}/{made['id']}?stream=true", headers=auth())
        assert second.status_code == 429, second.text
        assert "responses.max_follows_per_tenant" in second.json()["error"]["message"]
        list(lines)
    again = httpx.get(f"{gateway_url}{RESPONSES}/{made['id']}?stream=true", headers=auth())
    assert again.status_code == 200, "the place is given back when the stream ends"
