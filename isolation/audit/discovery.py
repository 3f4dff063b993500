"""What the endpoint says about itself, and whether it can be audited at all.

In order: the model list (reachability, each key's authentication, the model, `max_model_len`), `/tokenize`
(exact token counts: vLLM's route, not under /v1), `/metrics` (the KV cache's size: vLLM's
`vllm:cache_config_info`, or the capacity a Bulkhead gateway enforces), and one short prompt per key that must
be answered. Whatever fails here is a reason the audit cannot run (errors.py), with the fix in the message.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import httpx

from isolation.audit.config import Identity
from isolation.audit.endpoint import Endpoint, error_message
from isolation.audit.errors import AuthFailed, CannotRun, LimitUnknown, ModelMissing, Unreachable
from isolation.audit.exchange import Prompt

_CACHE_INFO = re.compile(r"^vllm:cache_config_info\{(?P<labels>[^}]*)\}", re.MULTILINE)
_LABEL = re.compile(r'(\w+)="([^"]*)"')
_BULKHEAD_CAPACITY = re.compile(
    r'^bulkhead_model_capacity_tokens\{[^}]*model="(?P<model>[^"]*)"[^}]*\} (?P<value>\S+)$', re.MULTILINE
)


@dataclass(frozen=True)
class EndpointFacts:
    limit: int  # the context window the audit holds the endpoint to
    limit_source: str
    kv_capacity: int | None = None  # tokens the KV cache holds, when the endpoint says
    kv_capacity_source: str | None = None
    exact_counts: bool = False  # /tokenize answers, so prompts have exact token counts
    notes: tuple[str, ...] = field(default=())

    @property
    def effective_limit(self) -> int:
        """The longest prompt the endpoint can really hold: nothing beyond it may be answered."""
        return min(self.limit, self.kv_capacity) if self.kv_capacity else self.limit


def _auth_failure(response: httpx.Response, identity: Identity, what: str) -> AuthFailed | None:
    if response.status_code not in (401, 403):
        return None
    whose = f"identity {identity.name}'s key" if identity.key else "no key (give --key)"
    detail = error_message(_safe_json(response)) or ""
    return AuthFailed(f"{what} refused {whose}: HTTP {response.status_code} {detail}".strip())


def _safe_json(response: httpx.Response) -> object:
    try:
        return response.json()
    except ValueError:
        return None


async def _model_window(endpoint: Endpoint, identities: tuple[Identity, ...], notes: list[str]) -> int | None:
    window = None
    for identity in identities:
        response = await endpoint.get("/v1/models", identity)
        failure = _auth_failure(response, identity, "GET /v1/models")
        if failure:
            raise failure
        body = _safe_json(response)
        if response.status_code != 200 or not isinstance(body, dict) or not isinstance(body.get("data"), list):
            notes.append(f"GET /v1/models answered HTTP {response.status_code}: model list not checked")
            continue
        cards = [card for card in body["data"] if isinstance(card, dict)]
        card = next((c for c in cards if c.get("id") == endpoint.model), None)
        if card is None:
            served = ", ".join(str(c.get("id")) for c in cards[:10]) or "none"
            raise ModelMissing(f"model {endpoint.model!r} is not served to identity {identity.name} (served: {served})")
        value = card.get("max_model_len")
        if isinstance(value, int) and value > 0:
            window = value
    return window


async def _tokenize_works(endpoint: Endpoint, identity: Identity) -> tuple[bool, int | None]:
    body = {"model": endpoint.model, "messages": [{"role": "user", "content": "ping"}]}
    response = await endpoint.post("/tokenize", body, identity)
    answer = _safe_json(response)
    if response.status_code != 200 or not isinstance(answer, dict) or not isinstance(answer.get("count"), int):
        return False, None
    window = answer.get("max_model_len")
    return True, window if isinstance(window, int) and window > 0 else None


async def _kv_capacity(endpoint: Endpoint, identity: Identity) -> tuple[int | None, str | None]:
    response = await endpoint.get("/metrics", identity)
    if response.status_code != 200:
        return None, None
    return parse_capacity(response.text, endpoint.model)


def parse_capacity(exposition: str, model: str) -> tuple[int | None, str | None]:
    """The KV capacity in tokens from a Prometheus exposition, and where it came from.

    vLLM exports its cache config as labels; with several engines (data parallel) one request still lands on
    one engine, so the smallest counts. A Bulkhead gateway exports the capacity it enforces per model.
    """
    capacities = []
    for match in _CACHE_INFO.finditer(exposition):
        labels = dict(_LABEL.findall(match["labels"]))
        try:
            capacities.append(int(labels["num_gpu_blocks"]) * int(labels["block_size"]))
        except (KeyError, ValueError):
            continue
    if capacities:
        return min(capacities), "/metrics vllm:cache_config_info (num_gpu_blocks × block_size)"
    for match in _BULKHEAD_CAPACITY.finditer(exposition):
        if match["model"] == model:
            try:
                value = int(float(match["value"]))
            except ValueError:
                continue
            if value > 0:
                return value, "/metrics bulkhead_model_capacity_tokens"
    return None, None


async def _answers(endpoint: Endpoint, identity: Identity) -> None:
    """One short prompt must be answered; a refusal of the cache_salt field turns salting off and retries."""
    prompt = Prompt("Reply with one word.", tokens=0, exact=False, label="discovery")
    for _ in range(2):
        exchange = await endpoint.chat(identity, prompt, max_tokens=4, stream=False)
        if exchange.answered:
            return
        if exchange.status == 0:
            raise Unreachable(f"the endpoint did not answer a one-line prompt: {exchange.error}")
        if exchange.status in (401, 403):
            whose = f"identity {identity.name}'s key" if identity.key else "no key (give --key)"
            raise AuthFailed(f"POST /v1/chat/completions refused {whose}: HTTP {exchange.status} {exchange.error}")
        if exchange.status == 404:
            raise ModelMissing(f"POST /v1/chat/completions: HTTP 404 {exchange.error}")
        if exchange.status == 400 and "cache_salt" in (exchange.error or "") and endpoint.salts:
            endpoint.salts = False
            continue
        raise CannotRun(f"the endpoint did not answer a one-line prompt: HTTP {exchange.status} {exchange.error}")


async def discover(endpoint: Endpoint, identities: tuple[Identity, Identity], limit: int | None) -> EndpointFacts:
    notes: list[str] = []
    # Identity B is checked separately only when it has a key of its own.
    distinct = identities if identities[0].key != identities[1].key else identities[:1]
    window = await _model_window(endpoint, distinct, notes)
    exact, tokenize_window = await _tokenize_works(endpoint, identities[0])
    capacity, capacity_source = await _kv_capacity(endpoint, identities[0])
    for identity in distinct:
        await _answers(endpoint, identity)
    if not endpoint.salts:
        notes.append("the endpoint refuses the cache_salt field: the identities differ by `user` only")
    if limit is not None:
        return EndpointFacts(limit, "--limit", capacity, capacity_source, exact, tuple(notes))
    if window is not None:
        return EndpointFacts(window, "/v1/models max_model_len", capacity, capacity_source, exact, tuple(notes))
    if tokenize_window is not None:
        return EndpointFacts(tokenize_window, "/tokenize max_model_len", capacity, capacity_source, exact, tuple(notes))
    raise LimitUnknown("the endpoint does not say its context window (no max_model_len): give --limit TOKENS")
