"""The Responses surface: /v1/responses, as OpenAI's SDK (`client.responses`), Codex and the Agents SDK speak it.

A Responses request runs through the same pipeline as a chat completion (responses_shapes.chat_payload), and its
outcome is written back as a response object or the Responses API's events; refusals keep OpenAI's error shape.
"""

from __future__ import annotations

from dataclasses import replace

import orjson
from starlette.requests import Request
from starlette.responses import Response

from gateway.api.openai import new_record, openai_response, read_submission, relayed_as
from gateway.api.responses_shapes import EventWriter, ResponsesRequest, chat_payload, response, response_id
from gateway.api.state import state_of
from gateway.errors import GatewayError
from gateway.pipeline.inference import Route, refuse, run
from gateway.pipeline.outcome import Stream
from gateway.schemas import ChatCompletionRequest, validate

# Asked of the engine on its chat route, stateless: the rendering the gateway counts is the one the engine runs.
RESPONSES = Route("responses", "/v1/chat/completions", ChatCompletionRequest)


async def create(request: Request) -> Response:
    state = state_of(request)
    record = new_record(request, RESPONSES)
    try:
        submission = await read_submission(request, state, record)
        asked = validate(ResponsesRequest, submission.payload)
        submission = replace(submission, payload=chat_payload(asked))
    except GatewayError as error:
        return openai_response(refuse(state, record, error))
    outcome = await run(state, RESPONSES, submission, record)
    made = response_id()
    if isinstance(outcome, Stream):
        return relayed_as(outcome, EventWriter(asked, made))
    if outcome.status != 200:
        return openai_response(outcome)
    body = response(outcome.body, asked, made)
    return Response(orjson.dumps(body), media_type="application/json", headers=outcome.headers)
