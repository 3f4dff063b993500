"""docs/api.md's tables of each API's fields list exactly the fields of the official SDKs' request types, and every
one of them is a field of the gateway's request model: at its default, each is accepted (issue 46)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from anthropic.types import message_create_params
from openai.types.chat import completion_create_params
from openai.types.responses import response_create_params
from pydantic import BaseModel

from gateway.api.anthropic_shapes import MessagesRequest
from gateway.api.responses_shapes import ResponsesRequest
from gateway.schemas import NOT_APPLIED, ChatCompletionRequest

API_MD = Path(__file__).parents[2] / "docs" / "api.md"
# Each table's heading, the SDK's streaming request type (the non-streaming one's fields and `stream`), the model.
APIS = {
    "Chat completions fields": (completion_create_params.CompletionCreateParamsStreaming, ChatCompletionRequest),
    "Responses fields": (response_create_params.ResponseCreateParamsStreaming, ResponsesRequest),
    "Messages fields": (message_create_params.MessageCreateParamsStreaming, MessagesRequest),
}
ROW = re.compile(r"^\| `(\w+)` \| (.+) \|$")


def table(heading: str) -> dict[str, str]:
    """The rows of the table under `### heading`: each field and what the gateway does with it."""
    section = API_MD.read_text().split(f"### {heading}\n", 1)[1].split("\n#", 1)[0]
    return {found[1]: found[2] for line in section.splitlines() if (found := ROW.match(line))}


def wire_names(model: type[BaseModel]) -> set[str]:
    return {field.alias or name for name, field in model.model_fields.items()}


@pytest.mark.parametrize("heading", APIS)
def test_each_table_lists_exactly_the_sdks_fields(heading: str) -> None:
    params, _ = APIS[heading]
    assert set(table(heading)) == params.__required_keys__ | params.__optional_keys__


@pytest.mark.parametrize("heading", APIS)
def test_every_field_of_the_sdk_is_one_the_gateway_reads(heading: str) -> None:
    params, model = APIS[heading]
    assert params.__required_keys__ | params.__optional_keys__ <= wire_names(model)


def test_what_the_chat_table_says_is_not_applied_is_never_forwarded() -> None:
    said = {name for name, does in table("Chat completions fields").items() if does.startswith("accepted, not applied")}
    refused = {name for name, does in table("Chat completions fields").items() if does.startswith("refused")}
    assert said | refused <= set(NOT_APPLIED)
