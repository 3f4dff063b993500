"""LangChain's chat models through the gateway, with only a base URL and a tenant's key (issue 31): `ChatAnthropic` on
the Messages API and `ChatOpenAI` on the Responses API, each invoked, streamed, and calling a tool and reading its
result, with every defence of a chat completion on the way (the tenant's marker planted, then kept out of the
answer)."""

from __future__ import annotations

import base64
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from langchain_anthropic import ChatAnthropic
from langchain_core.language_models import BaseChatModel
from langchain_core.messages import AIMessage, AIMessageChunk, BaseMessage, HumanMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI

from isolation.markers import MARKER_PATTERN
from isolation.tokens import ModelTokenizer
from tests.integration.adversary import BENIGN, DecodingModel
from tests.integration.scripted import gateway_over
from tests.integration.support import ALICE_KEY, MODEL, shows_marker

# The engine answers this turn with a call of `lookup` whose arguments are the encoded text (DecodingModel).
CALL = "ARGS BASE64: " + base64.b64encode(b'{"city": "Paris"}').decode()
Client = Callable[[], BaseChatModel]


@tool
def lookup(city: str) -> str:
    """The weather in a city now."""
    return "Sunny"


@pytest.fixture(scope="module")
def engine(tokenizer_dir: Path) -> DecodingModel:
    return DecodingModel(ModelTokenizer.from_dir(tokenizer_dir))


@pytest.fixture(scope="module")
def gateway(engine: DecodingModel, tokenizer_dir: Path) -> Iterator[str]:
    with gateway_over(engine, tokenizer_dir) as url:
        yield url


@pytest.fixture(params=["anthropic", "openai-responses"])
def client(request: pytest.FixtureRequest, gateway: str) -> Client:
    """A new chat model of the kind named, on the gateway. ChatAnthropic asks for 4,096 output tokens unless told,
    more than the test model's whole window: it is told, as a user of a small model would."""
    if request.param == "anthropic":
        return lambda: ChatAnthropic(base_url=gateway, api_key=ALICE_KEY, model=MODEL, max_tokens=64, max_retries=0)
    return lambda: ChatOpenAI(
        base_url=f"{gateway}/v1", api_key=ALICE_KEY, model=MODEL, use_responses_api=True, max_retries=0
    )


def test_invoke_answers_through_every_defence(client: Client, engine: DecodingModel) -> None:
    answer = client().invoke("Name a colour.")
    assert isinstance(answer, AIMessage) and answer.text == BENIGN
    assert answer.usage_metadata is not None and answer.usage_metadata["input_tokens"] > 0
    marker = MARKER_PATTERN.search(engine.prompts[-1])
    assert marker is not None and not shows_marker(answer.model_dump_json(), marker.group())


def test_a_stream_comes_in_chunks_that_add_up_to_the_answer(client: Client) -> None:
    chunks = list(client().stream("Name a colour."))
    whole = chunks[0]
    for chunk in chunks[1:]:
        whole += chunk
    assert isinstance(whole, AIMessageChunk) and whole.text == BENIGN
    assert whole.usage_metadata is not None and whole.usage_metadata["output_tokens"] > 0


def test_a_bound_tool_is_called_and_its_result_read_back(client: Client, engine: DecodingModel) -> None:
    model = client().bind_tools([lookup])
    turns: list[BaseMessage] = [HumanMessage(CALL)]
    called = model.invoke(turns)
    assert isinstance(called, AIMessage)
    [call] = called.tool_calls
    assert (call["name"], call["args"]) == ("lookup", {"city": "Paris"}) and call["id"]
    turns += [called, ToolMessage(lookup.invoke(call["args"]), tool_call_id=call["id"]), HumanMessage("Thanks.")]
    answer = model.invoke(turns)
    assert isinstance(answer, AIMessage) and answer.text == BENIGN and not answer.tool_calls
    # The call and its result reached the engine as the chat turns they are.
    assert "Sunny" in engine.prompts[-1] and "Thanks." in engine.prompts[-1]


def test_anthropics_structured_output_by_json_schema_is_answered(gateway: str) -> None:
    """`ChatAnthropic.with_structured_output(method="json_schema")` asks with `output_config.format` (issue 46): the
    engine is asked for the schema's output (test_request_fields checks what it is sent), and the answer is read back
    as the object."""
    model = ChatAnthropic(base_url=gateway, api_key=ALICE_KEY, model=MODEL, max_tokens=64, max_retries=0)
    schema = {"title": "Colour", "type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    structured = model.with_structured_output(schema, method="json_schema")
    answer = structured.invoke("BASE64: " + base64.b64encode(b'{"name": "red"}').decode())
    assert answer == {"name": "red"}
