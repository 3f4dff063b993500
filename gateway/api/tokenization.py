"""vLLM's /tokenize and /detokenize, answered by the gateway from the model's own tokenizer: no engine is asked.

An engine's answer would be one more channel (its ids or text could carry anything), while the gateway's tokenizer
and chat rendering are the ones it counts every prompt with (isolation/tokens.py, proven against vLLM in
tests/e2e/test_vllm_rendering.py): what goes out is a function of the tenant's own request and the public tokenizer
alone. Nothing is planted (the tenant's marker is a secret from the tenant too, and it is not in what is tokenized);
a request is authenticated, held against the tenant's concurrency cap and request rate, and refused for a model the
key may not use or one whose use is blocked, like any other. A model with no tokenizer in the gateway (counted by its
backends' /tokenize) gets 400: the gateway does not relay what it cannot vouch for.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import partial
from typing import Annotated, Any, TypeVar

import orjson
from pydantic import BaseModel, ConfigDict, Field, model_validator
from starlette.requests import Request
from starlette.responses import Response

from gateway import accesslog
from gateway.accesslog import RequestRecord
from gateway.api.intake import Intake
from gateway.api.openai import CONVERSATION, openai_response
from gateway.errors import GatewayError, InvalidRequest
from gateway.incidents.verdicts import VerdictBound
from gateway.metrics import GatewayMetrics
from gateway.offload import off_loop
from gateway.pipeline.counting import LocalCounter, Prompt, PromptCounter
from gateway.pipeline.inference import refuse, resolve_model
from gateway.pipeline.slot import Slot, Slots
from gateway.schemas import REFUSED, ChatCompletionRequest, ModelName, TokenId, validate
from gateway.settings import ModelSettings, Settings, TenantSettings
from gateway.upstream.capacity import CapacityMonitor

T = TypeVar("T")
TOKENIZE = "tokenize"
DETOKENIZE = "detokenize"
# The fields of a chat /tokenize that make its prompt: validated as the chat request they are part of.
CHAT_FIELDS = (
    "model", "messages", "tools", "add_generation_prompt", "continue_final_message", "add_special_tokens",
    "chat_template_kwargs",
)  # fmt: skip


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _refused(cls, data: Any) -> Any:
        # vLLM's own fields the gateway refuses elsewhere (chat_template, continue_final_message, ...), with the reason.
        if isinstance(data, dict):
            for name in data.keys() & REFUSED.keys() - cls.model_fields.keys():
                raise ValueError(f"'{name}' is not accepted: {REFUSED[name]}")
        return data


class TokenizePromptRequest(_Strict):
    """vLLM's TokenizeCompletionRequest."""

    model: ModelName
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_Strict):
    """vLLM's TokenizeChatRequest; its messages, tools and template variables are checked as a chat request's."""

    model: ModelName
    messages: Annotated[list[Any], Field(min_length=1)]
    tools: list[Any] | None = None
    add_generation_prompt: bool = True
    # A prefill left open, counted as the chat route counts it (its rules: the chat request's validation).
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_Strict):
    model: ModelName
    tokens: list[TokenId]


class TokenizationRoutes:
    """/tokenize and /detokenize, answered from the model's tokenizer in the gateway (module docstring)."""

    def __init__(
        self,
        *,
        intake: Intake,
        settings: Settings,
        verdicts: VerdictBound,
        capacity: CapacityMonitor,
        slots: Slots,
        counters: dict[str, PromptCounter],
        metrics: GatewayMetrics,
    ) -> None:
        self._intake = intake
        self._settings = settings
        self._verdicts = verdicts
        self._capacity = capacity
        self._slots = slots
        self._counters = counters
        self._metrics = metrics

    async def tokenize(self, request: Request) -> Response:
        """`{count, max_model_len, tokens, token_strs}`, as vLLM answers; max_model_len is the most tokens this key's
        request to the model may take (the limit admission holds it to)."""
        return await self._answer(request, TOKENIZE, self._tokenized)

    async def detokenize(self, request: Request) -> Response:
        """`{prompt}`: the text of the token ids, as vLLM answers (special tokens kept)."""
        return await self._answer(request, DETOKENIZE, self._detokenized)

    async def _answer(self, request: Request, route: str, work: Work) -> Response:
        record = RequestRecord(request_id=accesslog.request_id(request.headers.get("x-request-id")), route=route)
        try:
            submission = await self._intake.submission(request, record, CONVERSATION if route == TOKENIZE else ())
            answer = await work(submission.tenant, submission.payload, record)
        except GatewayError as error:
            return openai_response(refuse(self._metrics, record, error))
        record.status = 200
        accesslog.finish(record, self._metrics)
        return Response(
            orjson.dumps(answer), media_type="application/json", headers={"x-request-id": record.request_id}
        )

    async def _tokenized(
        self, tenant: TenantSettings, payload: dict[str, Any], record: RequestRecord
    ) -> dict[str, Any]:
        if "messages" in payload:
            asked: TokenizeChatRequest | TokenizePromptRequest = await off_loop(
                partial(_chat_request, payload), payload
            )
        else:
            asked = validate(TokenizePromptRequest, payload)
        model, counter = self._tokenizer(tenant, asked.model, record)
        limit = self._capacity.require(model, tenant).tokens
        owner = tenant.incarnation()
        prompt = Prompt.of_chat(payload, owner) if isinstance(asked, TokenizeChatRequest) else Prompt(text=asked.prompt)
        ids = await self._held(tenant, model, partial(counter.encode, prompt, asked.add_special_tokens))
        record.prompt_tokens = len(ids)
        strings = [counter.tokenizer.tokenizer.id_to_token(token) for token in ids] if asked.return_token_strs else None
        return {"count": len(ids), "max_model_len": limit, "tokens": ids, "token_strs": strings}

    async def _detokenized(
        self, tenant: TenantSettings, payload: dict[str, Any], record: RequestRecord
    ) -> dict[str, Any]:
        asked = await off_loop(partial(validate, DetokenizeRequest, payload), payload)
        model, counter = self._tokenizer(tenant, asked.model, record)
        return {"prompt": await self._held(tenant, model, partial(counter.decode, asked.tokens, "tokens"))}

    def _tokenizer(
        self, tenant: TenantSettings, name: str, record: RequestRecord
    ) -> tuple[ModelSettings, LocalCounter]:
        """The model the key names and may use, and its tokenizer in the gateway."""
        model = resolve_model(self._settings, tenant, name)
        self._verdicts.check(tenant.id, model.name)
        record.model = model.name
        counter = self._counters[model.name]
        if not isinstance(counter, LocalCounter):
            raise InvalidRequest(
                f"The gateway answers this route from the model's tokenizer, and model '{model.name}' has none "
                "configured (models[].tokenizer); it counts with its backends' /tokenize, whose answers the gateway "
                "cannot vouch for.",
                param="model",
            )
        return model, counter

    async def _held(self, tenant: TenantSettings, model: ModelSettings, work: Callable[[], Awaitable[T]]) -> T:
        """`work`, as a request: under the tenant's concurrency cap and request rate (no tokens: nothing runs)."""
        slot = Slot(self._slots, tenant, model)
        try:
            await slot.reserve(0)
            return await work()
        finally:
            slot.release()


Work = Callable[[TenantSettings, dict[str, Any], RequestRecord], Awaitable[dict[str, Any]]]


def _chat_request(payload: dict[str, Any]) -> TokenizeChatRequest:
    asked = validate(TokenizeChatRequest, payload)
    validate(ChatCompletionRequest, {name: payload[name] for name in CHAT_FIELDS if name in payload})
    return asked
