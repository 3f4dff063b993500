"""The simulator: a small, fast stand-in for vLLM's OpenAI-compatible server.

vLLM's routes, with vLLM's shapes, status codes and error texts:
    GET  /v1/models            POST /v1/chat/completions    POST /v1/completions
    POST /v1/responses         POST /v1/messages            POST /v1/messages/count_tokens
    GET  /v1/responses/{id}    POST /v1/responses/{id}/cancel (404: no store, as vLLM's default)
    POST /v1/embeddings        POST /pooling                POST /v1/score, /score   POST /v1/rerank, /rerank
    POST /tokenize             POST /detokenize
    GET  /health               GET  /version                GET  /metrics

Behind them, a paged KV cache with prefix caching keyed by cache_salt (kvcache.py), a scheduler's capacity
(SimConfig.max_num_seqs running at once, the rest queued; engine.py) and, when configured, the incident's
fault: over-long prompts answered from stale KV blocks (engine.py, SimConfig.fault).

With SimConfig.engine "sglang" it plays SGLang's server instead: the same generation routes with SGLang's
refusals and cache_salt handling, and SGLang's descriptive routes (sglang.py). With a disaggregated SimConfig
(prefill_kv_tokens or decode_kv_tokens) the app is a router in front of a prefill pool and a decode pool: it
advertises the window only (no vllm:cache_config_info, no KV size), and app.state.stages holds each pool's own
small app, to be served on a port of its own (stages.py).

Simulator-only inspection, for tests that must prove what a gateway did or did not forward:
    GET    /sim/requests   the last 1000 inference requests received (POSTs to the completion, responses and
                           messages routes, refused ones included), oldest first, as JSON
                           `[{"path": ..., "headers": {lower-case name: value}, "body": parsed JSON or null}]`
    DELETE /sim/requests   forget them (204)
    GET    /sim/timings    per generation request, by x-request-id: when it reached the engine, took a slot and
                           produced its first token, its cached share and TTFT (timings.py), oldest first, as JSON
    DELETE /sim/timings    forget them (204)
    PUT    /sim/fault      `{"fault": "stale-kv"}` (or any SimConfig fault, "none" included): the engine goes bad,
                           or well again, from its next request

Everything an app needs (tokenizer, engine, metrics registry, request log) is built once in create_sim_app and
held by that app's endpoints: several simulators can run in one process without sharing anything.
"""

from __future__ import annotations

import asyncio
import hmac
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from functools import partial

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route
from starlette.types import ASGIApp, Receive, Scope, Send

from isolation.sim import embeddings, scoring, sglang
from isolation.sim.config import FAULTS, SimConfig
from isolation.sim.detokenizer import Detokenizer
from isolation.sim.engine import Abandoned, Engine, Run
from isolation.sim.errors import SimError, bad_request, model_not_found, render_anthropic_error, render_sim_error
from isolation.sim.generation import WordVocabulary
from isolation.sim.info import json_response, vllm_models
from isolation.sim.logprobs import Scorer
from isolation.sim.message_replies import MessagesReply
from isolation.sim.messages import counted, merges_inline_system, parse_count_tokens, parse_messages
from isolation.sim.metrics import View, build_registry, render
from isolation.sim.protocol import (
    ChatPrompt,
    CompletionRequest,
    JsonObject,
    Sampling,
    TextPrompt,
    flag,
    parse_chat,
    parse_chat_prompt,
    parse_completion,
    parse_json_object,
    parse_model,
    parse_text_prompt,
    parse_token_ids,
)
from isolation.sim.recorder import RequestLog
from isolation.sim.replies import ChatReply, CompletionReply, Reply
from isolation.sim.response_replies import ResponsesReply
from isolation.sim.responses import parse_responses, response_not_found
from isolation.sim.stages import build_stages
from isolation.sim.streaming import EngineStream
from isolation.sim.timings import Timings
from isolation.tokens import ChatTemplateError, ModelTokenizer

VERSION = "0.32.0-sim"
REQUEST_LOG_LIMIT = 1000


