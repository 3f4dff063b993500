"""POST /v1/score and /v1/rerank (and /score, /rerank, /v2/rerank) as vLLM serves them for an embedding model: a
bi-encoder, each text embedded on its own (embeddings.py: through the KV cache, stale faults included) and a pair
scored by the cosine of its two vectors.

Score takes `queries` with `documents` or `items`, `data_1` with `data_2`, or `text_1` with `text_2`: a text or a list
of them on each side, 1:1, 1:N or N:N, one score per pair. Rerank takes `query`, `documents` and `top_n` (0: all): the
documents scored against the query, best first, each with its text. Usage counts every text once, as vLLM's does (a
lone query is embedded once). Not simulated: cross-encoders (a classify model's pairs in one prompt), multimodal
inputs, the truncation fields.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import numpy as np
import orjson
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from isolation.sim.embeddings import Embeddings, usage
from isolation.sim.errors import bad_request
from isolation.sim.protocol import JsonObject

SCORE_SIDES = (("queries", "documents"), ("queries", "items"), ("data_1", "data_2"), ("text_1", "text_2"))


def routes(embeddings: Embeddings) -> list[Route]:
    scoring = Scoring(embeddings)
    return [
        *(Route(path, scoring.score, methods=["POST"]) for path in ("/score", "/v1/score")),
        *(Route(path, scoring.rerank, methods=["POST"]) for path in ("/rerank", "/v1/rerank", "/v2/rerank")),
    ]


class Scoring:
    def __init__(self, embeddings: Embeddings) -> None:
        self._embeddings = embeddings

    async def score(self, request: Request) -> Response:
        body = await self._embeddings.read(request)
        first, second = _score_sides(body)
        scores, prompt_tokens = await self._scores(body, first, second)
        data = [{"index": index, "object": "score", "score": score} for index, score in enumerate(scores)]
        answer = {
            "id": f"score-{uuid.uuid4().hex}",
            "object": "list",
            "created": int(time.time()),
            "model": self._embeddings.model,
            "data": data,
            "usage": usage(prompt_tokens),
        }
        return Response(orjson.dumps(answer), media_type="application/json")

    async def rerank(self, request: Request) -> Response:
        body = await self._embeddings.read(request)
        query = _texts(body.get("query"), "query")
        if len(query) != 1:
            raise bad_request("Field 'query' must be a string.", "query")
        documents = _texts(body.get("documents"), "documents")
        top_n = body.get("top_n", 0)
        if not isinstance(top_n, int) or isinstance(top_n, bool) or top_n < 0:
            raise bad_request("Field 'top_n' must be a non-negative integer.", "top_n")
        scores, prompt_tokens = await self._scores(body, query, documents)
        ranked = sorted(enumerate(scores), key=lambda scored: scored[1], reverse=True)[: top_n or len(scores)]
        results = [
            {"index": index, "document": {"text": documents[index], "multi_modal": None}, "relevance_score": score}
            for index, score in ranked
        ]
        answer = {
            "id": f"rerank-{uuid.uuid4().hex}",
            "model": self._embeddings.model,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
            "results": results,
        }
        return Response(orjson.dumps(answer), media_type="application/json")

    async def _scores(self, body: JsonObject, first: list[str], second: list[str]) -> tuple[list[float], int]:
        """The cosine of each pair (a lone first text against every second one), and the prompt tokens read."""
        if len(first) > 1 and len(first) != len(second):
            raise bad_request("Input lengths must be either 1:1, 1:N or N:N")
        encode = self._embeddings.encode
        vectors, prompt_tokens = await self._embeddings.embed(body, [encode(text) for text in [*first, *second]])
        lefts, rights = vectors[: len(first)], vectors[len(first) :]
        if len(lefts) == 1:
            lefts = lefts * len(rights)
        return [_cosine(left, right) for left, right in zip(lefts, rights, strict=True)], prompt_tokens


def _score_sides(body: JsonObject) -> tuple[list[str], list[str]]:
    for one, other in SCORE_SIDES:
        if one in body and other in body:
            return _texts(body[one], one), _texts(body[other], other)
    raise bad_request(
        "A score request takes queries and documents (or items), data_1 and data_2, or text_1 and text_2."
    )


def _texts(value: Any, name: str) -> list[str]:
    texts = [value] if isinstance(value, str) else value
    if not isinstance(texts, list) or not texts or not all(isinstance(text, str) for text in texts):
        raise bad_request(f"Field '{name}' must be a string or a non-empty list of strings.", name)
    return texts


def _cosine(left: Any, right: Any) -> float:
    a, b = np.asarray(left, dtype=np.float64), np.asarray(right, dtype=np.float64)
    norms = float(np.linalg.norm(a) * np.linalg.norm(b))
    return float(np.dot(a, b) / norms) if norms > 0 else 0.0
