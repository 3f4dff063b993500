"""The request bodies the gateway accepts, as strict pydantic models; the OpenAPI document is built from them.

Validation is strict (no "5" for 5, no 1 for true) so that what the schema says is exactly what passes.
Unknown top-level fields are allowed and forwarded, as vLLM accepts and ignores them; every field the
gateway or the engine acts on is checked here first.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from gateway.errors import InvalidRequest

ModelName = Annotated[str, Field(min_length=1, max_length=256)]
OutputTokens = Annotated[int, Field(ge=1)]
Stop = str | Annotated[list[Annotated[str, Field(max_length=256)]], Field(max_length=16)]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class StreamOptions(_Strict):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class FunctionCall(_Strict):
    name: Annotated[str, Field(min_length=1, max_length=256)]
    arguments: str


class ToolCall(_Strict):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDefinition(_Strict):
    name: Annotated[str, Field(min_length=1, max_length=256)]
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[TextPart], Field(min_length=1)] | None = None
    name: Annotated[str, Field(max_length=256)] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _content_present(self) -> ChatMessage:
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError(f"a '{self.role}' message needs content")
        return self


# vLLM extensions that change what the engine processes in ways the gateway does not reproduce when it counts
# tokens: accepting them would make the count (and so the verification of the answer) wrong.
UNCOUNTABLE_FIELDS = (
    "chat_template",
    "continue_final_message",
    "documents",
    "add_special_tokens",
    "truncate_prompt_tokens",
    "prompt_embeds",
    "mm_processor_kwargs",
)


class _Generation(_Strict):
    model: ModelName
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: OutputTokens | None = None
    n: Annotated[int, Field(ge=1, le=128)] = 1
    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] | None = None
    seed: int | None = None
    stop: Stop | None = None
    user: Annotated[str, Field(max_length=256)] | None = None

    @model_validator(mode="before")
    @classmethod
    def _countable(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name in UNCOUNTABLE_FIELDS:
                if name in data:
                    raise ValueError(f"'{name}' is not accepted: the gateway must count exactly what the engine gets")
        return data

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats

    @property
    def requested_output(self) -> int | None:
        return self.max_tokens

    @property
    def output_param(self) -> str:
        """The field that sets the output length: errors name it, and a clamp writes it."""
        return "max_tokens"


class ChatCompletionRequest(_Generation):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: OutputTokens | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None

    @property
    def requested_output(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def output_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"


class CompletionRequest(_Generation):
    prompt: str | Annotated[list[Annotated[int, Field(ge=0)]], Field(min_length=1)]
    echo: bool = False


InferenceRequest = ChatCompletionRequest | CompletionRequest


_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def _field_path(loc: tuple[int | str, ...]) -> str:
    # Pydantic puts union member tags ("str", "list[TextPart]", "TextPart") into locations; callers know fields.
    parts = [
        f"[{p}]" if isinstance(p, int) else f".{p}"
        for p in loc
        if isinstance(p, int) or (p.islower() and p.isidentifier() and p not in _TYPE_TAGS)
    ]
    return "".join(parts).lstrip(".")


def validate(
    schema: type[ChatCompletionRequest] | type[CompletionRequest], payload: dict[str, Any]
) -> InferenceRequest:
    try:
        return schema.model_validate(payload)
    except ValidationError as exc:
        errors = exc.errors()
        param = _field_path(tuple(errors[0]["loc"]))
        reasons = list(dict.fromkeys(e["msg"] for e in errors if _field_path(tuple(e["loc"])) == param))
        message = " or ".join(reasons[:3])
        raise InvalidRequest(f"{param}: {message}" if param else message, param=param or None) from exc
