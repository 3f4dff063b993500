"""What the simulated server says about itself: vLLM's model list, and the JSON responses every route sends."""

from __future__ import annotations

import time
import uuid

import orjson
from starlette.responses import Response

from isolation.sim.config import SimConfig


def json_response(content: object, status_code: int = 200) -> Response:
    return Response(orjson.dumps(content), status_code=status_code, media_type="application/json")


def vllm_models(config: SimConfig) -> dict[str, object]:
    """vLLM's `GET /v1/models`: one card, whose max_model_len is the window (a router's, or a stage's)."""
    now = int(time.time())
    permission = {
        "id": f"modelperm-{uuid.uuid4().hex}",
        "object": "model_permission",
        "created": now,
        "allow_create_engine": False,
        "allow_sampling": True,
        "allow_logprobs": True,
        "allow_search_indices": False,
        "allow_view": True,
        "allow_fine_tuning": False,
        "organization": "*",
        "group": None,
        "is_blocking": False,
    }
    card = {
        "id": config.model,
        "object": "model",
        "created": now,
        "owned_by": "vllm",
        "root": config.model,
        "parent": None,
        "max_model_len": config.max_model_len,
        "permission": [permission],
    }
    return {"object": "list", "data": [card]}