def create_sim_app(config: SimConfig) -> Starlette:
    """The simulated server: an engine, or in a disaggregated deployment the router in front of its pools, whose
    stage apps are in `app.state.stages` ({"prefill": app, "decode": app}, empty when not disaggregated) for the
    caller to serve on ports of their own."""
    tokenizer = ModelTokenizer.from_dir(config.tokenizer_dir)
    vocabulary = WordVocabulary.from_tokenizer(tokenizer.tokenizer, config.seed)
    engine = Engine(config, vocabulary, Detokenizer(tokenizer.tokenizer))
    view: View = "router" if config.disaggregated else "engine"
    endpoints = _Endpoints(config, tokenizer, engine, build_registry(engine, view), RequestLog(REQUEST_LOG_LIMIT))
    generation = [
        Route("/v1/chat/completions", endpoints.chat_completions, methods=["POST"]),
        Route("/v1/completions", endpoints.completions, methods=["POST"]),
    ]
    inspection = [
        Route("/sim/requests", endpoints.recorded_requests, methods=["GET"]),
        Route("/sim/requests", endpoints.forget_requests, methods=["DELETE"]),
        Route("/sim/fault", endpoints.set_fault, methods=["PUT"]),
        Route("/sim/timings", endpoints.recorded_timings, methods=["GET"]),
        Route("/sim/timings", endpoints.forget_timings, methods=["DELETE"]),
    ]
    if config.engine == "sglang":
        described, handlers = sglang.routes(config, engine, tokenizer, view), sglang.EXCEPTION_HANDLERS
    else:
        described, handlers = _vllm_routes(config, tokenizer, engine, endpoints), {SimError: render_sim_error}
    app = Starlette(routes=[*generation, *described, *inspection], exception_handlers=handlers)
    app.state.engine = engine
    app.state.request_log = endpoints.request_log
    app.state.stages = build_stages(config, engine)
    if config.api_key is not None:
        guarded = sglang.guarded if config.engine == "sglang" else _vllm_guarded
        for served in (app, *app.state.stages.values()):
            served.add_middleware(ApiKeyCheck, token=config.api_key, guarded=guarded)
    return app


def _vllm_routes(config: SimConfig, tokenizer: ModelTokenizer, engine: Engine, endpoints: _Endpoints) -> list[Route]:
    embedder = embeddings.Embeddings(config, tokenizer, engine, endpoints.request_log)
    return [
        Route("/v1/models", endpoints.models, methods=["GET"]),
        Route("/v1/responses", endpoints.responses, methods=["POST"]),
        Route("/v1/responses/{response_id}", endpoints.stored_response, methods=["GET"]),
        Route("/v1/responses/{response_id}/cancel", endpoints.stored_response, methods=["POST"]),
        Route("/v1/messages", endpoints.messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", endpoints.count_message_tokens, methods=["POST"]),
        *embeddings.routes(embedder),
        *scoring.routes(embedder),
        Route("/tokenize", endpoints.tokenize, methods=["POST"]),
        Route("/detokenize", endpoints.detokenize, methods=["POST"]),
        Route("/health", endpoints.health, methods=["GET"]),
        Route("/version", endpoints.version, methods=["GET"]),
        Route("/metrics", endpoints.metrics, methods=["GET"]),
    ]


def _vllm_guarded(path: str) -> bool:
    return path.startswith("/v1")


class ApiKeyCheck:
    """--api-key: every guarded path needs `Authorization: Bearer <key>`, else 401 {"error": "Unauthorized"}. vLLM
    guards /v1 paths only (its AuthenticationMiddleware: /health, /metrics, /tokenize and the rest stay open);
    SGLang every path but /health* and /metrics (sglang.guarded), with the same answer."""

    def __init__(self, app: ASGIApp, token: str, guarded: Callable[[str], bool] = _vllm_guarded) -> None:
        self._app = app
        self._expected = f"Bearer {token}".encode()
        self._guarded = guarded

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] != "OPTIONS" and self._guarded(scope["path"]):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self._expected):
                await json_response({"error": "Unauthorized"}, 401)(scope, receive, send)
                return
        await self._app(scope, receive, send)


