"""What the endpoint says about itself, and whether it can be audited at all.

In order: the model list (reachability, each key's authentication, the model, `max_model_len`), `/tokenize`
(exact token counts: vLLM's route, not under /v1), `/metrics` (the KV cache's size: vLLM's
`vllm:cache_config_info`, or the capacity a Bulkhead gateway enforces), the KV cache of each engine behind a
disaggregated router (--stage, or the workers the router lists: stages.py), and one short prompt per key that
must be answered. Whatever fails here is a reason the audit cannot run (errors.py), with the fix in the message.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace

import httpx

from isolation.audit.config import Identity, Role, Stage
from isolation.audit.endpoint import Endpoint, error_message
from isolation.audit.errors import AuthFailed, CannotRun, LimitUnknown, ModelMissing, StageUnreadable, Unreachable
from isolation.audit.exchange import Prompt
from isolation.audit.stages import VLLM_SOURCE, StageCapacity, listed_stages, read_stage
from isolation.engine_reports import vllm_cache_tokens

_BULKHEAD_CAPACITY = re.compile(
    r'^bulkhead_model_capacity_tokens\{[^}]*model="(?P<model>[^"]*)"[^}]*\} (?P<value>\S+)$', re.MULTILINE
)
UNKNOWN_CAPACITY = (
    "the endpoint does not say how much KV cache it holds: prompts the window admits but the cache cannot hold "
    "are only tried near the window; behind a router, name its engines with --stage ROLE=URL"
)


@dataclass(frozen=True)
class Bound:
    """A KV cache a prompt must fit in: the endpoint's own, or a prefill stage's."""

    tokens: int
    what: str  # "the KV cache", "prefill stage prefill-0's KV cache"
    source: str


@dataclass(frozen=True)
class EndpointFacts:
    limit: int  # the context window the audit holds the endpoint to
    limit_source: str
    kv_capacity: int | None = None  # tokens the KV cache holds, when the endpoint says
    kv_capacity_source: str | None = None
    exact_counts: bool = False  # /tokenize answers, so prompts have exact token counts
    notes: tuple[str, ...] = field(default=())
    stages: tuple[StageCapacity, ...] = ()  # the engines behind a router (--stage), as they said

    def smallest(self, role: Role) -> StageCapacity | None:
        """The stage of this role that holds least: a request may land on any of them."""
        return min((s for s in self.stages if s.stage.role == role), key=lambda s: s.kv_capacity, default=None)

    @property
    def prompt_bound(self) -> Bound | None:
        """The smallest KV cache every prompt must fit in whole: the endpoint's own, or a prefill stage's."""
        bounds = []
        if self.kv_capacity:
            bounds.append(Bound(self.kv_capacity, "the KV cache", self.kv_capacity_source or "the endpoint"))
        prefill = self.smallest("prefill")
        if prefill is not None:
            bounds.append(Bound(prefill.kv_capacity, f"{prefill.describe}'s KV cache", prefill.source))
        return min(bounds, key=lambda bound: bound.tokens, default=None)

    @property
    def decode_bound(self) -> StageCapacity | None:
        """The smallest decode stage: a prompt and its answer together must fit in it."""
        return self.smallest("decode")

    @property
    def effective_limit(self) -> int:
        """The longest prompt the endpoint can really hold: nothing beyond it may be answered."""
        bound = self.prompt_bound
        return min(self.limit, bound.tokens) if bound else self.limit

    def stage_statement(self, capacity: StageCapacity) -> str:
        """One stage's capacity against the window, in the report's words."""
        head = f"the window is {self.limit} tokens, {capacity.describe} holds {capacity.kv_capacity}"
        if capacity.kv_capacity >= self.limit:
            return f"{head}: the whole window fits"
        if capacity.stage.role == "prefill":
            return f"{head}: prompts between them are unsafe"
        return f"{head}: a prompt and its answer together over {capacity.kv_capacity} tokens are unsafe"


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
    capacity = vllm_cache_tokens(exposition)
    if capacity is not None:
        return capacity, f"/metrics {VLLM_SOURCE}"
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


def _reader(endpoint: Endpoint, stage: Stage) -> Endpoint:
    """The stage's own requests, on the audit's client and budget."""
    return Endpoint(endpoint.client, stage.url, endpoint.model, endpoint.budget)


async def _listed(endpoint: Endpoint, identity: Identity, notes: list[str]) -> list[StageCapacity]:
    """The stages a router lists itself (no --stage given, no KV cache of its own); one it lists but that cannot
    be read is a note: its address may be internal, and the user did not name it. No key goes to an address the
    user did not give."""
    held = []
    keyless = replace(identity, key=None)
    for stage in await listed_stages(endpoint, identity):
        try:
            held.append(await read_stage(_reader(endpoint, stage), stage, keyless))
        except StageUnreadable as exc:
            notes.append(f"{exc} (listed by the router's GET /workers; name it with --stage ROLE=URL to require it)")
    if held:
        listed = ", ".join(f"{s.stage.name} {s.stage.url}" for s in held)
        notes.append(f"stages listed by the router (GET /workers): {listed}")
    return held


async def discover(
    endpoint: Endpoint, identities: tuple[Identity, Identity], limit: int | None, stages: tuple[Stage, ...] = ()
) -> EndpointFacts:
    """What the endpoint says about itself and, with `stages`, what each engine behind it holds."""
    notes: list[str] = []
    # Identity B is checked separately only when it has a key of its own.
    distinct = identities if identities[0].key != identities[1].key else identities[:1]
    window = await _model_window(endpoint, distinct, notes)
    exact, tokenize_window = await _tokenize_works(endpoint, identities[0])
    capacity, capacity_source = await _kv_capacity(endpoint, identities[0])
    held = [await read_stage(_reader(endpoint, stage), stage, identities[0]) for stage in stages]
    if not stages and capacity is None:
        held = await _listed(endpoint, identities[0], notes)
    for identity in distinct:
        await _answers(endpoint, identity)
    if not endpoint.salts:
        notes.append("the endpoint refuses the cache_salt field: the identities differ by `user` only")
    if limit is not None:
        source, window = "--limit", limit
    elif window is not None:
        source = "/v1/models max_model_len"
    elif tokenize_window is not None:
        source, window = "/tokenize max_model_len", tokenize_window
    else:
        raise LimitUnknown("the endpoint does not say its context window (no max_model_len): give --limit TOKENS")
    facts = EndpointFacts(window, source, capacity, capacity_source, exact, tuple(notes), tuple(held))
    if facts.prompt_bound is None:
        facts = replace(facts, notes=(*facts.notes, UNKNOWN_CAPACITY))
    return facts
