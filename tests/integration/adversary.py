"""An adversarial vLLM look-alike: vLLM 0.32's routes and answer shapes (as isolation/sim/replies.py sends them), with
honest usage, that can be told to replay a prompt it saw into any one channel of an answer (docs/channels.md).

    GET  /v1/models, /health, /metrics       what the gateway reads of a backend (/metrics: `adversary.metrics`)
    POST /tokenize                           counted as the simulator counts
    POST /v1/chat/completions, /v1/completions   streamed or not
    POST /v1/embeddings                      the simulator's vectors for the inputs (isolation/sim/embeddings.py)
    POST /v1/score, /v1/rerank               the cosines of those vectors (score: `queries` and `documents`)

It remembers the prompt text of every inference request as it arrived (markers included: chat contents joined by
newlines, or the completion prompt). Tests drive it in-process: `adversary.plan = Plan(...)` answers the next
inference request with a text (the previous request's prompt, that request's own, or a benign one) put into the
plan's channel, split into pieces of `plan.piece` characters, one piece per stream chunk and per logprob position.
Everything else in the answer is benign, and `usage` counts the prompt exactly as vLLM would (the chat template,
then the tokenizer), so the usage check passes and only the canary guard stands between the tenants.
"""

from __future__ import annotations

import asyncio
import base64
import codecs
import time
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import orjson
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from isolation.sim.embeddings import DIMENSIONS, embedding
from isolation.tokens import ModelTokenizer
from tests.integration.support import MODEL

JsonObject = dict[str, Any]
Source = Literal["previous", "first", "own", "benign"]
Usage = Literal["honest", "none", "negative", "short"]

MAX_MODEL_LEN = 2048
BENIGN = "The harbour tide tables for Tuesday look calm and ordinary."
# The visible text of an answer whose leak goes elsewhere, one word per chunk or logprob position.
WORDS = (" The", " weather", " is", " mild", " today", ".")
# Alternatives of a logprob position; the rank a plan names is replaced by the piece. None may equal a piece of a
# prompt, or a completion's top_logprobs dict would merge two keys.
ALTERNATIVES = (" alpha", " bravo", " charlie")
EXTRA = "debug_prompt"  # the unknown field a plan's extra_top / extra_choice channel fills
TOP_STRINGS = ("id", "model", "system_fingerprint")
TOOL_CHANNELS = ("tool_name", "tool_arguments", "tool_id")
DONE = b"data: [DONE]\n\n"
AFTER_ONE = ("midstream_error", "not_json")  # a stream's channels that come after one benign chunk
# An embeddings answer that does not answer its inputs: a vector fewer, one more, an index twice, one vector shorter.
VECTOR_CHANNELS = ("vector_missing", "vector_extra", "index_repeated", "vector_short")
# A scoring answer that does not answer its pairs: a score fewer, one more, an index twice, a score that is no number.
SCORE_CHANNELS = ("vector_missing", "vector_extra", "index_repeated", "score_nan")


@dataclass(frozen=True)
class Plan:
    """Where the next answer carries which text.

    channel: content, reasoning, reasoning_content, refusal, tool_name, tool_arguments, tool_id, logprob_token,
        top_logprob_token, logprob_bytes (chat); text, tokens, top_logprobs (completions); stop_reason,
        finish_reason, id, model, system_fingerprint, extra_top, extra_choice, name_top, name_choice (the text as
        a field's name, its value null), object_list (the text as the items of a list in `object`), prompt_token_ids,
        token_ids,
        prompt_logprobs (both); and, beside the answer's fields: sse_comment, sse_event (lines before each data
        event of a stream), unterminated (the visible text, in a last event with no blank line after it and no
        [DONE]), midstream_error (a `data: {"error": ...}` event after the first chunk), error_400 and error_500
        (an HTTP 400 or 500 whose message and param quote the text), not_json (the whole answer, or a stream's
        event after the first chunk, is the text and not JSON), tokenize_400 (the next /tokenize refused, quoting
        the prompt it was given), tokenize_huge (the next /tokenize answered with its count and 4 MiB more). An
        embeddings answer: extra_top, extra_item (the text in an unknown field of the answer or of its first vector),
        id, model (the text as that string), and VECTOR_CHANNELS (the text nowhere). A score or rerank answer:
        extra_top, extra_item, document_text (a rerank's first document's text is the text), and SCORE_CHANNELS
        (the text nowhere).
    source: the text put there: the previous request's prompt, the first request's, this one's own, or benign.
    piece: characters per stream chunk and logprob position (token ids: the ids of those characters); 0, all at once.
    rank: the alternative that top_logprob_token / top_logprobs fill.
    delay_s: how long a chat answer takes to begin (its prompt is recorded at once): a slow generation.
    usage: "honest"; "none" (no usage anywhere in the answer); "negative" (completion_tokens below zero, with a
        total that adds up); "short" (an embeddings answer's prompt_tokens one fewer than the inputs', as a
        placeholder's).
    """

    channel: str
    piece: int = 0
    source: Source = "previous"
    rank: int = 1
    usage: Usage = "honest"
    delay_s: float = 0.0


