"""The request bodies the gateway accepts, as strict pydantic models; the OpenAPI document is built from them.

Validation is strict (no "5" for 5, no 1 for true) so that what the schema says is exactly what passes.
Every field the gateway forwards is listed here — the OpenAI parameters and vLLM's sampling and output
parameters — and anything else is refused with a 400 naming it (every field of a request is a control: an
unknown one could be an engine control the gateway has never heard of). Three kinds of known vLLM fields are
refused on purpose, each with its reason (REFUSED): fields that change what the engine processes in ways the
gateway cannot count, engine-control fields no tenant may set, and fields that would make the engine return
the prompt, i.e. the gateway's injected canary text. Sizes that cost the engine (stop strings, schemas,
grammars, token lists) are bounded. OpenAI's own chat fields are all read: a hosted API's controls are accepted and
never forwarded (NOT_APPLIED), and those asking for what nothing here runs are refused unless null, with their
reason (CHAT_UNSERVED); docs/api.md has the table of them all.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, ClassVar, Literal, TypeVar

import orjson
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from gateway.errors import InvalidRequest
from isolation.scanner import normalize

ModelName = Annotated[str, Field(min_length=1, max_length=256)]
OutputTokens = Annotated[int, Field(ge=1)]
INT64 = Annotated[int, Field(ge=-(2**63), le=2**63 - 1)]
TokenId = Annotated[int, Field(ge=0, le=2**31 - 1)]
ShortText = Annotated[str, Field(max_length=256)]
Stop = Annotated[str, Field(max_length=256)] | Annotated[list[ShortText], Field(max_length=16)]
Logprobs = Annotated[int, Field(ge=0, le=20)]  # vLLM's default --max-logprobs

# What structured output may cost the engine's grammar compiler: a JSON schema, regex or grammar above this is
# refused (a 5,000-property schema takes seconds to compile and is a denial of service, not a use case).
MAX_GRAMMAR_BYTES = 32 * 1024
MAX_TOKEN_LIST = 1024
T = TypeVar("T")
Body = TypeVar("Body", bound=BaseModel)


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")


def _bounded(value: T, what: str) -> T:
    if value is not None and len(orjson.dumps(value)) > MAX_GRAMMAR_BYTES:
        raise ValueError(f"{what} is larger than {MAX_GRAMMAR_BYTES} bytes")
    return value


class StreamOptions(_Strict):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False
    # OpenAI's padding of stream events against length side channels: none is added here (NOT_APPLIED).
    include_obfuscation: bool | None = None


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
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Strict):
    name: Annotated[str, Field(min_length=1, max_length=256)]


class NamedToolChoice(_Strict):
    type: Literal["function"] = "function"
    function: NamedFunction


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | Annotated[list[TextPart], Field(min_length=1)] | None = None
    name: Annotated[str, Field(max_length=256)] | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    # An assistant message handed back as the SDK returned it: its reasoning is rendered by templates that use it;
    # the output-only fields come back as null.
    reasoning: str | None = None
    reasoning_content: str | None = None
    refusal: str | None = None
    annotations: None = None
    audio: None = None
    function_call: None = None

    @model_validator(mode="after")
    def _content_present(self) -> ChatMessage:
        # An assistant turn may be reasoning alone, or nothing (vLLM renders its content as ""): Anthropic's and
        # OpenAI's Responses history hold such turns.
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a '{self.role}' message needs content")
        return self


class JsonSchemaFormat(_Strict):
    name: Annotated[str, Field(min_length=1, max_length=256)]
    description: str | None = None
    # "schema" is a BaseModel attribute; the alias keeps the wire name.
    json_schema: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None

    @field_validator("json_schema")
    @classmethod
    def _size(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        return _bounded(value, "the schema")


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(_Strict):
    """vLLM's structured outputs: one constraint, each bounded in size."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: Annotated[list[ShortText], Field(min_length=1, max_length=256)] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: ShortText | None = None

    @field_validator("json_", "regex", "grammar")
    @classmethod
    def _size(cls, value: Any) -> Any:
        return _bounded(value, "a structured output constraint")