class _Endpoints:
    def __init__(
        self,
        config: SimConfig,
        tokenizer: ModelTokenizer,
        engine: Engine,
        registry: CollectorRegistry,
        request_log: RequestLog,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.engine = engine
        self.registry = registry
        self.request_log = request_log
        self.vocab_size = int(tokenizer.tokenizer.get_vocab_size(with_added_tokens=True))
        self.scorer = Scorer(engine.vocabulary, engine.detokenizer)
        self.merge_inline_system = merges_inline_system(tokenizer)
        self.sglang = config.engine == "sglang"
        self.timings = Timings()

    async def models(self, request: Request) -> Response:
        return json_response(vllm_models(self.config))

    async def chat_completions(self, request: Request) -> Response:
        body, salt = self._salted(await self._read_body(request, record=True))
        chat = parse_chat(body)
        self._check_model(chat.sampling.model)
        prompt = chat.prompt
        reply = partial(ChatReply, role=prompt.response_role, echo=prompt.echoed(), tools=bool(prompt.tools))
        return await self._generate(request, self._encode_chat(prompt), self._with(chat.sampling, salt), reply)

    async def completions(self, request: Request) -> Response:
        body, salt = self._salted(await self._read_body(request, record=True))
        completion = parse_completion(body)
        self._check_model(completion.sampling.model)
        prompt_ids = self._encode_text(completion.prompt)
        reply = partial(CompletionReply, echo=self._echoed(completion, prompt_ids))
        return await self._generate(request, prompt_ids, self._with(completion.sampling, salt), reply)

    def _salted(self, body: JsonObject) -> tuple[JsonObject, str | None]:
        """SGLang keys the prefix cache by cache_salt and extra_key together (sglang.py); vLLM's parser reads
        cache_salt itself."""
        return sglang.extra_key(body) if self.sglang else (body, None)

    @staticmethod
    def _with(sampling: Sampling, salt: str | None) -> Sampling:
        return sampling if salt is None else replace(sampling, cache_salt=salt)

    async def responses(self, request: Request) -> Response:
        asked = parse_responses(await self._read_body(request, record=True))
        self._check_model(asked.sampling.model)
        asked.check(self.config.max_model_len)
        prompt_ids = self._encode_chat(asked.prompt)
        settings = asked.settings_for(len(prompt_ids), self.config.max_model_len)
        reply = partial(ResponsesReply, tools=bool(asked.prompt.tools), request_id=asked.response_id, settings=settings)
        return await self._generate(request, prompt_ids, asked.sampling, reply)

    async def stored_response(self, request: Request) -> Response:
        # Like vLLM without VLLM_ENABLE_RESPONSES_API_STORE, the simulator stores no response (responses.py).
        raise response_not_found(request.path_params["response_id"])

    async def messages(self, request: Request) -> Response:
        asked = parse_messages(await self._read_body(request, record=True), self.merge_inline_system)
        try:
            self._check_model(asked.sampling.model)
            asked.check(self.config.max_model_len)
            prompt_ids = self._encode_chat(asked.prompt)
            reply = partial(MessagesReply, tools=bool(asked.prompt.tools))
            return await self._generate(request, prompt_ids, asked.sampling, reply)
        except SimError as exc:
            return render_anthropic_error(exc)

    async def count_message_tokens(self, request: Request) -> Response:
        asked = parse_count_tokens(await self._read_body(request, record=False), self.merge_inline_system)
        try:
            self._check_model(asked.model)
            return json_response(counted(self._encode_chat(asked.prompt), self.config.max_model_len))
        except SimError as exc:
            return render_anthropic_error(exc)

    async def tokenize(self, request: Request) -> Response:
        body = await self._read_body(request, record=False)
        self._check_model(parse_model(body))
        if "messages" in body:
            ids = self._encode_chat(parse_chat_prompt(body))
        else:
            ids = self._encode_text(parse_text_prompt(body))
        token_strs = None
        if flag(body, "return_token_strs", False):
            token_strs = [self.tokenizer.tokenizer.id_to_token(token_id) for token_id in ids]
        return json_response(
            {"count": len(ids), "max_model_len": self.config.max_model_len, "tokens": ids, "token_strs": token_strs}
        )

    async def detokenize(self, request: Request) -> Response:
        body = await self._read_body(request, record=False)
        self._check_model(parse_model(body))
        ids = self._check_token_ids(parse_token_ids(body, "tokens"), "tokens")
        return json_response({"prompt": self.tokenizer.decode(ids)})

    async def health(self, request: Request) -> Response:
        return Response(status_code=200)

    async def version(self, request: Request) -> Response:
        return json_response({"version": VERSION})

    async def metrics(self, request: Request) -> Response:
        return Response(render(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def recorded_requests(self, request: Request) -> Response:
        return json_response(self.request_log.entries())

    async def forget_requests(self, request: Request) -> Response:
        self.request_log.clear()
        return Response(status_code=204)

    async def recorded_timings(self, request: Request) -> Response:
        return json_response(self.timings.entries())

    async def forget_timings(self, request: Request) -> Response:
        self.timings.clear()
        return Response(status_code=204)

    async def set_fault(self, request: Request) -> Response:
        """`{"fault": "stale-kv"}`: the engine goes bad (or well again) from its next request, as a replica in
        production starts mixing requests mid-life; its KV cache keeps its size and contents."""
        fault = parse_json_object(await request.body()).get("fault")
        if fault not in FAULTS:
            raise bad_request(f"fault must be one of {', '.join(FAULTS)}", "fault")
        self.engine.config = replace(self.engine.config, fault=fault)
        return json_response({"fault": fault})

    async def _read_body(self, request: Request, *, record: bool) -> JsonObject:
        if record:
            request.state.sim_received = time.monotonic()
        raw = await request.body()
        try:
            body = parse_json_object(raw)
        except SimError:
            if record:
                self.request_log.record(request.url.path, request.scope["headers"], None)
            raise
        if record:
            self.request_log.record(request.url.path, request.scope["headers"], body)
        return body

    def _check_model(self, model: str | None) -> None:
        # Like vLLM, an omitted model means the served one; SGLang checks no model name at all.
        if model is not None and model != self.config.model and not self.sglang:
            raise model_not_found(model)

    def _encode_chat(self, prompt: ChatPrompt) -> list[int]:
        try:
            text = self.tokenizer.render_chat(
                prompt.messages,
                prompt.tools,
                prompt.add_generation_prompt,
                prompt.template_kwargs,
                prompt.reasoning_effort,
                prompt.continue_final_message,
            )
        except ChatTemplateError as exc:
            raise bad_request(str(exc)) from exc
        except TypeError as exc:  # chat_template_kwargs naming an argument the renderer already passes
            raise bad_request(f"Invalid chat_template_kwargs: {exc}", "chat_template_kwargs") from exc
        return list(self.tokenizer.tokenizer.encode(text, add_special_tokens=prompt.add_special_tokens).ids)

    def _encode_text(self, prompt: TextPrompt) -> list[int]:
        if isinstance(prompt.prompt, list):
            return self._check_token_ids(prompt.prompt, "prompt")
        encoding = self.tokenizer.tokenizer.encode(prompt.prompt, add_special_tokens=prompt.add_special_tokens)
        return list(encoding.ids)

    def _echoed(self, completion: CompletionRequest, prompt_ids: list[int]) -> str:
        """The prompt's text as vLLM echoes it: as sent, or decoded with its special tokens; none at all when
        token ids are returned too."""
        extras = completion.sampling.extras
        if not extras.echo or extras.token_ids:
            return ""
        prompt = completion.prompt.prompt
        return prompt if isinstance(prompt, str) else self.engine.detokenizer.decode_all(prompt_ids)

    def _check_token_ids(self, ids: list[int], param: str) -> list[int]:
        out_of_range = [token_id for token_id in ids if not 0 <= token_id < self.vocab_size]
        if out_of_range:
            raise bad_request(f"Token id {out_of_range[0]} is out of vocabulary", param)
        return ids

    async def _generate(
        self, request: Request, prompt_ids: Sequence[int], sampling: Sampling, make_reply: Callable[..., Reply]
    ) -> Response:
        timing = self.timings.start(
            request.headers.get("x-request-id", ""),
            getattr(request.state, "sim_received", time.monotonic()),
            self.engine.num_running,
            self.engine.num_waiting,
        )
        try:
            run = await self.engine.admit(
                prompt_ids,
                sampling.n,
                sampling.max_tokens,
                sampling.cache_salt,
                sampling.extras,
                abandoned=partial(_wait_for_disconnect, request.receive),
            )
        except Abandoned:
            return _client_disconnected()
        except SimError as exc:
            if self.sglang and sampling.stream and exc.aborted:
                return sglang.streamed_refusal(exc)
            raise
        timing.took_slot(run, run.next_due if self.engine.paced else None)
        reply = make_reply(
            run=run, sampling=sampling, model=self.config.model, vocabulary=self.engine.vocabulary, scorer=self.scorer
        )
        if sampling.stream:
            return EngineStream(self.engine, reply, timing.produced_first)
        try:
            finished = await _finish_unless_disconnected(self.engine, run, request.receive)
        finally:
            self.engine.release(run)
        if not finished:
            return _client_disconnected()
        return json_response(reply.body())


def _client_disconnected() -> Response:
    """What a request whose client has gone gets: nobody reads it, and vLLM answers the same way."""
    refusal = bad_request("Client disconnected")
    return Response(refusal.body(), status_code=refusal.status, media_type="application/json")


async def _finish_unless_disconnected(engine: Engine, run: Run, receive: Receive) -> bool:
    """Produce the whole answer, unless the client disconnects first (then the run is aborted by the caller).

    Starlette does not cancel a plain endpoint when its client goes away, so a paced request races its
    generation against the connection's http.disconnect, as vLLM's `with_cancellation` does.
    """
    if not engine.paced:
        await engine.run_to_end(run)
        return True
    generating = asyncio.ensure_future(engine.run_to_end(run))
    watching = asyncio.ensure_future(_wait_for_disconnect(receive))
    try:
        await asyncio.wait((generating, watching), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (generating, watching):
            task.cancel()
        await asyncio.gather(generating, watching, return_exceptions=True)
    return run.state == "finished"


async def _wait_for_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
