"""POST /v1/embeddings as vLLM's pooling runner answers it: a deterministic vector per input, made from its tokens.

Each input is tokenized as vLLM tokenizes a completion prompt (special tokens added unless `add_special_tokens` is
false; token ids taken as they are), and every input is checked before any runs, as vLLM's renderer checks them: one
longer than max_model_len refuses the whole request with vLLM's context-length 400. An input then goes through the KV
cache as a prompt with no output does (written into blocks, found in the prefix cache by cache_salt, freed), so its
tokens are what stale pages hold afterwards. One longer than the KV cache is refused too, naming the cache, unless a
stale fault is configured (SimConfig.fault): then it is swapped for a one-token placeholder whose pooler reads the
pages earlier requests freed, and its vector is theirs, its usage one token, the answer a 200: the incident, in
vectors.

A vector is the mean of a pseudo-random unit vector per token (a hash of the token id), normalized (unless
`use_activation` is false), as float32: the same tokens give the same vector, and texts that share words lie close.
The simulated model is Matryoshka-trained: `dimensions` (1 to DIMENSIONS) keeps the leading ones, normalized again.
`encoding_format` is float or base64 (little-endian float32, as vLLM writes it on x86). Not simulated: vLLM's chat
inputs (`messages`), `truncate_prompt_tokens`, `padding`, the bytes encodings, and the scheduler (an embeddings
request takes no sequence slot; it waits only for free KV blocks).
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import time
import uuid
from functools import lru_cache
from itertools import islice
from typing import Any

import numpy as np
import orjson
from numpy.typing import NDArray
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from isolation.sim.config import SimConfig
from isolation.sim.engine import Engine
from isolation.sim.errors import SimError, bad_request, context_length_exceeded, model_not_found
from isolation.sim.protocol import JsonObject, flag, parse_json_object, parse_model
from isolation.sim.recorder import RequestLog
from isolation.tokens import ModelTokenizer, vocab_size

DIMENSIONS = 32
BLOCKS_WAIT_S = 0.01  # how often an input waits for running generations to free the KV blocks it needs
INPUT_SHAPES = "a string, a list of strings, a list of token ids or a list of lists of token ids"
Vector = NDArray[np.float32]


def routes(embeddings: Embeddings) -> list[Route]:
    """POST /v1/embeddings and /pooling (an embedding model's) of a simulator."""
    return [
        Route("/v1/embeddings", embeddings.create, methods=["POST"]),
        Route("/pooling", embeddings.pool, methods=["POST"]),
    ]


class Embeddings:
    def __init__(self, config: SimConfig, tokenizer: ModelTokenizer, engine: Engine, request_log: RequestLog) -> None:
        self._config = config
        self._tokenizer = tokenizer
        self._engine = engine
        self._log = request_log
        self._vocab = vocab_size(tokenizer.tokenizer)

    @property
    def model(self) -> str:
        return self._config.model

    async def create(self, request: Request) -> Response:
        body = await self.read(request)
        vectors, prompt_tokens = await self.embed(
            body, self._inputs(body), _dimensions(body.get("dimensions"), self._config.model)
        )
        return self._answer(body, vectors, prompt_tokens, "embd", "embedding", "embedding")

    async def pool(self, request: Request) -> Response:
        """POST /pooling of an embedding model (its task "embed"): the vectors as /v1/embeddings makes them, each
        under `data` in an object "pooling"."""
        body = await self.read(request)
        task = body.get("task")
        if task not in (None, "embed"):
            raise bad_request(f"Task {task} is not supported, it must be one of the supported tasks: ['embed']", "task")
        vectors, prompt_tokens = await self.embed(
            body, self._inputs(body), _dimensions(body.get("dimensions"), self._config.model)
        )
        return self._answer(body, vectors, prompt_tokens, "pool", "pooling", "data")

    def _answer(
        self, body: JsonObject, vectors: list[Vector], prompt_tokens: int, prefix: str, kind: str, field: str
    ) -> Response:
        encoding = body.get("encoding_format") or "float"
        if encoding not in ("float", "base64"):
            raise bad_request(f"encoding_format {encoding!r} is not simulated: float or base64.", "encoding_format")
        data = [
            {"index": index, "object": kind, field: vector.tolist() if encoding == "float" else _base64(vector)}
            for index, vector in enumerate(vectors)
        ]
        answer = {
            "id": f"{prefix}-{uuid.uuid4().hex}",
            "object": "list",
            "created": int(time.time()),
            "model": self._config.model,
            "data": data,
            "usage": usage(prompt_tokens),
        }
        # Each float32 written as the double it is (0.1198030412197113), as vLLM 0.32 writes them.
        return Response(orjson.dumps(answer), media_type="application/json")

    async def embed(
        self, body: JsonObject, inputs: list[list[int]], dimensions: int = DIMENSIONS
    ) -> tuple[list[Vector], int]:
        """The vector of each input's tokens (each checked before any runs, then pooled through the KV cache), and
        the prompt tokens the engine reports for them all."""
        model = parse_model(body)
        if model is not None and model != self._config.model:  # like vLLM, an omitted model means the served one
            raise model_not_found(model)
        salt = body.get("cache_salt")
        if salt is not None and (not isinstance(salt, str) or not salt):
            raise bad_request("Parameter 'cache_salt' must be a non-empty string if provided.")
        for ids in inputs:
            self._check_length(len(ids))
        read = [await self._pool(ids, salt) for ids in inputs]
        if self._engine.paced:
            await asyncio.sleep(self._config.ttft_ms / 1000)
        normalize = flag(body, "use_activation", True)
        return [embedding(tokens, dimensions, normalize) for tokens, _ in read], sum(count for _, count in read)

    def encode(self, text: str) -> list[int]:
        """A text's tokens as the pooling runner reads them (special tokens added)."""
        return list(self._tokenizer.tokenizer.encode(text, add_special_tokens=True).ids)

    async def read(self, request: Request) -> JsonObject:
        """The body, recorded as it arrived (None when it is not a JSON object) for tests of what was forwarded."""
        try:
            body = parse_json_object(await request.body())
        except SimError:
            self._log.record(request.url.path, request.scope["headers"], None)
            raise
        self._log.record(request.url.path, request.scope["headers"], body)
        return body

    def _inputs(self, body: JsonObject) -> list[list[int]]:
        given = body.get("input")
        add_special_tokens = flag(body, "add_special_tokens", True)
        if isinstance(given, str):
            given = [given]
        elif isinstance(given, list) and given and all(_is_token(token) for token in given):
            given = [given]
        if not isinstance(given, list) or not given:
            raise bad_request(f"Field 'input' is required and must be {INPUT_SHAPES}.", "input")
        inputs = []
        for item in given:
            if isinstance(item, str):
                inputs.append(list(self._tokenizer.tokenizer.encode(item, add_special_tokens=add_special_tokens).ids))
            elif isinstance(item, list) and item and all(_is_token(token) for token in item):
                out_of_range = [token for token in item if not 0 <= token < self._vocab]
                if out_of_range:
                    raise bad_request(f"Token id {out_of_range[0]} is out of vocabulary", "input")
                inputs.append(item)
            else:
                raise bad_request(f"Field 'input' is required and must be {INPUT_SHAPES}.", "input")
        return inputs

    def _check_length(self, count: int) -> None:
        """vLLM's refusals before anything runs: past the window, or (with no fault to act) past the KV cache."""
        if count > self._config.max_model_len:
            raise context_length_exceeded(self._config.max_model_len, count)
        capacity = self._engine.prefill_capacity_tokens()
        if count > capacity and self._config.fault == "none":
            raise context_length_exceeded(capacity, count)

    async def _pool(self, ids: list[int], salt: str | None) -> tuple[list[int], int]:
        """The tokens the pooler reads for one input, and the prompt tokens the engine reports for it."""
        cache, counters = self._engine.cache, self._engine.counters
        if len(ids) > cache.capacity_tokens:
            # The placeholder (the input's first token, never written) is pooled over the pages it does not own.
            special = self._engine.detokenizer.special_ids
            stale = list(islice((token for token in cache.stale_tokens() if token not in special), len(ids)))
            counters.stale_kv_replies += 1
            counters.prompt_tokens += 1
            return stale or ids[:1], 1
        while (table := cache.allocate(ids, salt)) is None:
            await asyncio.sleep(BLOCKS_WAIT_S)
        cache.free(table)
        counters.prompt_tokens += len(ids)
        counters.prefix_cache_queries += len(ids)
        counters.prefix_cache_hits += table.hit_tokens
        counters.request_success["stop"] += 1
        return ids, len(ids)


def usage(prompt_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": prompt_tokens,
        "total_tokens": prompt_tokens,
        "completion_tokens": 0,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }


def _dimensions(value: Any, model: str) -> int:
    if value is None:
        return DIMENSIONS
    if not _is_token(value) or not 1 <= value <= DIMENSIONS:
        raise bad_request(f"Model {model!r} only supports dimensions in range [1, {DIMENSIONS}], got {value}.")
    return int(value)


def embedding(tokens: list[int], dimensions: int, normalize: bool) -> Vector:
    """The vector of these tokens: their mean direction, cut to `dimensions`, normalized, as float32."""
    mean: NDArray[np.float64] = np.mean([_direction(token) for token in tokens], axis=0)[:dimensions]
    norm = float(np.linalg.norm(mean))
    if normalize and norm > 0:
        mean = mean / norm
    return mean.astype(np.float32)


@lru_cache(maxsize=65_536)
def _direction(token: int) -> NDArray[np.float64]:
    """A fixed pseudo-random unit vector for a token id (never written to: it is shared)."""
    digest = hashlib.blake2b(token.to_bytes(8, "little"), digest_size=DIMENSIONS).digest()
    vector = np.frombuffer(digest, dtype=np.uint8).astype(np.float64) - 127.5
    return vector / np.linalg.norm(vector)


def _base64(vector: Vector) -> str:
    return base64.b64encode(vector.astype("<f4").tobytes()).decode("ascii")


def _is_token(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
