"""The simulator as SGLang's OpenAI-compatible server (SimConfig.engine "sglang"): the routes a gateway reads.

Generation (/v1/chat/completions, /v1/completions) is app.py's, shared with the vLLM flavor; what differs is here:
    GET  /v1/models                  SGLang's ModelList: owned_by "sglang", max_model_len the window
    GET  /health, /health_generate   200
    GET  /server_info                the server's arguments (context_length, page_size, disaggregation_mode, …)
    GET  /get_server_info            and scheduler info (max_total_num_tokens, max_req_input_len), internal_states,
                                     version; /get_server_info is the older name, both answer
    GET  /model_info, /get_model_info
    GET  /metrics                    sglang: names and labels (sglang_metrics.py)
    POST /tokenize, /v1/tokenize     {"prompt": str | [str], "add_special_tokens"} → {"tokens", "count",
                                     "max_model_len"}; max_model_len is the tokenizer's model_max_length
    POST /detokenize, /v1/detokenize {"tokens": [int] | [[int]], "skip_special_tokens"} → {"text"}
Any other path answers 404 `{"detail": "Not Found"}` as FastAPI does: /version (SGLang has none), and the routes
real SGLang has but the simulator does not play in this flavor (/v1/responses, /v1/messages, /v1/embeddings,
/generate, …).

SGLang's differences on the generation routes: refusals are flat `{"object": "error", …}` bodies (errors.py;
a streamed request its scheduler aborts gets HTTP 200, an SSE error event, then [DONE]); the model name is not
checked; the prefix cache is namespaced by the pair (`extra_key`, `cache_salt`), as current SGLang's radix tree
is (older releases concatenated the two into one extra key).

In a disaggregated deployment each stage answers /get_server_info with its own pool as max_total_num_tokens,
the window as context_length and its role as disaggregation_mode; the router answers it in the shape of SGLang's
mini load balancer, {"internal_states", "prefill", "decode"}, without relaying the stages' info, so it reports no
KV size at all: a gateway has to read the stages.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from http import HTTPStatus
from pathlib import Path
from typing import Any

import orjson
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from isolation.sim.config import SimConfig
from isolation.sim.engine import Engine
from isolation.sim.errors import SimError, render_sglang_error
from isolation.sim.info import json_response
from isolation.sim.metrics import View, render
from isolation.sim.protocol import JsonObject, parse_json_object
from isolation.sim.sglang_metrics import build_sglang_registry
from isolation.tokens import ModelTokenizer

VERSION = "0.5.0-sim"
UNSET_MODEL_MAX_LENGTH = int(1e30)  # Hugging Face's VERY_LARGE_INTEGER, a tokenizer's model_max_length when unset
_DISAGGREGATION_MODES = {"engine": "null", "router": "null", "prefill": "prefill", "decode": "decode"}
_OPEN_PREFIXES = ("/health", "/metrics", "/sim/")
_KEYS = ("extra_key", "cache_salt")  # SGLang's --api-key leaves /health* and /metrics open


def guarded(path: str) -> bool:
    """Whether SGLang's --api-key guards a path (every one but /health*, /metrics and the simulator's own)."""
    return not path.startswith(_OPEN_PREFIXES)


async def _not_found(request: Request, exc: Exception) -> Response:
    status = exc.status_code if isinstance(exc, HTTPException) else 500
    detail = exc.detail if isinstance(exc, HTTPException) else "Internal Server Error"
    return json_response({"detail": detail}, status)


EXCEPTION_HANDLERS: dict[Any, Callable[[Request, Exception], Any]] = {
    SimError: render_sglang_error,
    HTTPException: _not_found,
}


def extra_key(body: JsonObject) -> tuple[JsonObject, str | None]:
    """The body without `extra_key` and `cache_salt`, and the prefix cache's namespace they name together: the
    pair (extra_key, cache_salt), as current SGLang keys its radix tree (the pair, not a concatenation: "ab" + "c"
    and "a" + "bc" stay apart); None for neither."""
    pair = [value if isinstance(value := body.get(name), str) and value else None for name in _KEYS]
    rest = {name: value for name, value in body.items() if name not in _KEYS}
    return rest, None if pair == [None, None] else orjson.dumps(pair).decode()


def streamed_refusal(exc: SimError) -> Response:
    """SGLang's scheduler aborting a streamed request: HTTP 200, an error event typed with the status's name, then
    [DONE] (serving_chat's abort path)."""
    error = {**exc.sglang_error(), "type": HTTPStatus(exc.status).name}
    event = orjson.dumps({"error": error})
    return Response(b"data: " + event + b"\n\ndata: [DONE]\n\n", media_type="text/event-stream")


def models_body(config: SimConfig) -> dict[str, object]:
    card = {
        "id": config.model,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "sglang",
        "root": config.model,
        "parent": None,
        "max_model_len": config.max_model_len,
    }
    return {"object": "list", "data": [card]}


def server_info(config: SimConfig, engine: Engine, view: View) -> dict[str, object]:
    """What SGLang's /server_info says of one engine (a stage: of its pool), the fields a gateway reads among the
    server arguments it lists (not its API key, which SGLang lists too)."""
    if view == "router":
        return {
            "internal_states": [{"last_gen_throughput": 0.0, "avg_spec_accept_length": None}],
            "prefill": [],
            "decode": [],
        }
    pool = engine.pools.get("decode" if view == "decode" else "prefill")
    kv_tokens = engine.cache.capacity_tokens if pool is None else pool.capacity_tokens
    window = config.max_model_len
    args: dict[str, object] = {
        "model_path": config.model,
        "tokenizer_path": config.model,
        "served_model_name": config.model,
        "context_length": window,  # as if launched with --context-length: SGLang says null without it
        "page_size": config.block_size,
        "max_running_requests": config.max_num_seqs,
        "schedule_policy": "fcfs",
        "disaggregation_mode": _DISAGGREGATION_MODES[view],
        "tp_size": 1,
        "dp_size": 1,
        "enable_metrics": True,
        "enable_cache_report": False,
        "allow_auto_truncate": False,
    }
    rank = {
        **args,
        "last_gen_throughput": 0.0,
        "memory_usage": {"weight": 0.0, "kvcache": 0.0, "token_capacity": kv_tokens, "graph": 0.0},
        "effective_max_running_requests_per_dp": config.max_num_seqs,
    }
    return {
        **args,
        "status": "ready",
        "max_total_num_tokens": kv_tokens,
        "max_req_input_len": min(window - 1, kv_tokens - 1),
        "internal_states": [rank],
        "version": VERSION,
    }


def model_info(config: SimConfig) -> dict[str, object]:
    return {
        "model_path": config.model,
        "tokenizer_path": config.model,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": "default",
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
    }


class _Info:
    """The routes that describe the server, for the main app (`view` "engine" or "router") or a stage."""

    def __init__(self, config: SimConfig, engine: Engine, view: View) -> None:
        self.config = config
        self.engine = engine
        self.view = view
        self.registry = build_sglang_registry(engine, view)

    async def models(self, request: Request) -> Response:
        return json_response(models_body(self.config))

    async def health(self, request: Request) -> Response:
        return Response(status_code=200)

    async def server_info(self, request: Request) -> Response:
        return json_response(server_info(self.config, self.engine, self.view))

    async def model_info(self, request: Request) -> Response:
        return json_response(model_info(self.config))

    async def metrics(self, request: Request) -> Response:
        return Response(render(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    def routes(self) -> list[Route]:
        return [
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/health_generate", self.health, methods=["GET"]),
            Route("/get_server_info", self.server_info, methods=["GET"]),
            Route("/server_info", self.server_info, methods=["GET"]),
            Route("/get_model_info", self.model_info, methods=["GET"]),
            Route("/model_info", self.model_info, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
        ]


class _Tokens:
    """SGLang's /tokenize and /detokenize (serving_tokenize.py): plain text only, no chat messages."""

    def __init__(self, tokenizer: ModelTokenizer, tokenizer_dir: Path) -> None:
        self.tokenizer = tokenizer.tokenizer
        self.model_max_length = _model_max_length(tokenizer_dir)

    async def tokenize(self, request: Request) -> Response:
        body = parse_json_object(await request.body())
        prompt, add_special = body.get("prompt"), body.get("add_special_tokens", True)
        if not isinstance(add_special, bool):
            raise _invalid("add_special_tokens", "Input should be a valid boolean")
        if isinstance(prompt, str):
            ids = list(self.tokenizer.encode(prompt, add_special_tokens=add_special).ids)
            return json_response({"tokens": ids, "count": len(ids), "max_model_len": self.model_max_length})
        if isinstance(prompt, list) and all(isinstance(text, str) for text in prompt):
            lists = [list(self.tokenizer.encode(text, add_special_tokens=add_special).ids) for text in prompt]
            counts = [len(ids) for ids in lists]
            return json_response({"tokens": lists, "count": counts, "max_model_len": self.model_max_length})
        raise _invalid("prompt", "Input should be a valid string or a list of strings")

    async def detokenize(self, request: Request) -> Response:
        body = parse_json_object(await request.body())
        tokens, skip = body.get("tokens"), body.get("skip_special_tokens", True)
        if not isinstance(skip, bool):
            raise _invalid("skip_special_tokens", "Input should be a valid boolean")
        if isinstance(tokens, list) and all(_is_id(token) for token in tokens):
            return json_response({"text": self.tokenizer.decode(tokens, skip_special_tokens=skip) if tokens else ""})
        if isinstance(tokens, list) and all(isinstance(ids, list) and all(map(_is_id, ids)) for ids in tokens):
            return json_response({"text": [self.tokenizer.decode(ids, skip_special_tokens=skip) for ids in tokens]})
        raise SimError("Invalid tokens type. Expected List[int] or List[List[int]].")

    def routes(self) -> list[Route]:
        return [
            Route(path, handler, methods=["POST"])
            for path, handler in (
                ("/tokenize", self.tokenize),
                ("/v1/tokenize", self.tokenize),
                ("/detokenize", self.detokenize),
                ("/v1/detokenize", self.detokenize),
            )
        ]


def routes(config: SimConfig, engine: Engine, tokenizer: ModelTokenizer, view: View) -> list[Route]:
    """The main app's SGLang routes besides generation."""
    return [*_Info(config, engine, view).routes(), *_Tokens(tokenizer, config.tokenizer_dir).routes()]


def stage_routes(config: SimConfig, engine: Engine, view: View) -> list[Route]:
    """A disaggregated stage's routes: what it says about itself, its pool included."""
    return _Info(config, engine, view).routes()


def _invalid(field: str, problem: str) -> SimError:
    """FastAPI's request validation failure, which SGLang renders as a 400 of type "Bad Request"."""
    return SimError(f"1 validation error: body.{field}: {problem}", error_type="Bad Request")


def _is_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _model_max_length(tokenizer_dir: Path) -> int:
    try:
        config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return UNSET_MODEL_MAX_LENGTH
    value = config.get("model_max_length") if isinstance(config, dict) else None
    return value if isinstance(value, int) and not isinstance(value, bool) else UNSET_MODEL_MAX_LENGTH
