"""An embeddings answer (or /pooling's, its vectors under `data`), taken apart and built again: only vectors that
answer the inputs sent go out.

A vector carries no text to scan, but every field of an answer is a channel: what goes out is built from what was
parsed and checked (`object`, `data[].object`, `index`, `embedding`, the tenant-facing model name and the gateway's
own count as `usage`), never the engine's bytes. The engine is always asked for floats, and base64 is written here
from them, as OpenAI writes it (little-endian float32). An answer with more or fewer vectors than inputs, an index
missing, repeated or out of range, or vectors of different sizes did not answer what was sent: it is withheld as an
isolation event (EMBEDDING_MISMATCH). One that is not an embeddings answer at all is the backend's garbage.
"""

from __future__ import annotations

import base64
import struct
from typing import Any

from gateway.errors import BackendBadResponse
from gateway.pipeline.relay import StreamWithheld
from gateway.schemas import MAX_EMBEDDING_DIMENSIONS, EmbeddingRequest
from gateway.schemas_pooling import PoolingRequest

EMBEDDING_MISMATCH = "embedding_mismatch"  # the isolation event of vectors that do not answer the inputs
# What one number of a vector can take as JSON (`-1.2345678901234567e-05,`): with MAX_EMBEDDING_DIMENSIONS, the most
# an honest answer holds per input.
NUMBER_BYTES = 24
FLOAT32_MAX = 3.4028234663852886e38
NUMBERS = frozenset({float, int})
USAGE = ("prompt_tokens", "total_tokens", "completion_tokens")  # what the usage check reads; the rest is dropped

Removed = list[tuple[str, Any]]


def shape(request: EmbeddingRequest) -> tuple[str, str]:
    """Each vector's object and the field that holds it: OpenAI's embeddings, or vLLM's /pooling."""
    return ("pooling", "data") if isinstance(request, PoolingRequest) else ("embedding", "embedding")


def upstream_body(payload: dict[str, Any]) -> dict[str, Any]:
    """The request as the engine gets it: vectors always as floats, whatever the client asked for."""
    return {**payload, "encoding_format": "float"}


def answer_bound(request: EmbeddingRequest) -> int:
    """The most bytes the vectors of an honest answer take."""
    return len(request.inputs) * (request.dimensions or MAX_EMBEDDING_DIMENSIONS) * NUMBER_BYTES


def vectors(body: dict[str, Any], request: EmbeddingRequest, replica: str) -> tuple[list[list[float]], Removed]:
    """The answer's vectors in the order of the inputs, and every other field of it (never sent, scanned all the
    same). Raises StreamWithheld when the vectors do not answer the inputs, BackendBadResponse when the answer is not
    an embeddings answer."""
    data = body.get("data")
    if not isinstance(data, list) or not all(isinstance(item, dict) for item in data):
        raise BackendBadResponse(f"Backend '{replica}' answered an embeddings request without its vectors.")
    inputs = len(request.inputs)
    if len(data) != inputs:
        raise StreamWithheld(f"the backend answered {len(data)} vectors for {inputs} inputs", EMBEDDING_MISMATCH)
    removed: Removed = [(name, value) for name, value in body.items() if name not in ("data", "usage")]
    usage = body.get("usage")
    if isinstance(usage, dict):
        removed += [(f"usage.{name}", value) for name, value in usage.items() if name not in USAGE]
    found: dict[int, list[float]] = {}
    field = shape(request)[1]
    for item in data:
        index = item.get("index")
        if type(index) is not int or not 0 <= index < inputs or index in found:
            raise StreamWithheld(
                f"the backend answered a vector with index {index!r} for {inputs} inputs", EMBEDDING_MISMATCH
            )
        found[index] = _vector(item.get(field), replica)
        removed += [(f"data.{name}", value) for name, value in item.items() if name not in ("index", field)]
    sizes = {len(vector) for vector in found.values()}
    wanted = request.dimensions
    if len(sizes) != 1 or (wanted is not None and sizes != {wanted}):
        asked = f" ({wanted} asked for)" if wanted is not None else ""
        raise StreamWithheld(f"the backend answered vectors of {sorted(sizes)} dimensions{asked}", EMBEDDING_MISMATCH)
    return [found[index] for index in range(inputs)], removed


def _vector(value: Any, replica: str) -> list[float]:
    """A list of numbers a float32 holds; ints (a JSON `0`) as floats."""
    kinds = set(map(type, value)) if isinstance(value, list) else set()
    if not kinds or not kinds <= NUMBERS:
        raise BackendBadResponse(f"Backend '{replica}' answered an embedding that is not a list of numbers.")
    if max(map(abs, value)) > FLOAT32_MAX:
        raise BackendBadResponse(f"Backend '{replica}' answered an embedding with numbers no float32 holds.")
    return [float(number) for number in value] if int in kinds else value


def answer(vectors: list[list[float]], request: EmbeddingRequest, model: str, tokens: int) -> dict[str, Any]:
    """The answer the tenant gets: its vectors as it asked for them, the model as it named it, the exact count."""
    encode = _base64 if request.encoding_format == "base64" else None
    kind, field = shape(request)
    return {
        "object": "list",
        "data": [
            {"object": kind, "index": index, field: vector if encode is None else encode(vector)}
            for index, vector in enumerate(vectors)
        ],
        "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


def _base64(vector: list[float]) -> str:
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