class RepetitionDetection(_Strict):
    max_pattern_size: Annotated[int, Field(ge=0, le=1024)] = 0
    min_pattern_size: Annotated[int, Field(ge=0, le=1024)] = 0
    min_count: Annotated[int, Field(ge=0, le=1024)] = 0


# Known vLLM fields that are refused, with the reason the tenant is told. None of them is in the schema (so the
# OpenAPI document refuses them too); this table only gives the 400 its reason.
UNCOUNTABLE = "it changes what the engine processes in a way the gateway cannot count exactly"
ENGINE_CONTROL = "it is an engine-control field, which the gateway never takes from a client"
ECHOES_PROMPT = "it would return the prompt as the engine saw it, including text the gateway adds for isolation"
REFUSED: dict[str, str] = {
    "chat_template": UNCOUNTABLE,
    "continue_final_message": UNCOUNTABLE,
    "documents": UNCOUNTABLE,
    "add_special_tokens": UNCOUNTABLE,
    "truncate_prompt_tokens": UNCOUNTABLE,
    "truncation_side": UNCOUNTABLE,
    "prompt_embeds": UNCOUNTABLE,
    "mm_processor_kwargs": UNCOUNTABLE,
    "media_io_kwargs": UNCOUNTABLE,
    "kv_transfer_params": ENGINE_CONTROL,
    "ec_transfer_params": ENGINE_CONTROL,
    "vllm_xargs": ENGINE_CONTROL,
    "request_id": ENGINE_CONTROL,
    "priority": ENGINE_CONTROL,
    "data_parallel_rank": ENGINE_CONTROL,
    "session_id": ENGINE_CONTROL,
    "routed_experts_prompt_start": ENGINE_CONTROL,
    "mm_payload": ENGINE_CONTROL,
    "return_mm_kwargs": ENGINE_CONTROL,
    "return_token_offsets": ENGINE_CONTROL,
    "prompt_logprobs": ECHOES_PROMPT,
    "return_token_ids": ECHOES_PROMPT,
    "return_tokens_as_token_ids": "it turns answer tokens into ids the gateway would have to decode to scan",
    "return_prompt_text": ECHOES_PROMPT,
}


# Refused fields (REFUSED) a chat request may set, since the gateway counts what they render.
CHAT_COUNTED = frozenset({"add_special_tokens", "continue_final_message"})


# What vLLM passes a chat template itself: a client's chat_template_kwargs would replace them (vLLM merges the
# kwargs over them), rendering another prompt than the one the gateway counts.
TEMPLATE_ARGUMENTS = frozenset(
    {"chat_template", "add_generation_prompt", "continue_final_message", "tools", "documents", "messages",
     "conversation", "tokenize", "return_dict", "return_assistant_tokens_mask"}
)  # fmt: skip


def _refuse_known(data: Any, refused: dict[str, str] = REFUSED) -> Any:
    if isinstance(data, dict):
        for name in data.keys() & refused.keys():
            raise ValueError(f"'{name}' is not accepted: {refused[name]}")
    return data


# OpenAI's chat fields that ask for what nothing behind the gateway does: refused unless null (their default), since
# an answer made without them would not be the one asked for.
NOTHING_RUNS = "nothing behind the gateway runs it"
CHAT_UNSERVED: dict[str, str] = {
    "audio": f"audio output: {NOTHING_RUNS} (the engines write text)",
    "web_search_options": f"OpenAI's hosted web search: {NOTHING_RUNS}",
    "moderation": f"OpenAI's moderation models: {NOTHING_RUNS}",
    "functions": "deprecated by OpenAI for `tools`, which the gateway forwards; vLLM does not read it",
    "function_call": "deprecated by OpenAI for `tool_choice`, which the gateway forwards; vLLM does not read it",
}
# A hosted API's own controls, accepted as its clients send them and never forwarded (not_applied): the prefix cache
# is the engine's, salted per tenant, so a client's cache key must not reach it (it could name another tenant's).
NOT_APPLIED = (
    "store", "metadata", "service_tier", "prompt_cache_key", "prompt_cache_retention", "prompt_cache_options",
    "safety_identifier", "verbosity", "modalities", "prediction", "audio", "web_search_options", "moderation",
    "functions", "function_call",
)  # fmt: skip


