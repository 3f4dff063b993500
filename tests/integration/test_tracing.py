"""OpenTelemetry tracing against a real OTLP/HTTP receiver (tests/otlp_receiver.py): a trace per request, its stages'
spans, the engine's call with the traceparent the engine receives (so that vLLM's own spans join the trace), judges,
isolation events, sampling, a client's own traceparent, and no prompt, answer, marker or key in any exported byte.
`pytest -s` prints each trace's span tree."""

from __future__ import annotations

import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from gateway.server.app import create_app
from gateway.server.serving import run_server
from tests.integration.conftest import GatewayFactory
from tests.integration.support import (
    ALICE_KEY,
    BOB_KEY,
    MODEL,
    OVER_CAPACITY,
    after_alices_confidential_prompt,
    auth,
    chat_body,
    forwarded,
    gateway_settings,
    sent_marker,
)
from tests.otlp_receiver import ExportedSpan, OtlpReceiver, otlp_receiver

SHOWN = (
    "http.route",
    "http.response.status_code",
    "gen_ai.operation.name",
    "gen_ai.request.model",
    "gen_ai.request.stream",
    "gen_ai.request.max_tokens",
    "gen_ai.usage.input_tokens",
    "gen_ai.usage.output_tokens",
    "gen_ai.response.time_to_first_chunk",
    "bulkhead.tenant.id",
    "bulkhead.replica",
    "bulkhead.placement.reason",
    "server.port",
    "error.type",
)
HOP = f"chat {MODEL}"


def traced(receiver: OtlpReceiver, **settings: Any) -> dict[str, Any]:
    return {"enabled": True, "endpoint": receiver.url, "export_interval_s": 0.05, **settings}


def traceparents(sim: str) -> list[str]:
    return [record["headers"].get("traceparent", "") for record in forwarded(sim)]


def sampled(flags: str) -> bool:
    return bool(int(flags, 16) & 1)  # W3C's sampled bit (the SDK sets the random-id bit, 2, too)


def finished(count: int) -> Callable[[OtlpReceiver], bool]:
    return lambda receiver: len(receiver.roots()) >= count


def show(receiver: OtlpReceiver, root: ExportedSpan) -> None:
    print(f"\ntrace {root.trace_id}\n{receiver.tree(root, SHOWN)}")