def split(text: str, size: int) -> list[str]:
    return [text[at : at + size] for at in range(0, len(text), size)] if size else [text]


def _append(holder: JsonObject, key: str, piece: str) -> None:
    holder[key] = (holder.get(key) or "") + piece


def _extend(holder: JsonObject, key: str, items: list[Any]) -> None:
    holder[key] = (holder.get(key) or []) + items


def _event(chunk: JsonObject) -> bytes:
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


def _lines(prefix: str, text: str) -> bytes:
    # One SSE line per line of the text: a newline inside a field would end it.
    return "".join(f"{prefix} {line}\n" for line in text.split("\n")).encode() + b"\n"


@dataclass
class Answer:
    """One answer, as a whole body or as stream events, carrying `text` in `plan.channel`."""

    chat: bool
    model: str
    prompt_tokens: int
    max_tokens: int
    plan: Plan
    text: str
    tokenizer: ModelTokenizer
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    created: int = field(default_factory=lambda: int(time.time()))
    _offset: int = 0  # a completion's logprob text offset so far, running on across chunks as vLLM's does

    @property
    def pieces(self) -> list[str]:
        # A stream error comes after one benign chunk; the other channels spread the text over the answer.
        return [WORDS[0]] if self.plan.channel in AFTER_ONE else split(self.text, self.plan.piece)

    def usage(self, produced: int) -> JsonObject | None:
        if self.plan.usage == "none":
            return None
        completion = min(produced, self.max_tokens) if self.plan.usage == "honest" else -3
        return {
            "prompt_tokens": self.prompt_tokens,
            "total_tokens": self.prompt_tokens + completion,
            "completion_tokens": completion,
        }

    def body(self) -> JsonObject:
        answer = self._envelope()
        if self.chat:
            message: JsonObject = {
                "role": "assistant",
                "content": None,
                "refusal": None,
                "annotations": None,
                "audio": None,
                "function_call": None,
                "tool_calls": [],
                "reasoning": None,
            }
            choice = {
                "index": 0,
                "message": message,
                "logprobs": None,
                "finish_reason": None,
                "stop_reason": None,
                "token_ids": None,
            }
            answer.update(prompt_logprobs=None, prompt_token_ids=None)
        else:
            choice = {
                "index": 0,
                "text": "",
                "logprobs": None,
                "finish_reason": None,
                "stop_reason": None,
                "token_ids": None,
                "prompt_logprobs": None,
                "prompt_token_ids": None,
            }
        answer.update(choices=[choice], service_tier=None, system_fingerprint=None, kv_transfer_params=None)
        self._clear(answer)
        for position, piece in enumerate(self.pieces):
            self._step(answer, choice, position, piece)
        if self.plan.channel != "finish_reason":
            choice["finish_reason"] = self._finish()
        usage = self.usage(len(self.pieces))
        if usage is not None:
            answer["usage"] = {**usage, "prompt_tokens_details": None}
        return answer

    def events(self, include_usage: bool, continuous: bool) -> Iterator[bytes]:
        channel = self.plan.channel
        if self.chat:
            role: JsonObject = {
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            yield _event(self._chunk(role, 0, continuous))
        last = len(self.pieces) - 1
        for position, piece in enumerate(self.pieces):
            if channel == "sse_comment":
                yield _lines(":", piece)
            elif channel == "sse_event":
                yield _lines("event:", piece)
            chunk = self._chunk(self._stream_choice(), position + 1, continuous)
            self._clear(chunk)
            self._step(chunk, chunk["choices"][0], position, piece)
            if channel == "unterminated" and position == last:
                yield b"data: " + orjson.dumps(chunk)  # the backend's connection ends here
                return
            yield _event(chunk)
        if channel == "midstream_error":
            yield _event({"error": {"message": self.text, "type": "InternalServerError", "param": None, "code": 500}})
            yield DONE
            return
        if channel == "not_json":
            yield _lines("data:", self.text)
            yield DONE
            return
        closing = self._stream_choice()
        closing.update(finish_reason=self._finish(), stop_reason=None)
        yield _event(self._chunk(closing, len(self.pieces), continuous))
        usage = self.usage(len(self.pieces))
        if include_usage and usage is not None:
            yield _event({**self._envelope(), "choices": [], "usage": usage})
        yield DONE

    def _envelope(self) -> JsonObject:
        kind = "chat.completion" if self.chat else "text_completion"
        prefix = "chatcmpl-" if self.chat else "cmpl-"
        return {"id": prefix + self.request_id, "object": kind, "created": self.created, "model": self.model}

    def _stream_choice(self) -> JsonObject:
        if self.chat:
            return {"index": 0, "delta": {}, "logprobs": None, "finish_reason": None}
        return {
            "index": 0,
            "text": "",
            "logprobs": None,
            "finish_reason": None,
            "stop_reason": None,
            "prompt_token_ids": None,
            "token_ids": None,
        }

    def _chunk(self, choice: JsonObject, produced: int, continuous: bool) -> JsonObject:
        chunk = self._envelope()
        if self.chat:
            chunk["object"] = "chat.completion.chunk"
        chunk["choices"] = [choice]
        if continuous and self.plan.usage != "none":
            chunk["usage"] = self.usage(produced)
        elif not self.chat:
            chunk["usage"] = None  # completion chunks carry every field, nulls included
        return chunk

    def _clear(self, answer: JsonObject) -> None:
        """A top-level string that carries the text carries nothing else (so a client's join of it is the text)."""
        if self.plan.channel in TOP_STRINGS:
            answer[self.plan.channel] = ""

    def _finish(self) -> str:
        return "tool_calls" if self.chat and self.plan.channel in TOOL_CHANNELS else "stop"

    def _step(self, answer: JsonObject, choice: JsonObject, position: int, piece: str) -> None:
        """Put one piece (and the benign word of its position) into a body or a stream chunk."""
        channel = self.plan.channel
        word = WORDS[position % len(WORDS)]
        holder: JsonObject = (choice.get("message") or choice.setdefault("delta", {})) if self.chat else choice
        visible = "content" if self.chat else "text"
        if channel in ("content", "text", "unterminated"):
            _append(holder, visible, piece)
        elif channel in TOOL_CHANNELS:
            self._tool_call(holder, position, piece)
        else:
            _append(holder, visible, word)
        if channel in ("reasoning", "reasoning_content", "refusal"):
            _append(holder, channel, piece)
        elif channel in ("logprob_token", "top_logprob_token", "logprob_bytes"):
            self._chat_logprob(choice, word, piece)
        elif channel in ("tokens", "top_logprobs"):
            self._completion_logprob(choice, word, piece)
        elif channel in ("stop_reason", "finish_reason"):
            _append(choice, channel, piece)
        elif channel in TOP_STRINGS:
            _append(answer, channel, piece)
        elif channel in ("extra_top", "extra_choice"):
            _append(answer if channel == "extra_top" else choice, EXTRA, piece)
        elif channel == "object_list":
            # A list where a closed set of strings belongs (`object`): pruning once failed on such a value.
            answer["object"] = [*(answer["object"] if type(answer.get("object")) is list else ()), piece]
        elif channel in ("name_top", "name_choice"):
            # The text as the name of a field the engine sends null, as vLLM does its unused fields.
            (answer if channel == "name_top" else choice)[piece] = None
        elif channel in ("prompt_token_ids", "token_ids"):
            # vLLM puts a chat's prompt_token_ids beside its choices, a completion's inside its choice.
            target = answer if channel == "prompt_token_ids" and self.chat else choice
            _extend(target, channel, self._ids(piece))
        elif channel == "prompt_logprobs":
            entries = [
                {str(i): {"logprob": -0.5, "rank": 1, "decoded_token": self.tokenizer.decode([i])}}
                for i in self._ids(piece)
            ]
            _extend(answer if self.chat else choice, channel, entries)

    def _ids(self, piece: str) -> list[int]:
        return list(self.tokenizer.tokenizer.encode(piece, add_special_tokens=False).ids)

    def _tool_call(self, holder: JsonObject, position: int, piece: str) -> None:
        channel = self.plan.channel
        if not holder.get("tool_calls"):
            # A stream's calls carry their index, a body's (its message has the role) do not: vLLM's shapes.
            holder["tool_calls"] = [{} if "role" in holder else {"index": 0}]
        call = holder["tool_calls"][0]
        function = call.setdefault("function", {})
        if position == 0:
            call.update(id="" if channel == "tool_id" else "chatcmpl-tool-" + self.request_id[:16], type="function")
            function.update(name="" if channel == "tool_name" else "lookup")
            function.update(arguments="" if channel == "tool_arguments" else "{}")
        if channel == "tool_id":
            _append(call, "id", piece)
        else:
            _append(function, "name" if channel == "tool_name" else "arguments", piece)

    def _chat_logprob(self, choice: JsonObject, word: str, piece: str) -> None:
        channel = self.plan.channel
        token = piece if channel == "logprob_token" else word
        alternatives = list(ALTERNATIVES)
        if channel == "top_logprob_token":
            alternatives[self.plan.rank] = piece
        raw = piece if channel == "logprob_bytes" else token
        entry = {
            "token": token,
            "logprob": -0.25,
            "bytes": list(raw.encode()),
            "top_logprobs": [
                {"token": alt, "logprob": -0.25 - rank, "bytes": list(alt.encode())}
                for rank, alt in enumerate(alternatives)
            ],
        }
        logprobs = choice.get("logprobs") or {"content": []}
        logprobs["content"].append(entry)
        choice["logprobs"] = logprobs

    def _completion_logprob(self, choice: JsonObject, word: str, piece: str) -> None:
        token = piece if self.plan.channel == "tokens" else word
        alternatives = list(ALTERNATIVES)
        if self.plan.channel == "top_logprobs":
            alternatives[self.plan.rank] = piece
        logprobs = choice.get("logprobs") or {"text_offset": [], "token_logprobs": [], "tokens": [], "top_logprobs": []}
        logprobs["text_offset"].append(self._offset)
        logprobs["token_logprobs"].append(-0.25)
        logprobs["tokens"].append(token)
        logprobs["top_logprobs"].append({alt: -0.25 - rank for rank, alt in enumerate(alternatives)})
        choice["logprobs"] = logprobs
        self._offset += len(token)


def _contents(messages: list[JsonObject]) -> Iterator[str]:
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            yield content
        elif isinstance(content, list):
            yield from (
                part["text"] for part in content if isinstance(part, dict) and isinstance(part.get("text"), str)
            )


def _json(content: object, status_code: int = 200) -> Response:
    return Response(orjson.dumps(content), status_code=status_code, media_type="application/json")


class Adversary:
    def __init__(self, tokenizer: ModelTokenizer, model: str = MODEL) -> None:
        self.tokenizer = tokenizer
        self.model = model
        self.prompts: list[str] = []  # every inference request's prompt text, as it arrived, oldest first
        self.plan: Plan | None = None  # for the next inference request only
        self.metrics = b""  # what /metrics answers
        self.model_lists = 0  # /v1/models answered: a gateway reads it first in each capacity refresh

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/v1/models", self._models, methods=["GET"]),
                Route("/health", self._health, methods=["GET"]),
                Route("/metrics", self._metrics, methods=["GET"]),
                Route("/tokenize", self._tokenize, methods=["POST"]),
                Route("/v1/chat/completions", self._chat, methods=["POST"]),
                Route("/v1/completions", self._completions, methods=["POST"]),
                Route("/v1/embeddings", self._embeddings, methods=["POST"]),
                Route("/v1/score", self._scores, methods=["POST"]),
                Route("/v1/rerank", self._scores, methods=["POST"]),
            ]
        )

    def _encode(self, body: JsonObject) -> list[int]:
        """The prompt's tokens as vLLM counts them (the simulator's _encode_chat / _encode_text)."""
        if "messages" in body:
            return self.tokenizer.encode_chat(
                body["messages"],
                body.get("tools"),
                body.get("add_generation_prompt", True),
                body.get("chat_template_kwargs"),
            )
        return self.tokenizer.encode_prompt(body["prompt"])

    async def _models(self, request: Request) -> Response:
        self.model_lists += 1
        card = {
            "id": self.model,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "vllm",
            "root": self.model,
            "parent": None,
            "max_model_len": MAX_MODEL_LEN,
            "permission": [],
        }
        return _json({"object": "list", "data": [card]})

    async def _health(self, request: Request) -> Response:
        return Response(status_code=200)

    async def _metrics(self, request: Request) -> Response:
        # By default no vllm:cache_config_info: the gateway then limits prompts by the window alone.
        return Response(self.metrics, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def _tokenize(self, request: Request) -> Response:
        body = orjson.loads(await request.body())
        if self.plan is not None and self.plan.channel == "tokenize_400":
            self.plan = None
            prompt = "\n".join(_contents(body["messages"])) if "messages" in body else str(body["prompt"])
            error = {"message": f"Cannot tokenize: {prompt}", "type": "BadRequestError", "param": None, "code": 400}
            return _json({"error": error}, 400)
        ids = self._encode(body)
        strings = None
        if self.plan is not None and self.plan.channel == "tokenize_huge":
            self.plan = None
            strings = ["x" * 1024] * 4096
        return _json({"count": len(ids), "max_model_len": MAX_MODEL_LEN, "tokens": ids, "token_strs": strings})

    async def _chat(self, request: Request) -> Response:
        body = orjson.loads(await request.body())
        delay_s = self.plan.delay_s if self.plan is not None else 0.0
        response = self._answer(True, body, "\n".join(_contents(body["messages"])))
        await asyncio.sleep(delay_s)
        return response

    async def _completions(self, request: Request) -> Response:
        body = orjson.loads(await request.body())
        return self._answer(False, body, body["prompt"])

    async def _embeddings(self, request: Request) -> Response:
        body = orjson.loads(await request.body())
        given = body["input"]
        inputs = [given] if isinstance(given, str) or isinstance(given[0], int) else given
        ids = [self.tokenizer.encode_prompt(item) if isinstance(item, str) else item for item in inputs]
        plan, text = self._planned(Plan("vectors", source="benign"), "\n".join(i for i in inputs if isinstance(i, str)))
        data = [
            {"index": index, "object": "embedding", "embedding": embedding(tokens, DIMENSIONS, True).tolist()}
            for index, tokens in enumerate(ids)
        ]
        if plan.channel == "vector_missing":
            data.pop()
        elif plan.channel == "vector_extra":
            data.append({**data[0], "index": len(data)})
        elif plan.channel == "index_repeated":
            data[-1]["index"] = 0
        elif plan.channel == "vector_short":
            data[-1]["embedding"] = data[-1]["embedding"][:-1]
        elif plan.channel == "extra_item":
            data[0][EXTRA] = text
        answer: JsonObject = {"id": f"embd-{uuid.uuid4().hex}", "object": "list", "created": int(time.time())}
        answer.update(model=body.get("model") or self.model, data=data)
        prompt = sum(map(len, ids)) - (1 if plan.usage == "short" else 0)
        if plan.usage != "none":
            answer["usage"] = {"prompt_tokens": prompt, "total_tokens": prompt, "completion_tokens": 0}
        if plan.channel == "extra_top":
            answer[EXTRA] = text
        elif plan.channel in ("id", "model"):
            answer[plan.channel] = text
        return _json(answer)

    async def _scores(self, request: Request) -> Response:
        body = orjson.loads(await request.body())
        rerank = "query" in body
        first, second = (body["query"], body["documents"]) if rerank else (body["queries"], body["documents"])
        firsts, seconds = ([t] if isinstance(t, str) else t for t in (first, second))
        plan, text = self._planned(Plan("scores", source="benign"), "\n".join([*firsts, *seconds]))
        vectors = [embedding(self.tokenizer.encode_prompt(t), DIMENSIONS, True) for t in [*firsts, *seconds]]
        lefts, rights = vectors[: len(firsts)], vectors[len(firsts) :]
        scores = [float(lefts[0 if len(lefts) == 1 else i] @ right) for i, right in enumerate(rights)]
        name, field = ("results", "relevance_score") if rerank else ("data", "score")
        items: list[JsonObject] = [{"index": i, field: score} for i, score in enumerate(scores)]
        for item in items:
            item.update({"document": {"text": seconds[item["index"]]}} if rerank else {"object": "score"})
        if plan.channel == "vector_missing":
            items.pop()
        elif plan.channel == "vector_extra":
            items.append({**items[0], "index": len(items)})
        elif plan.channel == "index_repeated":
            items[-1]["index"] = 0
        elif plan.channel == "score_nan":
            items[0][field] = "NaN"
        elif plan.channel == "extra_item":
            items[0][EXTRA] = text
        elif plan.channel == "document_text":
            items[0]["document"] = {"text": text}
        prompt = sum(len(self.tokenizer.encode_prompt(t)) for t in [*firsts, *seconds])
        prompt -= 1 if plan.usage == "short" else 0
        answer: JsonObject = {"id": f"score-{uuid.uuid4().hex}", "model": body.get("model") or self.model, name: items}
        answer["usage"] = {"prompt_tokens": prompt, "total_tokens": prompt}
        if plan.channel == "extra_top":
            answer[EXTRA] = text
        return _json(answer)

    def _planned(self, default: Plan, prompt: str) -> tuple[Plan, str]:
        """The plan for this request (once), and the text it puts into its channel; the prompt is remembered."""
        plan = self.plan or default
        self.plan = None
        earlier = self.prompts or [""]
        texts = {"previous": earlier[-1], "first": earlier[0], "own": prompt, "benign": BENIGN}
        self.prompts.append(prompt)
        return plan, texts[plan.source]

    def _answer(self, chat: bool, body: JsonObject, prompt: str) -> Response:
        plan, text = self._planned(Plan("content" if chat else "text", source="benign"), prompt)
        if plan.channel in ("error_400", "error_500"):
            status = int(plan.channel[-3:])
            error = {"message": f"Prompt rejected: {text}", "type": "BadRequestError", "param": text, "code": status}
            return _json({"error": error}, status)
        if plan.channel == "not_json" and not body.get("stream"):
            return Response(f"Engine failure on: {text}", media_type="application/json")
        max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or 16
        if body.get("min_tokens", 0) > max_tokens:  # as vLLM refuses it
            error = {"message": "min_tokens must be less than or equal to max_tokens", "type": "BadRequestError"}
            return _json({"error": {**error, "param": None, "code": 400}}, 400)
        answer = Answer(
            chat, body.get("model") or self.model, len(self._encode(body)), max_tokens, plan, text, self.tokenizer
        )
        if not body.get("stream"):
            return _json(answer.body())
        options = body.get("stream_options") or {}
        events = answer.events(bool(options.get("include_usage")), bool(options.get("continuous_usage_stats")))
        return StreamingResponse(events, media_type="text/event-stream")


class DecodingModel(Adversary):
    """A chat model that follows one instruction: 'ROT13: <text>' (or 'BASE64: <text>') in the last user turn is
    answered with the text decoded, greedily, whatever the sampling settings ('ARGS BASE64: <text>': as a tool call's
    arguments). Anything else is answered as the Adversary answers it. Honest usage; `stale`, when set, is written
    after every decoded text (pages of other requests this replica holds: a stale-KV fault of its own).

    A decoded answer takes `latency_s` to write (a whole one all of it before it is sent, a stream's events spread
    over it). `arrivals` holds when each chat request arrived, `written` when each decoded answer's last byte was
    written (time.monotonic: the tests serve replicas on threads of their own process)."""

    stale = ""
    latency_s = 0.0

    def __init__(self, tokenizer: ModelTokenizer, model: str = MODEL) -> None:
        super().__init__(tokenizer, model)
        self.arrivals: list[float] = []
        self.written: list[float] = []

    async def _chat(self, request: Request) -> Response:
        self.arrivals.append(time.monotonic())
        body = orjson.loads(await request.body())
        messages = body["messages"]
        users = [m for m in messages if m.get("role") == "user"]
        last = list(_contents(users[-1:]))[-1:] or [""]
        decoded = _decoded(last[0])
        if decoded is None:
            self.plan = self.plan or Plan("content", source="benign")
            return self._answer(True, body, "\n".join(_contents(messages)))
        # 7 characters a chunk in a stream: words cut between chunks, as an engine's tokens cut them.
        self.plan = Plan("tool_arguments" if "ARGS " in last[0] else "content", piece=7, source="own")
        response = self._answer(True, body, f"{decoded} {self.stale}" if self.stale else decoded)
        if not isinstance(response, StreamingResponse):
            await asyncio.sleep(self.latency_s)
            self.written.append(time.monotonic())
            return response
        events = [event async for event in response.body_iterator]
        return StreamingResponse(self._paced(events), media_type="text/event-stream")

    async def _paced(self, events: list[str | bytes | memoryview[int]]) -> AsyncIterator[str | bytes | memoryview[int]]:
        for event in events:
            await asyncio.sleep(self.latency_s / len(events))
            yield event
        self.written.append(time.monotonic())


def _decoded(turn: str) -> str | None:
    for instruction, decode in (("ROT13:", lambda t: codecs.decode(t, "rot13")), ("BASE64:", _base64)):
        if instruction in turn:
            return str(decode(turn.split(instruction, 1)[1].strip()))
    return None


def _base64(text: str) -> str:
    return base64.b64decode(text).decode()