def not_applied(payload: dict[str, Any]) -> None:
    """The accepted fields that are not applied, out of a chat request before it goes upstream."""
    for name in NOT_APPLIED:
        payload.pop(name, None)
    options = payload.get("stream_options")
    if isinstance(options, dict):
        options.pop("include_obfuscation", None)


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
    seed: INT64 | None = None
    stop: Stop | None = None
    user: ShortText | None = None
    logit_bias: Annotated[dict[str, Annotated[float, Field(ge=-100, le=100)]], Field(max_length=300)] | None = None
    response_format: ResponseFormat | None = None
    # Overwritten with the tenant's own salt (or removed): accepted so clients that send one keep working.
    cache_salt: Annotated[str, Field(max_length=1024)] | None = None
    # vLLM's sampling and output parameters.
    use_beam_search: bool = False
    top_k: Annotated[int, Field(ge=-1, le=100_000)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0, le=10)] | None = None
    length_penalty: Annotated[float, Field(ge=-100, le=100)] = 1.0
    stop_token_ids: Annotated[list[TokenId], Field(max_length=64)] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    min_tokens: Annotated[int, Field(ge=0)] = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1, max_length=MAX_TOKEN_LIST)] | None = None
    bad_words: Annotated[list[ShortText], Field(max_length=64)] | None = None
    logprob_token_ids: Annotated[list[TokenId], Field(min_length=1, max_length=64)] | None = None
    structured_outputs: StructuredOutputs | None = None
    thinking_token_budget: Annotated[int, Field(ge=-1)] | None = None
    repetition_detection: RepetitionDetection | None = None
    stream_interval: Annotated[int, Field(ge=1, le=1024)] | None = None

    @model_validator(mode="before")
    @classmethod
    def _refused(cls, data: Any) -> Any:
        return _refuse_known(data)

    @field_validator("stop", "bad_words")
    @classmethod
    def _no_marker_probe(cls, value: str | list[str] | None) -> str | list[str] | None:
        # A stop string (or banned word) of `CNRY-` and a guess tells, by where the answer stops, whether the model was
        # about to write that: a tenant could read its own hidden marker a character at a time.
        texts = [value] if isinstance(value, str) else value or []
        if any(b"cnry" in normalize(text) for text in texts):
            raise ValueError("may not contain 'CNRY' (in any case or spacing): it is the gateway's canary prefix")
        return value

    @field_validator("logit_bias")
    @classmethod
    def _token_keys(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        if value is not None and not all(key.isascii() and key.isdigit() and len(key) <= 10 for key in value):
            raise ValueError("logit_bias keys must be token ids")
        return value

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and bool(self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and bool(self.stream_options.continuous_usage_stats)

    @property
    def requested_output(self) -> int | None:
        return self.max_tokens

    @property
    def output_param(self) -> str:
        """The field that sets the output length: errors name it, and the gateway writes it upstream."""
        return "max_tokens"


class ChatCompletionRequest(_Generation):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: OutputTokens | None = None
    add_generation_prompt: bool = True
    # The last message left open for the answer to go on with (a prefill), as vLLM renders it: counted (refused on
    # completions, REFUSED). The gateway's Messages and Responses routes set it for a turn to continue.
    continue_final_message: bool = False
    # The tokenizer's special tokens on top of the template's (BOS again): counted on chat as the tokenizer adds them
    # (refused elsewhere, REFUSED). The gateway's Responses route sets it, as vLLM's own Responses route renders so.
    add_special_tokens: bool = False
    # Template variables, as strings, numbers, booleans or null; vLLM lays them over its own arguments, so none may
    # name one of those (TEMPLATE_ARGUMENTS) or a refused field.
    chat_template_kwargs: dict[str, str | int | float | bool | None] | None = None
    tools: Annotated[list[Tool], Field(min_length=1)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    logprobs: bool = False
    top_logprobs: Logprobs | None = None
    include_reasoning: bool = True
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None

    # A chat echo prepends the last message, which carries the tenant's marker when it is a user turn.
    echo: Literal[False] | None = None
    # Accepted and not applied (NOT_APPLIED).
    store: bool | None = None
    metadata: Annotated[dict[str, Annotated[str, Field(max_length=512)]], Field(max_length=16)] | None = None
    service_tier: ShortText | None = None
    prompt_cache_key: Annotated[str, Field(max_length=1024)] | None = None
    prompt_cache_retention: ShortText | None = None
    prompt_cache_options: Annotated[dict[str, ShortText | None], Field(max_length=8)] | None = None
    safety_identifier: ShortText | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    # Text is what the engines write; audio is refused (CHAT_UNSERVED's reason, by _refused).
    modalities: Annotated[list[Literal["text"]], Field(max_length=1)] | None = None
    # A predicted output only makes OpenAI's answer faster: the answer is the same without it.
    prediction: dict[str, Any] | None = None
    # Refused unless null (CHAT_UNSERVED).
    audio: None = None
    web_search_options: None = None
    moderation: None = None
    functions: None = None
    function_call: None = None

    @model_validator(mode="after")
    def _bounded_tool_grammar(self) -> ChatCompletionRequest:
        # A tool choice that is required or named compiles the tools' schemas into a grammar, as response_format
        # does: the same bound.
        choice = self.tool_choice
        if self.tools and (choice == "required" or isinstance(choice, NamedToolChoice)):
            named = choice.function.name if isinstance(choice, NamedToolChoice) else None
            schemas = [t.function.parameters for t in self.tools if named is None or t.function.name == named]
            _bounded(schemas, "the schemas of the tools a tool_choice requires")
        return self

    @model_validator(mode="before")
    @classmethod
    def _refused(cls, data: Any) -> Any:
        if isinstance(data, dict):
            given = {name for name, value in data.items() if value is not None}
            _refuse_known(dict.fromkeys(given & CHAT_UNSERVED.keys()), CHAT_UNSERVED)
            modalities = data.get("modalities")
            if isinstance(modalities, list) and "audio" in modalities:
                raise ValueError(f"'modalities' is not accepted with audio: {CHAT_UNSERVED['audio']}")
            _refuse_known({name: value for name, value in data.items() if name not in CHAT_COUNTED})
            return data
        return _refuse_known(data)

    @model_validator(mode="after")
    def _one_ending(self) -> ChatCompletionRequest:
        if not self.continue_final_message:
            return self
        # The gateway's marker is in system and user turns: the engine is never set to go on writing one of them.
        if self.messages[-1].role != "assistant":
            raise ValueError("'continue_final_message' continues only a last assistant message (a prefill)")
        # vLLM refuses both, a generation prompt by default too (transformers' apply_chat_template).
        if self.add_generation_prompt:
            raise ValueError("'continue_final_message' needs 'add_generation_prompt': false")
        return self

    @field_validator("chat_template_kwargs")
    @classmethod
    def _template_variables(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        for name in (value or {}).keys() & (TEMPLATE_ARGUMENTS | REFUSED.keys()):
            raise ValueError(f"'{name}' is not accepted here: the gateway sets it or refuses it as a field")
        return value

    @field_validator("echo", mode="before")
    @classmethod
    def _no_echo(cls, value: Any) -> Any:
        if value is True:
            raise ValueError(f"not accepted: {ECHOES_PROMPT}")
        return value

    @property
    def requested_output(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def output_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"


class CompletionRequest(_Generation):
    prompt: str | Annotated[list[TokenId], Field(min_length=1)]
    echo: bool = False
    logprobs: Logprobs | None = None
    best_of: Annotated[int, Field(ge=1, le=128)] | None = None

    @model_validator(mode="after")
    def _echo_tokens(self) -> CompletionRequest:
        if self.echo and self.logprobs is not None and isinstance(self.prompt, str):
            raise ValueError(f"'echo' with 'logprobs' is not accepted: {ECHOES_PROMPT}")
        return self


InferenceRequest = ChatCompletionRequest | CompletionRequest


# OpenAI's bound on the inputs of one embeddings request; and the most dimensions a vector may have, more than any
# embedding model we know of (an answer above them is refused as too large: inference.answer_bound).
MAX_EMBEDDING_INPUTS = 2048
MAX_EMBEDDING_DIMENSIONS = 16_384
WRITES_BASE64 = "the gateway writes base64 itself, as OpenAI's API does (little-endian float32)"
EMBEDDING_REFUSED: dict[str, str] = {
    "padding": UNCOUNTABLE,
    "messages": "embeddings take `input` (texts or token ids); a conversation is not embedded here",
    "embed_dtype": WRITES_BASE64,
    "endianness": WRITES_BASE64,
}
EmbeddingText = Annotated[str, Field(min_length=1)]
TokenIds = Annotated[list[TokenId], Field(min_length=1)]


class EmbeddingRequest(_Strict):
    """OpenAI's embeddings request, with vLLM's `use_activation`."""

    # Never streamed, one vector per input, no stop strings: what the pipeline asks of every request.
    stream: ClassVar[bool] = False
    n: ClassVar[int] = 1
    stop: ClassVar[None] = None

    model: ModelName
    input: (
        EmbeddingText
        | Annotated[list[EmbeddingText], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)]
        | TokenIds
        | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)]
    )
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: Annotated[int, Field(ge=1, le=MAX_EMBEDDING_DIMENSIONS)] | None = None
    user: ShortText | None = None
    # Overwritten with the tenant's own salt (or removed), as for the other routes.
    cache_salt: Annotated[str, Field(max_length=1024)] | None = None
    use_activation: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _refused(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name in data.keys() & EMBEDDING_REFUSED.keys():
                raise ValueError(f"'{name}' is not accepted: {EMBEDDING_REFUSED[name]}")
        return _refuse_known(data)

    @property
    def inputs(self) -> list[tuple[str, str | list[int]]]:
        """Each input and its place in the request, which errors name (`input` when it is alone)."""
        given = self.input
        if isinstance(given, str):
            return [("input", given)]
        items: list[Any] = given
        if isinstance(items[0], int):
            return [("input", items)]
        return [(f"input[{index}]", item) for index, item in enumerate(items)]


AnyRequest = InferenceRequest | EmbeddingRequest


_NAMED = re.compile(r"^'(\w+)'")
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "list", "dict", "none"})


def _field_path(loc: tuple[int | str, ...]) -> str:
    # Pydantic puts union member tags ("str", "list[TextPart]", "TextPart") into locations; callers know fields.
    parts = [
        f"[{p}]" if isinstance(p, int) else f".{p}"
        for p in loc
        if isinstance(p, int) or (p.islower() and p.isidentifier() and p not in _TYPE_TAGS)
    ]
    return "".join(parts).lstrip(".")


_PATH = re.compile(r"([a-z_]+)(?:\.[a-z_]+|\[\d+\])*")


def request_path(param: str | None, schema: type[BaseModel]) -> str | None:
    """A backend's `param` when it is a path into a request field (`messages[0].content`), else None: anything
    else is just more of the backend's words."""
    found = _PATH.fullmatch(param or "")
    return param if found is not None and found.group(1) in schema.model_fields else None


def _reason(error: Any) -> str:
    if error["type"] == "extra_forbidden":
        return "not a field the gateway accepts (it forwards only the fields listed in /openapi.json)"
    return str(error["msg"]).removeprefix("Value error, ")


def validate(schema: type[Body], payload: dict[str, Any]) -> Body:
    """The body as `schema` reads it, or InvalidRequest naming the most specific field at fault."""
    try:
        return schema.model_validate(payload)
    except ValidationError as exc:
        # The deepest error is the most specific: for a union (a stop string or a list of them), the branch that
        # matched the input's shape goes deeper.
        errors = sorted(exc.errors(), key=lambda error: -len(error["loc"]))
        path = _field_path(tuple(errors[0]["loc"]))
        reasons = list(dict.fromkeys(_reason(e) for e in errors if _field_path(tuple(e["loc"])) == path))
        message = " or ".join(reasons[:3])
        if not path and (named := _NAMED.match(message)):
            # A check of the whole body names its field first in its message.
            raise InvalidRequest(message, param=named.group(1)) from exc
        raise InvalidRequest(f"{path}: {message}" if path else message, param=path or None) from exc