def requests(word: str) -> list[tuple[str, dict[str, Any], dict[str, str]]]:
    """A chat completion, a Responses request and a Messages request, each whole and streamed, all saying `word`."""
    said = f"Tell me a story about the {word}, please."
    found = []
    for stream in (False, True):
        found += [
            ("/v1/chat/completions", chat_body(said, max_tokens=8, stream=stream), auth()),
            ("/v1/responses", {"model": MODEL, "input": said, "max_output_tokens": 8, "stream": stream}, auth()),
            (
                "/v1/messages",
                {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": said}], "stream": stream},
                {"x-api-key": ALICE_KEY},
            ),
        ]
    return found


async def test_each_request_is_a_trace_of_its_stages_and_the_engine_joins_it(
    client: httpx.AsyncClient, make_gateway: GatewayFactory, make_sim: Callable[..., str]
) -> None:
    word = f"axolotl{secrets.token_hex(4)}"
    with otlp_receiver() as receiver:
        sim = make_sim()
        gateway = make_gateway({"sim": sim}, tracing=traced(receiver))
        answers = []
        for path, body, headers in requests(word):
            answer = await client.post(f"{gateway}{path}", json=body, headers=headers)
            assert answer.status_code == 200, answer.text
            answers.append(answer.text)
        await receiver.wait_for(finished(6))
    roots = {root.trace_id: root for root in receiver.roots()}
    assert len(roots) == 6
    for (path, body, _), sent, parent in zip(requests(word), forwarded(sim), traceparents(sim), strict=True):
        version, trace_id, hop_id, flags = parent.split("-")
        root = roots[trace_id]
        show(receiver, root)
        assert version == "00" and sampled(flags), "the engine is told the request is traced"
        assert root.name == f"POST {path}" and root.parent_id == "" and not root.failed
        attributes = root.attributes
        assert attributes["http.route"] == path and attributes["http.response.status_code"] == 200
        assert attributes["gen_ai.operation.name"] == "chat" and attributes["gen_ai.request.model"] == MODEL
        assert attributes["gen_ai.request.stream"] is body["stream"] and attributes["gen_ai.request.max_tokens"] == 8
        assert attributes["gen_ai.usage.input_tokens"] > 0 and attributes["gen_ai.usage.output_tokens"] == 8
        assert attributes["gen_ai.response.time_to_first_chunk"] > 0
        assert attributes["bulkhead.tenant.id"] == "alice" and attributes["bulkhead.replica"] == "sim"
        assert root.resource["service.name"] == "bulkhead" and root.resource["service.instance.id"]
        stages = receiver.children(root)
        assert [span.name for span in stages] == ["admission", "queue", HOP]
        admission, queue, hop = stages
        assert [span.name for span in receiver.children(admission)] == ["placement", "count", "rate_limit"]
        assert receiver.children(admission)[0].attributes["bulkhead.replica"] == "sim"
        assert hop.span_id == hop_id and hop.kind == "client", "the engine's spans join the engine call's"
        assert hop.attributes["server.address"] == "127.0.0.1" and hop.attributes["http.response.status_code"] == 200
        assert 0 < hop.attributes["gen_ai.response.time_to_first_chunk"] <= hop.ms / 1000
        assert [name for name, _ in hop.events] == ["first_byte"]
        assert admission.start_ns >= root.start_ns and hop.end_ns <= root.end_ns
        assert "tracestate" not in sent["headers"]
    chat, message = orjson.loads(answers[0]), orjson.loads(answers[2])
    said = [chat["choices"][0]["message"]["content"], message["content"][0]["text"]]
    for secret in (word, sent_marker(forwarded(sim)[0]), ALICE_KEY, *said):
        assert secret.encode() not in receiver.raw, "no prompt, answer, marker or key is in a span"


async def test_a_judge_is_a_span_of_its_own_with_its_engine_call(
    client: httpx.AsyncClient, make_gateway: GatewayFactory, make_sim: Callable[..., str]
) -> None:
    with otlp_receiver() as receiver:
        sims = {"r1": make_sim(), "r2": make_sim()}
        # Every answer judged beside its generation, on the other replica.
        judged = {"fingerprints": {"max_judges_per_day": 0}}
        gateway = make_gateway(sims, isolation=judged, tracing=traced(receiver))
        answer = await client.post(f"{gateway}/v1/chat/completions", json=chat_body(max_tokens=4), headers=auth())
        assert answer.status_code == 200, answer.text
        await receiver.wait_for(finished(1))
    [root] = receiver.roots()
    show(receiver, root)
    names = [span.name for span in receiver.children(root)]
    assert sorted(names) == sorted(["admission", "queue", HOP, "judge"])
    [judge] = [span for span in receiver.children(root) if span.name == "judge"]
    [judge_hop] = receiver.children(judge)
    served_by = root.attributes["bulkhead.replica"]
    assert judge.attributes["bulkhead.replica"] == judge_hop.attributes["bulkhead.replica"] != served_by
    assert judge_hop.kind == "client" and judge_hop.name == HOP
    [parent] = traceparents(sims[judge_hop.attributes["bulkhead.replica"]])
    assert parent.startswith(f"00-{root.trace_id}-{judge_hop.span_id}-") and sampled(parent[-2:])


async def test_a_leak_is_an_event_of_its_requests_span_and_none_of_the_leaked_text_is_exported(
    make_gateway: GatewayFactory, make_sim: Callable[..., str], tokenizer_dir: Path
) -> None:
    with otlp_receiver() as receiver:

        def traced_gateway(backends: dict[str, str], **overrides: Any) -> str:
            return make_gateway(backends, tracing=traced(receiver), **overrides)

        gateway, sim = after_alices_confidential_prompt(traced_gateway, make_sim, tokenizer_dir)
        over = chat_body(OVER_CAPACITY, max_tokens=64)
        answer = httpx.post(f"{gateway}/v1/chat/completions", json=over, headers=auth(BOB_KEY))
        assert answer.status_code == 502 and answer.json()["error"]["code"] == "answer_withheld"
        await receiver.wait_for(finished(2))
    [bobs] = [root for root in receiver.roots() if root.attributes["bulkhead.tenant.id"] == "bob"]
    show(receiver, bobs)
    assert bobs.failed and bobs.attributes["error.type"] == "answer_withheld"
    events = [attributes for name, attributes in bobs.events if name == "bulkhead.isolation_event"]
    assert {"kind": "leak", "bulkhead.replica": "sim", "victim": "alice"} in events
    for secret in (b"merger", sent_marker(forwarded(sim)[0]).encode()):
        assert secret not in receiver.raw


async def test_a_clients_traceparent_is_only_a_link_unless_the_gateway_is_told_to_join_it(
    client: httpx.AsyncClient, make_gateway: GatewayFactory, make_sim: Callable[..., str]
) -> None:
    theirs, their_span = secrets.token_hex(16), secrets.token_hex(8)
    with otlp_receiver() as receiver:
        sim = make_sim()
        linking = make_gateway({"sim": sim}, tracing=traced(receiver))
        joining = make_gateway({"sim": sim}, tracing=traced(receiver, client_context="parent"))
        # Unsampled by the client: a tenant's flag decides nothing of the gateway's own sampling.
        for gateway, flags in ((linking, "00"), (joining, "01"), (joining, "00")):
            headers = {**auth(), "traceparent": f"00-{theirs}-{their_span}-{flags}", "tracestate": "tenant=evil"}
            answer = await client.post(f"{gateway}/v1/chat/completions", json=chat_body(max_tokens=2), headers=headers)
            assert answer.status_code == 200, answer.text
        await receiver.wait_for(finished(2))
    linked, joined = sorted(receiver.roots(), key=lambda root: root.start_ns)
    assert linked.trace_id != theirs and linked.parent_id == "" and linked.links == [(theirs, their_span)]
    assert joined.trace_id == theirs and joined.parent_id == their_span and joined.links == []
    assert len(receiver.roots()) == 2, "the request the client marked unsampled was not traced where it is joined"
    first, second, third = traceparents(sim)
    assert first.split("-")[1] == linked.trace_id and second.split("-")[1] == theirs
    assert third.startswith(f"00-{theirs}-") and not sampled(third[-2:]), "the engine is told not to trace it either"
    assert all("tracestate" not in record["headers"] for record in forwarded(sim))


async def test_a_request_not_sampled_exports_nothing_and_tells_the_engine_so(
    client: httpx.AsyncClient, make_gateway: GatewayFactory, make_sim: Callable[..., str]
) -> None:
    with otlp_receiver() as receiver:
        sim = make_sim()
        gateway = make_gateway({"sim": sim}, tracing=traced(receiver, sampler="traceidratio", sampler_ratio=0.0))
        for stream in (False, True):
            body = chat_body(max_tokens=2, stream=stream)
            answer = await client.post(f"{gateway}/v1/chat/completions", json=body, headers=auth())
            assert answer.status_code == 200
    assert receiver.spans == []
    assert [sampled(parent[-2:]) for parent in traceparents(sim)] == [False, False]


@pytest.mark.parametrize("enabled", [False, True])
async def test_spans_are_sent_as_the_gateway_stops_and_none_with_tracing_off(
    client: httpx.AsyncClient, make_sim: Callable[..., str], tokenizer_dir: Path, enabled: bool
) -> None:
    with otlp_receiver() as receiver:
        sim = make_sim()
        # Never sent on an interval within the test: what arrives was sent at shutdown.
        tracing = traced(receiver, enabled=enabled, export_interval_s=600)
        settings = gateway_settings({"sim": sim}, tokenizer_dir, tracing=tracing)
        with run_server(create_app(settings), settings.edge) as gateway:
            answer = await client.post(f"{gateway}/v1/chat/completions", json=chat_body(max_tokens=2), headers=auth())
            assert answer.status_code == 200
            assert receiver.exports == []
    assert len(receiver.roots()) == (1 if enabled else 0)
    assert ("traceparent" in forwarded(sim)[0]["headers"]) is enabled
