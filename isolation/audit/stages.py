"""The engines behind a router: `--stage ROLE=URL`, and how much KV cache each one says it has.

A disaggregated deployment answers at a router that advertises the window and holds no KV cache itself; the
prompt's KV lives in a prefill engine, then in a decode engine. What the router admits, those engines must
hold, so each stage's capacity is read from the engine itself, whichever way it answers:

    vLLM    GET /metrics          vllm:cache_config_info{num_gpu_blocks, block_size}: tokens = their product
                                  (several engine series, data parallel: the smallest, one request runs on one)
    SGLang  GET /get_server_info  max_total_num_tokens (and context_length); per rank under internal_states
            (GET /server_info where /get_server_info is 404, as in later releases)

A stage that answers neither way cannot be vouched for, so it stops the audit (StageUnreadable). Stage requests
go through the audit's budget like every other; they carry no key unless the stage refuses them without one
(an SGLang server with --api-key guards every route), and then identity A's.

Without --stage, a router that lists its workers names them itself: SGLang's router (sgl-model-gateway)
answers `GET /workers` with `{"workers": [{"url": ..., "worker_type": "prefill" | "decode" | "regular"}, ...]}`.
Those stages are read the same way, but never with a key (the user did not give those addresses), and one that
cannot be read is a note, not an error: a router's worker addresses are often internal, out of the auditor's
reach, and the user did not ask for them.
"""

from __future__ import annotations

from dataclasses import dataclass

import httpx

from isolation.audit.config import ROLES, Identity, Stage, parse_stages
from isolation.audit.endpoint import Endpoint
from isolation.audit.errors import StageUnreadable, Unreachable
from isolation.engine_reports import parse_server_info, vllm_cache_tokens

VLLM_SOURCE = "vllm:cache_config_info (num_gpu_blocks × block_size)"
SGLANG_SOURCE = "max_total_num_tokens"


@dataclass(frozen=True)
class StageCapacity:
    """What one stage says it holds."""

    stage: Stage
    kv_capacity: int  # tokens its KV cache holds (the smallest of its engines or ranks)
    source: str  # the request and field it came from
    context_length: int | None = None  # its own window, where it says (SGLang)

    @property
    def describe(self) -> str:
        """How the report names it: "prefill stage prefill-0"."""
        return f"{self.stage.role} stage {self.stage.name}"


async def _get(endpoint: Endpoint, path: str, identity: Identity) -> httpx.Response:
    response = await endpoint.get(path)
    if response.status_code in (401, 403) and identity.key:
        response = await endpoint.get(path, identity)
    return response


def _json(response: httpx.Response) -> object:
    try:
        return response.json()
    except ValueError:
        return None


def _worker_role(value: object) -> str | None:
    """ "prefill", or serde's externally tagged `{"Prefill": {"bootstrap_port": 8998}}`: the role in lower case."""
    if isinstance(value, dict) and len(value) == 1:
        value = next(iter(value))
    return value.lower() if isinstance(value, str) else None


def parse_worker_list(body: object) -> tuple[Stage, ...]:
    """The prefill and decode workers of an SGLang router's `GET /workers`, in its order; () for anything else."""
    workers = body.get("workers") if isinstance(body, dict) else None
    if not isinstance(workers, list):
        return ()
    specs = []
    for worker in workers:
        if not isinstance(worker, dict) or not isinstance(worker.get("url"), str):
            continue
        role = _worker_role(worker.get("worker_type"))
        if role in ROLES and worker["url"].startswith(("http://", "https://")):
            specs.append(f"{role}={worker['url']}")
    try:
        return parse_stages(specs)
    except ValueError:
        return ()


async def listed_stages(endpoint: Endpoint, identity: Identity) -> tuple[Stage, ...]:
    """The stages the router at `endpoint` lists, if it lists any (SGLang's router: GET /workers)."""
    response = await endpoint.get("/workers", identity)
    return parse_worker_list(_json(response)) if response.status_code == 200 else ()


def _why(path: str, response: httpx.Response, missing: str) -> str:
    return f"GET {path}: {missing if response.status_code == 200 else f'HTTP {response.status_code}'}"


async def read_stage(endpoint: Endpoint, stage: Stage, identity: Identity) -> StageCapacity:
    """The stage's capacity, read by `endpoint` (its base URL the stage's); StageUnreadable when it says none."""
    tried = []
    try:
        metrics = await _get(endpoint, "/metrics", identity)
        tokens = vllm_cache_tokens(metrics.text) if metrics.status_code == 200 else None
        if tokens is not None:
            return StageCapacity(stage, tokens, f"GET {stage.url}/metrics {VLLM_SOURCE}")
        tried.append(_why("/metrics", metrics, "no vllm:cache_config_info"))
        for path in ("/get_server_info", "/server_info"):
            info = await _get(endpoint, path, identity)
            if info.status_code == 404:
                tried.append(_why(path, info, ""))
                continue
            tokens, context_length = parse_server_info(_json(info)) if info.status_code == 200 else (None, None)
            if tokens is not None:
                return StageCapacity(stage, tokens, f"GET {stage.url}{path} {SGLANG_SOURCE}", context_length)
            tried.append(
                f"GET {path}: {'no max_total_num_tokens' if info.status_code == 200 else 'HTTP '}"
                f"{'' if info.status_code == 200 else info.status_code}"
            )
            break
    except Unreachable as exc:
        raise StageUnreadable(f"{stage.role} stage {stage.name} ({stage.url}) is unreachable: {exc}") from exc
    raise StageUnreadable(
        f"{stage.role} stage {stage.name} ({stage.url}) does not say how much KV cache it holds ({'; '.join(tried)}): "
        "the audit cannot vouch for a stage it cannot see (it reads vLLM's /metrics or SGLang's /get_server_info)"
    )
