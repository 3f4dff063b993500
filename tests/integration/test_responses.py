"""OpenAI's Responses API through the gateway, with the `openai` SDK's `client.responses` and only its base URL
changed: every defence a chat completion has, the Responses API's shapes out, bad input refused and never forwarded."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import orjson
import pytest
from openai.types.responses import ResponseIncompleteEvent

from isolation.markers import MARKER_PATTERN
from tests.integration.support import (
    ALICE_KEY,
    BOB_KEY,
    MODEL,
    OVER_CAPACITY,
    after_alices_confidential_prompt,
    auth,
    chat_body,
    forwarded,
    sent_marker,
    shows_marker,
)
from tests.redis_server import redis_server

RESPONSES = "/v1/responses"


@pytest.fixture
def sdk(module_gateway: str) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{module_gateway}/v1", api_key=ALICE_KEY, max_retries=0) as client:
        yield client


def test_a_response_goes_through_every_defence_as_a_chat_completion(
    sdk: openai.OpenAI, module_gateway: str, shared_sim: str
) -> None:
    answer = sdk.responses.create(model=MODEL, input="Name a colour.", instructions="Be terse.", max_output_tokens=4)
    assert answer.object == "response" and answer.model == MODEL and sdk.responses.retrieve(answer.id).id == answer.id
    assert answer.status == "incomplete" and answer.incomplete_details is not None
    assert answer.output_text and answer.usage is not None and answer.usage.output_tokens == 4
    [sent] = forwarded(shared_sim)
    assert sent["path"] == "/v1/chat/completions"
    body = sent["body"]
    marker = MARKER_PATTERN.match(body["messages"][0]["content"])
    assert marker is not None and "Be terse." in body["messages"][0]["content"], "the marker starts the system text"
    assert body["cache_salt"] and "previous_response_id" not in body and "store" not in body
    assert not shows_marker(answer.model_dump_json(), marker.group())
    chat = httpx.post(
        f"{module_gateway}/v1/chat/completions",
        json={
            **chat_body("Name a colour.", max_tokens=1),
            "messages": [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Name a colour."}],
        },
        headers=auth(),
    ).json()
    # One more: vLLM's own Responses route encodes the prompt with the tokenizer's BOS on top of the template's.
    assert answer.usage.input_tokens == chat["usage"]["prompt_tokens"] + 1
    assert body["add_special_tokens"] is True


def test_a_stream_comes_as_the_responses_events(sdk: openai.OpenAI) -> None:
    with sdk.responses.stream(model=MODEL, input=[{"role": "user", "content": "Hi"}], max_output_tokens=32) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds.count("response.output_text.delta") == 16 and kinds[-1] == "response.completed"
    assert final.status == "completed" and final.usage is not None and final.usage.output_tokens == 16
    numbers = []
    with httpx.stream(
        "POST",
        f"{sdk.base_url}responses",
        json={"model": MODEL, "input": "Hi", "stream": True, "max_output_tokens": 2},
        headers=auth(),
    ) as raw:
        for line in raw.iter_lines():
            if line.startswith("data: "):
                numbers.append(orjson.loads(line[6:])["sequence_number"])
    assert numbers == list(range(len(numbers)))


def test_a_stream_cut_off_by_max_output_tokens_ends_in_response_incomplete(sdk: openai.OpenAI) -> None:
    with sdk.responses.stream(model=MODEL, input="Hi", max_output_tokens=5) as stream:
        sent = list(stream)
        # The current specification's end for it: the SDK's get_final_response waits for response.completed, which
        # a cut-off answer does not send (as against OpenAI itself; docs/api.md).
        with pytest.raises(RuntimeError, match="response.completed"):
            stream.get_final_response()
    kinds = [event.type for event in sent]
    assert kinds.count("response.output_text.delta") == 5 and "response.completed" not in kinds
    end = sent[-1]
    assert isinstance(end, ResponseIncompleteEvent) and end.response.status == "incomplete"
    assert end.response.incomplete_details is not None and end.response.incomplete_details.reason == "max_output_tokens"
    assert end.response.usage is not None and end.response.usage.output_tokens == 5
    assert sdk.responses.retrieve(end.response.id).output_text == end.response.output_text, "stored as it ended"


def test_function_calls_and_their_outputs_go_as_chat_tools(sdk: openai.OpenAI, shared_sim: str) -> None:
    tools: Any = [{"type": "function", "name": "weather", "parameters": {"type": "object", "properties": {}}}]
    items: Any = [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": "c1", "name": "weather", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "weather", "arguments": '{"d": 1}'},
        {"type": "function_call_output", "call_id": "c1", "output": "Sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": "Rain"},
    ]
    sdk.responses.create(model=MODEL, input=items, tools=tools, tool_choice="auto", max_output_tokens=2)
    body = forwarded(shared_sim)[-1]["body"]
    assert body["tools"][0]["function"]["name"] == "weather" and body["tool_choice"] == "auto"
    assert [m["role"] for m in body["messages"]][-4:] == ["user", "assistant", "tool", "tool"]
    assert [c["id"] for c in body["messages"][-3]["tool_calls"]] == ["c1", "c2"]


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"model": MODEL, "input": "x", "previous_response_id": "resp_abc"}, "previous_response_id"),
        ({"model": MODEL, "input": "x", "previous_response_id": "r" * 129}, "previous_response_id"),
        ({"model": MODEL, "input": "x", "bogus": 1}, "bogus"),
        ({"model": MODEL}, "input"),
        ({"model": MODEL, "input": []}, "input"),
        ({"model": MODEL, "input": "x", "background": "yes"}, "background"),
        ({"model": MODEL, "input": "x", "include": ["message.output_text.bogus"]}, "include"),
        (
            {"model": MODEL, "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input",
        ),
        ({"model": MODEL, "input": "x", "tools": [{"type": "web_search"}]}, "tools"),
        ({"model": MODEL, "input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"model": MODEL, "input": "x", "text": {"format": {"type": "json_schema"}}}, "text.format"),
        ({"model": MODEL, "input": "x", "context_management": [{"type": "compaction"}]}, "context_management"),
        (
            {"model": MODEL, "input": [{"type": "reasoning", "content": [{"type": "reasoning_text", "text": 5}]}]},
            "input",
        ),
        ({"model": "nope", "input": "x"}, "nope"),
    ],
)
def test_bad_requests_are_refused_in_openais_shape_and_never_forwarded(
    module_gateway: str, shared_sim: str, body: dict[str, Any], says: str
) -> None:
    response = httpx.post(f"{module_gateway}{RESPONSES}", json=body, headers=auth())
    assert 400 <= response.status_code < 500, response.text
    error = response.json()["error"]
    assert says in error["message"] or says == error["param"], error
    assert forwarded(shared_sim) == []


@pytest.mark.parametrize("stream", [False, True])
def test_another_tenants_marker_in_a_response_is_withheld(
    make_gateway: Any, make_sim: Any, tokenizer_dir: Path, stream: bool
) -> None:
    gateway_url, sim = after_alices_confidential_prompt(make_gateway, make_sim, tokenizer_dir)
    over = {
        "model": MODEL,
        "max_output_tokens": 64,
        "stream": stream,
        "input": OVER_CAPACITY,
    }
    with httpx.stream("POST", f"{gateway_url}{RESPONSES}", json=over, headers=auth(BOB_KEY)) as response:
        text = response.read().decode()
    assert not shows_marker(text, sent_marker(forwarded(sim)[0]))
    assert "merger" not in text and "alice" not in text
    if stream:
        assert "event: error" in text and "response.failed" in text and "response.completed" not in text
    else:
        assert response.status_code == 502 and response.json()["error"]["code"] == "answer_withheld"


def user_texts(body: dict[str, Any]) -> list[str]:
    return [str(message["content"]) for message in body["messages"] if message["role"] in ("user", "assistant")]


def test_a_conversation_goes_on_from_a_stored_response_with_its_whole_history_sent(
    sdk: openai.OpenAI, shared_sim: str
) -> None:
    first = sdk.responses.create(model=MODEL, input="My name is Ada.", instructions="Be terse.", max_output_tokens=3)
    assert first.previous_response_id is None
    second = sdk.responses.create(
        model=MODEL, input="What is my name?", previous_response_id=first.id, max_output_tokens=3
    )
    assert second.previous_response_id == first.id and second.id != first.id
    sent = forwarded(shared_sim)[-1]["body"]
    # Stateless upstream: the whole conversation each time, the earlier turn's instructions not carried (OpenAI's
    # rule), and nothing of the stored state's ids.
    texts = user_texts(sent)
    assert any("My name is Ada." in text for text in texts) and any("What is my name?" in text for text in texts)
    assert first.output_text in texts
    assert "Be terse." not in orjson.dumps(sent).decode()
    assert "previous_response_id" not in sent and "store" not in sent and first.id not in orjson.dumps(sent).decode()
    assert sdk.responses.retrieve(first.id).model_dump() == first.model_dump()
    items = list(sdk.responses.input_items.list(second.id, order="asc", limit=1))  # a page at a time
    assert [(item.type, getattr(item, "role", None)) for item in items] == [
        ("message", "user"),
        ("message", "assistant"),
        ("message", "user"),
    ]
    assert [part.text for item in items for part in getattr(item, "content", [])] == [
        "My name is Ada.",
        first.output_text,
        "What is my name?",
    ]
    assert len({item.id for item in items}) == 3
    newest = sdk.responses.input_items.list(second.id, limit=2)
    assert [item.id for item in newest.data] == [items[2].id, items[1].id] and newest.has_more


def test_a_streamed_response_is_stored_before_the_client_hears_it_is_complete(sdk: openai.OpenAI) -> None:
    with sdk.responses.stream(model=MODEL, input="Hi", max_output_tokens=32) as stream:
        for event in stream:
            if event.type == "response.completed":
                # Still inside the stream: the next turn may name it at once.
                assert sdk.responses.retrieve(event.response.id).output_text == event.response.output_text
        final = stream.get_final_response()
    follow = sdk.responses.create(model=MODEL, input="More", previous_response_id=final.id, max_output_tokens=1)
    assert follow.previous_response_id == final.id


def error_of(response: httpx.Response, name: str) -> tuple[int, dict[str, Any]]:
    error = response.json()["error"]
    return response.status_code, {**error, "message": error["message"].replace(name, "ID")}


def test_a_response_is_its_tenants_alone_and_another_tenants_id_reads_as_unknown(
    sdk: openai.OpenAI, module_gateway: str, shared_sim: str
) -> None:
    kept = sdk.responses.create(model=MODEL, input="My secret is 42.", max_output_tokens=2)
    unknown = "resp_" + "0" * 48
    too_long = httpx.get(f"{module_gateway}{RESPONSES}/{'r' * 129}", headers=auth())
    assert too_long.status_code == 404 and too_long.json()["error"]["code"] == "response_not_found"

    def every_route(key: str, name: str) -> list[tuple[int, dict[str, Any]]]:
        base, headers = f"{module_gateway}{RESPONSES}", auth(key)
        answers = [
            httpx.get(f"{base}/{name}", headers=headers),
            httpx.get(f"{base}/{name}/input_items", headers=headers),
            httpx.post(f"{base}/{name}/cancel", headers=headers),
            httpx.delete(f"{base}/{name}", headers=headers),
            httpx.post(base, json={"model": MODEL, "input": "?", "previous_response_id": name}, headers=headers),
        ]
        return [error_of(answer, name) for answer in answers]

    before = len(forwarded(shared_sim))
    bobs = every_route(BOB_KEY, kept.id)
    assert [status for status, _ in bobs] == [404] * 5
    assert bobs == every_route(BOB_KEY, unknown) == every_route(ALICE_KEY, unknown)
    assert "42" not in orjson.dumps(bobs).decode() and len(forwarded(shared_sim)) == before
    assert sdk.responses.retrieve(kept.id).id == kept.id  # bob's delete deleted nothing


def test_a_deleted_or_unstored_response_is_gone_and_so_is_the_conversation_after_it(
    sdk: openai.OpenAI, module_gateway: str
) -> None:
    first = sdk.responses.create(model=MODEL, input="One", max_output_tokens=1)
    second = sdk.responses.create(model=MODEL, input="Two", previous_response_id=first.id, max_output_tokens=1)
    cancel = httpx.post(f"{module_gateway}{RESPONSES}/{second.id}/cancel", headers=auth())
    assert cancel.status_code == 400 and cancel.json()["error"]["code"] == "not_cancellable"
    deleted = httpx.delete(f"{module_gateway}{RESPONSES}/{first.id}", headers=auth())
    assert deleted.json() == {"id": first.id, "object": "response.deleted", "deleted": True}
    for gone in (
        httpx.get(f"{module_gateway}{RESPONSES}/{first.id}", headers=auth()),
        httpx.post(
            f"{module_gateway}{RESPONSES}",
            json={"model": MODEL, "input": "Three", "previous_response_id": second.id},
            headers=auth(),
        ),
    ):
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "response_not_found"
    unstored = sdk.responses.create(model=MODEL, input="Once", store=False, max_output_tokens=1)
    with pytest.raises(openai.NotFoundError):
        sdk.responses.retrieve(unstored.id)


@pytest.mark.parametrize(
    ("path", "says"),
    [
        ("/{id}?stream=true", "stream"),
        ("/{id}?starting_after=3", "starting_after"),
        ("/{id}?include=everything", "include"),
        ("/{id}/input_items?limit=0", "limit"),
        ("/{id}/input_items?limit=101", "limit"),
        ("/{id}/input_items?order=up", "order"),
        ("/{id}/input_items?limit=²", "limit"),
        ("/{id}/input_items?limit=" + "9" * 5000, "limit"),
        ("/{id}/input_items?after=msg_nope", "after"),
    ],
)
def test_bad_reads_of_a_stored_response_are_refused(
    sdk: openai.OpenAI, module_gateway: str, path: str, says: str
) -> None:
    kept = sdk.responses.create(model=MODEL, input="Hi", max_output_tokens=1)
    answer = httpx.get(f"{module_gateway}{RESPONSES}{path.format(id=kept.id)}", headers=auth())
    assert answer.status_code == 400 and answer.json()["error"]["param"] == says, answer.text


def test_instances_on_one_redis_share_conversations(make_gateway: Any, sim_url: str) -> None:
    with redis_server() as redis_url:
        shared = {"redis_url": redis_url, "redis_key_prefix": f"t-{uuid.uuid4().hex[:8]}:"}
        one, other = (make_gateway({"sim": sim_url}, **shared) for _ in range(2))
        with (
            openai.OpenAI(base_url=f"{one}/v1", api_key=ALICE_KEY, max_retries=0) as first_client,
            openai.OpenAI(base_url=f"{other}/v1", api_key=ALICE_KEY, max_retries=0) as second_client,
        ):
            first = first_client.responses.create(model=MODEL, input="My name is Ada.", max_output_tokens=2)
            second = second_client.responses.create(
                model=MODEL, input="And mine?", previous_response_id=first.id, max_output_tokens=2
            )
            assert first.output_text in user_texts(forwarded(sim_url)[-1]["body"])
            assert first_client.responses.retrieve(second.id).previous_response_id == first.id


def test_an_error_about_the_translated_request_names_the_clients_own_fields(
    module_gateway: str, shared_sim: str
) -> None:
    over_cap = httpx.post(
        f"{module_gateway}{RESPONSES}",
        json={"model": MODEL, "input": "Hi", "max_output_tokens": 65},  # bob may ask 64
        headers=auth(BOB_KEY),
    ).json()["error"]
    assert over_cap["param"] == "max_output_tokens" and over_cap["message"].startswith("max_output_tokens is 65")
    too_long = httpx.post(
        f"{module_gateway}{RESPONSES}",
        json={"model": MODEL, "input": [{"role": "user", "content": OVER_CAPACITY * 3}], "max_output_tokens": 8},
        headers=auth(),
    ).json()["error"]
    assert too_long["code"] == "context_length_exceeded" and too_long["param"] == "input", too_long
    assert "max_tokens" not in too_long["message"] and "max_output_tokens" in too_long["message"]
    assert forwarded(shared_sim) == []


def test_a_conversation_is_bounded_in_turns_and_in_bytes(make_gateway: Any, sim_url: str) -> None:
    gateway = make_gateway({"sim": sim_url}, responses={"max_turns": 2}, limits={"max_body_bytes": 2048})
    with openai.OpenAI(base_url=f"{gateway}/v1", api_key=ALICE_KEY, max_retries=0) as client:
        first = client.responses.create(model=MODEL, input="One", max_output_tokens=1)
        second = client.responses.create(model=MODEL, input="Two", previous_response_id=first.id, max_output_tokens=1)
        with pytest.raises(openai.BadRequestError, match="responses.max_turns"):
            client.responses.create(model=MODEL, input="Three", previous_response_id=second.id, max_output_tokens=1)
        big = client.responses.create(model=MODEL, input="x " * 900, max_output_tokens=1)
        with pytest.raises(openai.APIStatusError) as refused:
            client.responses.create(model=MODEL, input="More", previous_response_id=big.id, max_output_tokens=1)
    assert refused.value.status_code == 413 and refused.value.body["param"] is None  # type: ignore[index]
