"""Background responses (`background: true`, issue 46): answered at once as `queued`, run from the durable queue by
a worker, polled by id until they finish, cancellable while pending; in memory and on Redis, through the `openai`
SDK's `client.responses`."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest

from tests.integration.support import ALICE_KEY, BOB_KEY, MODEL, auth, forwarded
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
        time.sleep(2.0)  # the running one's engine answers meanwhile; a worker asks before running the other
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


@pytest.mark.parametrize(
    ("extra", "param"),
    [({"stream": True}, "stream"), ({"store": False}, "background")],
    ids=["streamed", "unstored"],
)
def test_a_background_response_that_could_not_be_read_back_is_refused_before_anything_is_queued(
    make_gateway: Any, sim_url: str, extra: dict[str, Any], param: str
) -> None:
    gateway_url = make_gateway({"sim": sim_url})
    body = {"model": MODEL, "input": "Hello", "background": True, **extra}
    refused = httpx.post(f"{gateway_url}{RESPONSES}", json=body, headers=auth())
    assert refused.status_code == 400 and refused.json()["error"]["param"] == param
    time.sleep(0.3)
    assert forwarded(sim_url) == []
