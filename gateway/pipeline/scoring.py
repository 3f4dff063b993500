"""A /v1/score or /v1/rerank answer, taken apart and built again, as embeddings.py does for vectors.

What goes out is built from what was parsed and checked: one finite score per pair (a rerank's per document, by its
index), the tenant-facing model name, the gateway's own count as `usage`, and, for a rerank, each document's text
taken from the request itself (never the engine's echo of it, which is scanned and dropped), ranked here, best first.
Every other field the engine sent is scanned and dropped. An answer with more or fewer scores than asked for, or an
index missing, repeated or out of range, did not answer what was sent: withheld as an isolation event
(SCORE_MISMATCH). One that is not a scoring answer at all, or whose scores are not finite numbers, is the backend's
garbage.
"""

from __future__ import annotations

import math
import secrets
from typing import Any

from gateway.errors import BackendBadResponse
from gateway.pipeline.embeddings import NUMBERS, Removed
from gateway.pipeline.relay import StreamWithheld
from gateway.schemas_pooling import RerankRequest, ScoreRequest

SCORE_MISMATCH = "score_mismatch"  # the isolation event of scores that do not answer the pairs sent
SCORE_BYTES = 256  # what one score's entry can take as JSON, with its index and object (a rerank's document aside)


def answer_bound(request: ScoreRequest | RerankRequest) -> int:
    """The most bytes an honest answer's scores take beside the request it echoes (a rerank's documents)."""
    return len(request.inputs) * SCORE_BYTES


def scores(
    body: dict[str, Any], request: ScoreRequest | RerankRequest, replica: str
) -> tuple[dict[int, float], Removed]:
    """The answer's scores by index (a score's `data`, a rerank's `results`: its `top_n` best), and every other field of
    it (never sent, scanned all the same). Raises StreamWithheld when they do not answer the request, BackendBadResponse
    when the answer is not a scoring answer."""
    rerank = isinstance(request, RerankRequest)
    items_name, score_name = ("results", "relevance_score") if rerank else ("data", "score")
    items = body.get(items_name)
    if not isinstance(items, list) or not all(isinstance(item, dict) for item in items):
        raise BackendBadResponse(f"Backend '{replica}' answered a scoring request without its scores.")
    size = len(request.texts) if isinstance(request, RerankRequest) else request.pairs
    wanted = request.ranked if isinstance(request, RerankRequest) else size
    if len(items) != wanted:
        raise StreamWithheld(f"the backend answered {len(items)} scores where {wanted} were asked for", SCORE_MISMATCH)
    removed: Removed = [(name, value) for name, value in body.items() if name not in (items_name, "usage")]
    found: dict[int, float] = {}
    for item in items:
        index = item.get("index")
        if type(index) is not int or not 0 <= index < size or index in found:
            raise StreamWithheld(f"the backend answered a score with index {index!r} of {size}", SCORE_MISMATCH)
        value = item.get(score_name)
        if type(value) not in NUMBERS or not math.isfinite(value):
            raise BackendBadResponse(f"Backend '{replica}' answered a score that is not a finite number.")
        found[index] = float(value)
        removed += [
            (f"{items_name}.{name}", value) for name, value in item.items() if name not in ("index", score_name)
        ]
    return found, removed


def answer(found: dict[int, float], request: ScoreRequest | RerankRequest, model: str, tokens: int) -> dict[str, Any]:
    """The answer the tenant gets, in vLLM's shape: the model as it named it, the exact count, the gateway's id."""
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    if isinstance(request, ScoreRequest):
        data = [{"index": index, "object": "score", "score": found[index]} for index in range(len(found))]
        return {"id": f"score-{secrets.token_hex(16)}", "object": "list", "model": model, "data": data, "usage": usage}
    texts = request.texts
    ranked = sorted(found.items(), key=lambda scored: (-scored[1], scored[0]))
    results = [
        {"index": index, "document": {"text": texts[index]}, "relevance_score": score} for index, score in ranked
    ]
    return {"id": f"rerank-{secrets.token_hex(16)}", "model": model, "usage": usage, "results": results}
