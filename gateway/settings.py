"""Typed settings, read once from a YAML file and `BULKHEAD_*` environment variables; nothing else reads either.

Environment variables override the file: `BULKHEAD_REDIS_URL=redis://...`, nested keys joined by a double
underscore (`BULKHEAD_LISTEN__PORT=9000`, `BULKHEAD_LIMITS__MAX_BODY_BYTES=1048576`). A value is read as YAML,
so numbers, booleans and JSON lists (`BULKHEAD_BACKENDS='[{"name": "a", "url": "http://..."}]'`) work.
A bad file or variable fails at start with the file (or variable), the key and the reason.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, Self
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from gateway.otel_variables import DISABLED, sdk_disabled, tracing_overrides
from gateway.settings_errors import Loc, Sources, read_yaml, report, yaml_problem
from isolation.inject import MarkerPlacement

ENV_PREFIX = "BULKHEAD_"
KEY_HASH_PATTERN = re.compile(r"^sha256:[0-9a-f]{64}$")
TENANT_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
# Every Redis key, stream, channel and consumer group starts with the prefix, so deployments on one Redis with
# different prefixes share nothing. Braces are allowed for a Redis Cluster hash tag (`{app}:`).
REDIS_KEY_PREFIX = "bulkhead:"
REDIS_KEY_PREFIX_PATTERN = re.compile(r"^[A-Za-z0-9:_.{}-]{1,64}$")


class SettingsError(Exception):
    """Settings that cannot be used; the message names where the bad value came from."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ListenSettings(_Section):
    """Where the gateway listens."""

    host: str = Field(default="127.0.0.1", description="the address to listen on (`serve --host` overrides it)")
    port: int = Field(
        default=8080, ge=0, le=65535, description="`serve --port` overrides it; 0: any free port, shown in the banner"
    )


class LimitSettings(_Section):
    """Bounds on any one request's shape, for every tenant."""

    max_body_bytes: int = Field(default=8 * 1024 * 1024, ge=1024, description="request bodies above this get 413")
    # At most 250: what is accepted must also serialize upstream (orjson writes 254 levels at most).
    max_json_depth: int = Field(default=32, ge=4, le=250, description="deeper JSON gets 400")
    # The numbers and why each is what it is: docs/api.md#limits-on-a-request-body.
    max_json_values: int = Field(
        default=131_072,
        ge=1024,
        description="values in one request body (objects, arrays, strings, numbers, booleans, nulls): more gets 413",
    )
    max_messages: int = Field(
        default=10_000,
        ge=1,
        description="messages of one request (chat, Messages), or its input items (Responses): more gets 400",
    )
    max_content_parts: int = Field(
        default=1_000,
        ge=1,
        description="content parts (Messages: blocks) of one message, system prompt or tool result: more gets 400",
    )
    max_tools: int = Field(default=512, ge=1, description="tools one request defines: more gets 400")
    inline_json_values: int = Field(
        default=16_384,
        ge=0,
        description="a body with at most this many commas and brackets is parsed and checked on the event loop; a "
        "larger one is checked in a worker process first",
    )
    body_check_processes: int = Field(
        default=1, ge=1, le=64, description="worker processes checking large bodies, per gateway process"
    )
    max_output_tokens: int = Field(default=1_048_576, ge=1, description="max_tokens above this is absurd: 400")
    max_n: int = Field(default=16, ge=1, le=128, description="choices per request")
    max_embedding_tokens: int = Field(
        default=300_000, ge=1, description="tokens summed over the inputs of one embeddings request (OpenAI's cap)"
    )


class UpstreamSettings(_Section):
    """The one HTTP client to the backends (per process), and how often the replicas are read."""

    connect_timeout_s: float = Field(default=5.0, gt=0, description="to open a connection to a backend")
    read_timeout_s: float = Field(default=300.0, gt=0, description="longest silence between two bytes")
    write_timeout_s: float = Field(default=30.0, gt=0, description="longest wait to send a request's bytes upstream")
    pool_timeout_s: float = Field(default=5.0, gt=0, description="wait for a free connection")
    max_connections: int = Field(default=512, ge=1, description="connections to all backends, per process")
    max_keepalive_connections: int = Field(default=128, ge=0, description="idle connections kept open for reuse")
    keepalive_expiry_s: float = Field(
        default=4.0,
        ge=0,
        description="below the backend's idle timeout (uvicorn and vLLM: 5 s), or reuse races its close and the "
        "request fails (it is never sent again)",
    )
    health_interval_s: float = Field(default=5.0, gt=0, description="how often each backend's /health is checked")
    capacity_refresh_s: float = Field(
        default=60.0, gt=0, description="re-read what every backend and stage holds (window, KV cache)"
    )
    load_interval_s: float = Field(
        default=1.0, gt=0, description="read every replica's load (running, waiting, KV usage) from its /metrics"
    )
    on_stage_unread: Literal["last_known", "refuse"] = Field(
        default="last_known",
        description="a disaggregated backend's stage that cannot be read: last_known keeps the limit it last set "
        "(and /readyz says so); refuse answers its models' requests 503 capacity_unknown until it is read again",
    )


EngineKind = Literal["vllm", "sglang"]
URL_PATTERN = r"^https?://[^\s/]+(/[^\s]*)?$"


class StageSettings(_Section):
    """One engine of a disaggregated backend (a prefill or a decode instance behind its router): an endpoint the
    gateway reads for what it holds, never one it sends requests to."""

    role: Literal["prefill", "decode"] = Field(
        description="prefill: its KV cache bounds a prompt; decode: its KV cache bounds prompt + output"
    )
    url: str = Field(pattern=URL_PATTERN, description="the engine's own server: its /metrics, /v1/models, ...")
    name: str = Field(
        default="", description="in events, metrics and /admin/capacity; unset = its role and its index (prefill-0)"
    )
    kind: EngineKind | None = Field(default=None, description="unset = the backend's kind")

    @field_validator("url")
    @classmethod
    def _strip_slash(cls, value: str) -> str:
        return value.rstrip("/")


class BackendSettings(_Section):
    """One engine replica: a vLLM or SGLang OpenAI-compatible server, or the router of a disaggregated one."""

    name: str = Field(min_length=1, description="the replica's name in models[].backends, events and metrics")
    url: str = Field(pattern=URL_PATTERN, description="a vLLM or SGLang OpenAI server, or a P/D router")
    kind: EngineKind = Field(
        default="vllm", description="the engine's kind: how its capacity, load and token counts are read"
    )
    api_key: str | None = Field(default=None, repr=False, description="sent upstream as a Bearer token")
    max_num_seqs: int | None = Field(
        default=None, ge=1, description="the engine's --max-num-seqs; unset = learned from /metrics when it queues"
    )
    stages: list[StageSettings] = Field(
        default=[],
        description="a disaggregated backend's prefill and decode engines: prompts are admitted against the "
        "smallest prefill KV cache, prompt + output against the smallest decode KV cache",
    )

    @field_validator("url")
    @classmethod
    def _strip_slash(cls, value: str) -> str:
        return value.rstrip("/")

    @field_validator("stages")
    @classmethod
    def _name_stages(cls, stages: list[StageSettings]) -> list[StageSettings]:
        named: list[StageSettings] = []
        for stage in stages:
            index = sum(1 for other in named if other.role == stage.role)
            named.append(stage if stage.name else stage.model_copy(update={"name": f"{stage.role}-{index}"}))
        _unique("stages", [stage.name for stage in named])
        return named

    def stage_kind(self, stage: StageSettings) -> EngineKind:
        return stage.kind or self.kind


class FairnessSettings(_Section):
    """When every replica of a model is saturated, admitted requests wait at the gateway, fairly across tenants."""

    enabled: bool = Field(default=True, description="queue at the gateway when the replicas are saturated")
    max_queue_wait_s: float = Field(
        default=30.0, gt=0, description="a request that would wait longer, or has waited this long, gets 429"
    )
    max_queue_depth: int = Field(default=1000, ge=1, description="requests queued for the model; beyond: 429")
    max_waiting: int = Field(
        default=0, ge=0, description="a replica with more requests than this waiting in its engine is saturated"
    )
    max_kv_usage: float = Field(
        default=0.9,
        gt=0,
        le=1,
        description="a replica whose KV cache is this full (vllm:kv_cache_usage_perc) is saturated",
    )
    light_reserve: int = Field(
        default=1,
        ge=0,
        description="slots per replica (of 4x as many or more) kept free, while others are backlogged, for tenants "
        "lately served with nothing queued and their weighted share of the slots or less in flight",
    )
    batch_reserve: float = Field(
        default=0.25, ge=0, lt=1, description="share of a replica's running slots queued (batch) jobs leave free"
    )
    forward_priority: bool = Field(
        default=False, description="send the tenant's limits.priority as vLLM's priority (--scheduling-policy priority)"
    )


class ModelSettings(_Section):
    """A model as clients name it, its replicas, how its prompts are admitted and its answers verified."""

    name: str = Field(min_length=1, description="as clients send it and the backends serve it")
    backends: list[str] = Field(min_length=1, description="names from backends[]: the replicas serving it")
    task: Literal["generate", "embed"] = Field(
        default="generate",
        description="what its engines do: generate text (chat, completions, Responses, Messages) or embed "
        "(/v1/embeddings, /pooling, /v1/score, /v1/rerank; vLLM's --runner pooling); a request of the other kind "
        "gets 400, never forwarded",
    )
    tokenizer: Path | None = Field(
        default=None,
        description="HF tokenizer dir; unset = ask the backend's /tokenize (an answer past 1 MiB + 16 bytes a byte "
        "asked is a 502)",
    )
    marker_placement: MarkerPlacement | None = Field(
        default=None, description="this model's canary placement; unset = isolation.canary.placement"
    )
    context_window: int | None = Field(default=None, ge=1, description="the window advertised to clients")
    kv_capacity_tokens: int | None = Field(
        default=None, ge=1, description="a KV pool the gateway cannot see, e.g. a disaggregated prefill pool"
    )
    default_output_reserve: int = Field(
        default=4096, ge=1, description="chat output sent upstream without max_tokens, cut to the room left"
    )
    usage_tolerance: int = Field(default=0, ge=0, description="allowed |backend prompt_tokens - our count|")
    limit_by_kv_capacity: bool = Field(
        default=True, description="also cap prompts at the KV capacity the backends report, not only their window"
    )
    verify_usage: bool = Field(default=True, description="withhold answers whose usage does not match our count")
    cache_salt: bool = Field(
        default=True, description="send each tenant's cache_salt (vLLM >= 0.9); off for engines that refuse it"
    )
    continuous_usage: bool = Field(
        default=True, description="ask for usage on every stream chunk, so a stream is verified before any content"
    )
    fairness: FairnessSettings = FairnessSettings()


class TenantLimits(_Section):
    """One tenant's limits; unset = no limit of that kind."""

    max_concurrent_requests: int | None = Field(default=None, ge=1, description="per gateway instance; 429 above")
    max_output_tokens: int | None = Field(default=None, ge=1, description="max_tokens above this gets 400")
    max_prompt_tokens: int | None = Field(default=None, ge=1, description="the tenant's cap on prompt + output")
    requests_per_minute: int | None = Field(default=None, ge=1, description="across all instances; 429 above")
    tokens_per_minute: int | None = Field(default=None, ge=1, description="prompt + reserved output; 429 above")
    max_queued_requests: int | None = Field(
        default=None, ge=1, description="queued or running async requests; unset = queue.max_queued_per_tenant"
    )
    on_output_overflow: Literal["reject", "clamp"] = Field(
        default="reject", description="prompt + max_tokens over the limit: 400, or cut max_tokens to fit"
    )
    weight: float = Field(
        default=1.0, ge=0.01, le=1000, description="share of a saturated model's capacity against other tenants"
    )
    priority: int = Field(
        default=0, ge=-1000, le=1000, description="lower is served first when queued (vLLM's convention)"
    )


class TenantSettings(_Section):
    """A tenant fixed in the settings (read-only through the admin API; runtime tenants live in the directory)."""

    id: str = Field(
        pattern=TENANT_ID_PATTERN, description="1-64 letters, digits or . _ -, starting with a letter or digit"
    )
    key_hashes: list[str] = Field(min_length=1, description="`sha256:<hex>` of each API key (`bulkhead keys create`)")
    models: list[str] = Field(default_factory=lambda: ["*"], description='model names, or "*" for all')
    limits: TenantLimits = TenantLimits()

    @field_validator("key_hashes")
    @classmethod
    def _hashes(cls, values: list[str]) -> list[str]:
        for value in values:
            if not KEY_HASH_PATTERN.match(value):
                raise ValueError("each key hash must be 'sha256:' and 64 lower-case hex digits")
        return values

    def may_use(self, model: str) -> bool:
        return "*" in self.models or model in self.models

    def incarnation(self) -> str:
        """This tenant, told apart from another of the same id before or after it. What the gateway keeps per tenant
        must not pass to a tenant created under a deleted one's id: its cache salt (a shared prefix cache), canary
        marker (the old one's marker would read as the new one's own), prompt fingerprints, queued jobs, rate-limit
        budgets and kept counts (gateway/pipeline/piece_counts.py). A configured tenant is one for the life of the
        process."""
        return self.id


class TenantDirectorySettings(_Section):
    """Tenants and keys made at runtime through the admin API."""

    resync_s: float = Field(
        default=30.0, gt=0, description="re-read every cached key and tenant (pub/sub invalidates at once)"
    )
    cache_keys: int = Field(default=100_000, ge=1, description="runtime API keys kept in this instance's memory")
    negative_ttl_s: float = Field(
        default=30.0, gt=0, le=3600, description="an unknown key is refused without asking Redis for this long"
    )
    negative_keys: int = Field(default=100_000, ge=1, description="unknown keys remembered (~150 B each)")
    cold_lookups_per_s: float = Field(
        default=1000.0, gt=0, description="Redis reads for keys not in memory, per instance; beyond: 503"
    )
    audit_events_max: int = Field(default=10_000, ge=100, description="admin changes kept (Redis stream or memory)")


class RateLimitSettings(_Section):
    """Requests and tokens per minute, counted across instances."""

    on_store_failure: Literal["fail_open", "fail_closed"] = Field(
        default="fail_open", description="Redis unreachable: per-instance limits (open) or 503 (closed)"
    )


class QueueSettings(_Section):
    """The async (queued) API and its workers."""

    workers: int = Field(default=1, ge=0, description="queue workers inside `bulkhead serve` (0: none)")
    result_ttl_s: int = Field(default=86_400, ge=60, description="how long finished results can be polled")
    reclaim_after_s: float = Field(default=60.0, gt=0, description="a job claimed this long ago is taken over")
    max_batch: int = Field(default=100, ge=1, description="requests in one queued batch")
    max_queued_per_tenant: int = Field(
        default=1_000, ge=1, description="requests a tenant may have queued or running; a job past it gets 429"
    )


class ResponsesSettings(_Section):
    """The Responses API's stored responses (`store`, `previous_response_id`), kept by the gateway per tenant.

    Bounded per tenant by `max_bytes_per_tenant` and in time by `ttl_s`: in memory, every store call sweeps up to 64
    expired turns of any tenant (an idle tenant's leave without it storing again); in Redis, they expire. Deleting a
    tenant (admin API or `bulkhead tenants delete`) drops all of its stored responses at once, in memory or Redis.
    """

    ttl_s: int = Field(default=2_592_000, ge=60, description="how long a stored response lasts (OpenAI's: 30 days)")
    max_bytes_per_tenant: int = Field(
        default=64 * 1024 * 1024,
        ge=1024,
        description="stored responses a tenant may hold, in bytes; storing past it drops the tenant's oldest",
    )
    max_turns: int = Field(
        default=1_000, ge=1, description="turns of one stored conversation; a request past it gets 400"
    )
    stream_keepalive_s: float = Field(
        default=15.0,
        gt=0,
        description="a background response's stream sends a comment this often while the response is pending "
        "(proxies close a stream silent for long)",
    )
    max_follows_per_tenant: int = Field(
        default=16,
        ge=1,
        description="background responses' streams a tenant may have open on one instance when its "
        "max_concurrent_requests is unset (each holds a connection and a store read a second while it runs); "
        "one past it gets 429",
    )


class RoutingSettings(_Section):
    """Session-affinity routing over a model's replicas, with bounded load."""

    load_factor: float = Field(default=1.25, ge=1.0, description="a replica above this × mean in-flight spills")
    min_slack: int = Field(default=4, ge=0, description="...but never below mean + this many requests")
    tracked_sessions: int = Field(default=100_000, ge=0, description="sessions remembered to count remaps")


class CanaryKeySettings(_Section):
    """A secret that canary markers are made from."""

    id: str = Field(min_length=1, max_length=32, description="names the key in events; never the secret")
    secret: str = Field(min_length=16, repr=False, description="HMAC key of the markers; the same on every instance")


class CanarySettings(_Section):
    """Secret per-tenant canary markers, injected into prompts and looked for in every answer."""

    enabled: bool = Field(default=True, description="inject each tenant's marker and scan answers for others'")
    keys: list[CanaryKeySettings] = Field(
        default=[], description="the first makes markers, all are recognised; none = a random key per process"
    )
    epoch_s: int = Field(default=86_400, ge=60, description="markers rotate this often; two epochs are live")
    placement: MarkerPlacement = Field(
        default="turns",
        description="where markers go: turns: at the prompt's start (the system text, or the first user turn) and at "
        "every later user turn; start: there only; system: both ends of the system text; user: every user turn; "
        "both: system and user (docs/canaries.md)",
    )
    policy: Literal["block", "redact", "alert"] = Field(
        default="block",
        description="on another tenant's marker: withhold the answer (502, or an error event in a stream), replace "
        "the marker with [redacted], or only record it",
    )
    quarantine_on_leak: bool = Field(default=True, description="a leak takes the replica out of rotation everywhere")
    webhook_url: str | None = Field(
        default=None, pattern=r"^https?://", description="isolation events are POSTed here (see `webhooks`)"
    )
    webhook_secret: str | None = Field(
        default=None,
        min_length=16,
        repr=False,
        description="signs each POST by the Standard Webhooks spec: whsec_ + base64 of the key, or any text (its UTF-8 "
        "bytes are the key); also as x-bulkhead-signature: sha256=<HMAC of the body> (deprecated)",
    )

    @model_validator(mode="after")
    def _webhook(self) -> Self:
        if self.webhook_url is not None and self.webhook_secret is None:
            raise ValueError("canary.webhook_url needs canary.webhook_secret to sign what it sends")
        return self


class ProberSettings(_Section):
    """The active prober: canary requests that look for cross-request leaks on every replica."""

    enabled: bool = Field(default=False, description="probe every replica for cross-request leaks continuously")
    interval_s: float = Field(default=600.0, ge=1, description="pause between two passes over the replicas")
    rate: float = Field(default=1.0, gt=0, description="probe requests per second to one replica")
    max_requests: int = Field(default=40, ge=10, description="requests per replica per pass")
    time_limit_s: float = Field(default=120.0, gt=0, description="time per replica per pass")
    quarantine: bool = Field(default=True, description="quarantine a replica with a critical finding")


class QuarantineSettings(_Section):
    """Bounds on what leak verdicts may cost: replica suspensions and confirmation probes."""

    max_per_replica: int = Field(
        default=1,
        ge=0,
        description="automatic suspensions of one replica per window (all instances), each probed; past it a leaking "
        "replica is held out of rotation for an operator",
    )
    window_s: float = Field(default=3600.0, gt=0, description="the window of max_per_replica")
    max_probes_per_replica: int = Field(
        default=6, ge=0, description="confirmation probes of one replica per hour (all instances)"
    )
    max_probes_per_tenant: int = Field(
        default=3, ge=0, description="confirmation probes that one tenant's answers may draw per hour (all instances)"
    )


class FingerprintSettings(_Section):
    """Prompt fingerprints: fragments of one tenant's recent prompt found in another tenant's answer."""

    enabled: bool = Field(default=True, description="fingerprint prompts, find their fragments in other answers")
    min_fragment_tokens: int = Field(
        default=32, ge=4, le=512, description="a shared fragment of this many words or more is always found"
    )
    coverage: Literal["time", "kv_cache"] = Field(
        default="time",
        description="time: one index of every instance's prompts for ttl_s, max_entries at most; kv_cache: an index "
        "per replica holding the prompts last sent to it, kv_multiple times its KV capacity in words, and an instance "
        "holds only the replicas it routes to (the platform's scale: docs/fingerprints.md)",
    )
    ttl_s: float = Field(default=1800.0, gt=0, description="coverage time: how long a prompt's fingerprints are kept")
    max_entries: int = Field(
        default=5_000_000, ge=1000, description="coverage time: fingerprints kept per instance (~100 B each)"
    )
    kv_multiple: float = Field(
        default=2.0,
        ge=1.0,
        description="coverage kv_cache: a replica's index holds this many times its KV capacity in words of the "
        "prompts last sent to it (a word is at least a token)",
    )
    kv_tokens_default: int = Field(
        default=1_048_576,
        ge=1024,
        description="coverage kv_cache: the KV capacity in tokens taken for a replica whose engine has not said "
        "(a disaggregated backend counts its stages')",
    )
    cell: str | None = Field(
        default=None,
        pattern=r"^[a-z0-9]([a-z0-9-]{0,30}[a-z0-9])?$",
        description="coverage kv_cache on a Redis Cluster: this instance's cell (the instances that share a group of "
        "replicas); its replicas' fingerprint streams carry the cell's hash tag, so cells spread over the primaries. "
        "Every instance that lists a replica names the same cell, or the later one does not start. Unset: one cell. "
        "On one Redis it changes nothing",
    )
    inline_chars: int = Field(
        default=65_536, ge=0, description="prompts up to this size are fingerprinted on the event loop"
    )
    stream_hold: Literal["first_hit", "tail"] = Field(
        default="first_hit",
        description="first_hit: a streamed text is held from a first hit of another tenant's prompt until it is "
        "decided (at most 20 words of a fragment leave); tail: its last min_fragment_tokens - 1 words are always "
        "held (none leave; the first words arrive that much later)",
    )
    max_verdicts_per_day: int = Field(
        default=100,
        ge=1,
        description="fragment verdicts one tenant may draw per model per day (all instances); past it its requests to "
        "the model are refused until an operator lifts the block",
    )
    max_judges_per_day: int = Field(
        default=20,
        ge=0,
        description="judges one tenant's answers may draw on a suspect, per model per day (all instances), each "
        "showing in an answer's time; past it, every answer of the tenant on the model is judged beside its "
        "generation and released once its judge answered (0: every answer of every tenant)",
    )
    feed_wait_s: float = Field(
        default=2.0,
        gt=0,
        description="with Redis, how long an answer may wait for this instance to read the prompts other instances "
        "sent before its request; past it the answer is withheld (fingerprint_feed_lag)",
    )
    public_texts: list[Path] = Field(
        default_factory=list,
        description="files or directories of public text (licences, standard libraries): never evidence of a leak",
    )

    @model_validator(mode="after")
    def _cell(self) -> Self:
        if self.cell is not None and self.coverage != "kv_cache":
            raise ValueError(
                "cell needs coverage: kv_cache (with coverage time every instance reads one stream: there is no cell "
                "to be in)"
            )
        return self


class LedgerSettings(_Section):
    """The exposure ledger: a record (no text) of every answer each replica served, for incidents' blast radius."""

    retention_s: float = Field(
        default=14 * 86_400.0, ge=60, description="how long answers and incidents are kept (the incident's 14 days)"
    )
    max_memory_records: int = Field(
        default=250_000,
        ge=1000,
        description="records kept in memory (neither Redis nor PostgreSQL; ~180 B each); the oldest go first",
    )
    max_buffered: int = Field(
        default=100_000,
        ge=100,
        description="records waiting to be written; past it, while the store is down, the "
        "oldest are dropped and counted (bulkhead_ledger_dropped_total)",
    )
    flush_interval_s: float = Field(default=0.1, gt=0, le=10, description="records are written in batches this often")
    postgres_url: str | None = Field(
        default=None,
        pattern=r"^postgres(ql)?://",
        repr=False,
        description="the ledger in this PostgreSQL database (a table partitioned by day; docs/incidents.md), for "
        "deployments whose retention of answers outgrows Redis's RAM; unset: in Redis with redis_url, else in memory",
    )
    postgres_schema: str = Field(
        default="bulkhead_ledger",
        pattern=r"^[a-z_][a-z0-9_]{0,62}$",
        description="the schema the ledger's tables are made in (deployments sharing a database keep apart by it)",
    )
    postgres_pool_size: int = Field(
        default=4, ge=1, le=100, description="connections to postgres_url per gateway process; more wait their turn"
    )


class NoticeSettings(_Section):
    """What tenants are told of an incident that touched them (docs/incidents.md): notices, and their webhooks."""

    confirm: Literal["probe", "marker"] = Field(
        default="probe",
        description="what makes a leak a notice: the canary probe seeing the replica mix requests (probe), or also a "
        "marker leak on its own (marker: another tenant's secret marker, which no tenant can make a model write "
        "without having learned it)",
    )
    max_per_tenant: int = Field(default=1000, ge=10, description="notices kept per tenant (the oldest go first)")
    signing_key: str | None = Field(
        default=None,
        min_length=16,
        repr=False,
        description="the secret tenants' webhook secrets are derived from, the same on every instance; unset: one "
        "kept in Redis, or one per process without Redis",
    )
    allow_http: bool = Field(default=False, description="tenants' webhook URLs may be http (else https only)")
    allow_private_urls: bool = Field(
        default=False,
        description="tenants' webhook URLs may resolve to loopback, private or link-local addresses (tests, one "
        "private network); else refused, so that no tenant points the gateway at the network it runs in",
    )


class IsolationSettings(_Section):
    """Leak detection and the response to a leak."""

    events_max: int = Field(default=10_000, ge=100, description="isolation events kept (Redis stream or memory)")
    canary: CanarySettings = CanarySettings()
    fingerprints: FingerprintSettings = FingerprintSettings()
    prober: ProberSettings = ProberSettings()
    quarantine: QuarantineSettings = QuarantineSettings()
    ledger: LedgerSettings = LedgerSettings()
    notices: NoticeSettings = NoticeSettings()


class EdgeSettings(_Section):
    """How the gateway's own HTTP server bounds what one client can hold (`bulkhead serve`; per process)."""

    header_timeout_s: float = Field(
        default=10.0,
        gt=0,
        description="a request's line and headers must all arrive within this, from the connection's start (or the "
        "request's first byte, on a kept-alive connection); else the connection is closed, so idle and slowloris "
        "connections go",
    )
    body_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="the whole request body must arrive within this, from when it is read; else 408 and the "
        "connection closes. A total, not a silence between chunks: a body sent at 1 byte/s is never silent",
    )
    keepalive_timeout_s: int = Field(
        default=5, ge=1, description="an idle connection between two requests is closed after this"
    )
    max_connections: int = Field(
        default=2048,
        ge=1,
        description="client connections open at once; a request on one more gets 503 and its connection closes",
    )
    shutdown_grace_s: int = Field(
        default=300,
        ge=0,
        description="on SIGTERM/SIGINT, how long requests in flight (streams) may run on; keep it at least "
        "upstream.read_timeout_s. New connections are refused, a request not yet started gets 503",
    )
    drain_linger_s: float = Field(
        default=1.0,
        ge=0,
        description="on SIGTERM/SIGINT, how long a connection idle between requests stays open: a request already "
        "on the wire gets its 503 rather than a reset. Longer only delays the exit",
    )


class AdmissionSettings(_Section):
    """Exact-token counting of prompts before they are admitted."""

    tokenizer_threads: int = Field(default=2, ge=1, description="threads counting large prompts off the loop")
    inline_count_chars: int = Field(
        default=16_384, ge=0, description="prompts up to this size are counted on the event loop (cheaper than a hop)"
    )
    count_cache_mib: int = Field(
        default=64,
        ge=0,
        description="per process, the memory for token counts of prompt pieces (text between special tokens), kept "
        "per tenant so that a history sent again is not tokenized again; 0 tokenizes every prompt whole",
    )


class WebhookSettings(_Section):
    """Notices POSTed to webhooks (the operators' isolation events, tenants' notices), signed by the Standard Webhooks
    spec, from an outbox (in Redis with redis_url: shared by every instance) with retries and dead letters."""

    retry_schedule_s: list[Annotated[float, Field(gt=0)]] = Field(
        default=[5, 30, 120, 600, 1800, 3600, 7200],
        min_length=1,
        description="waits after the 1st, 2nd, ... failed attempt; the last repeats until max_age_s",
    )
    max_age_s: float = Field(
        default=259_200, gt=0, description="a message not delivered this long after it was made is no longer retried"
    )
    dead_after: int = Field(
        default=3, ge=1, description="failed attempts after which a message is listed as a dead letter (still retried)"
    )
    max_pending_per_target: int = Field(
        default=10_000, ge=1, description="messages held for one target; past it its oldest are dropped"
    )
    timeout_s: float = Field(default=10.0, gt=0, description="longest wait for a receiver's answer to one POST")
    concurrency: int = Field(default=16, ge=1, description="POSTs in flight at once, per gateway process")
    poll_interval_s: float = Field(default=1.0, gt=0, description="how often the outbox is read for messages due")


TraceSampler = Literal[
    "always_on",
    "always_off",
    "traceidratio",
    "parentbased_always_on",
    "parentbased_always_off",
    "parentbased_traceidratio",
]


class TracingSettings(_Section):
    """OpenTelemetry traces: a span for each request, its stages' spans beneath it, and the engine's own spans joined
    to it (docs/operations.md, "Tracing"). Sent over OTLP/HTTP in batches, from a thread of their own. No prompt or
    answer text is ever in a span. The standard OTEL_* variables named with each key set it too; a
    BULKHEAD_TRACING__* variable overrides them."""

    enabled: bool = Field(
        default=False,
        description="trace requests (OTEL_TRACES_EXPORTER=otlp turns it on; none, or OTEL_SDK_DISABLED=true, off)",
    )
    endpoint: str = Field(
        default="http://localhost:4318/v1/traces",
        pattern=URL_PATTERN,
        description="where spans are POSTed (OTEL_EXPORTER_OTLP_TRACES_ENDPOINT, or OTEL_EXPORTER_OTLP_ENDPOINT "
        "with /v1/traces added)",
    )
    protocol: Literal["http/protobuf"] = Field(
        default="http/protobuf",
        description="the only one spoken: grpc is refused at start (OTEL_EXPORTER_OTLP_PROTOCOL, "
        "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL)",
    )
    headers: dict[str, str] = Field(
        default={},
        repr=False,
        description="sent with every export, e.g. a tracing service's API key (OTEL_EXPORTER_OTLP_HEADERS, "
        "OTEL_EXPORTER_OTLP_TRACES_HEADERS: key=value,key=value)",
    )
    timeout_s: float = Field(
        default=10.0, gt=0, description="longest wait for one export (OTEL_EXPORTER_OTLP_TIMEOUT, in milliseconds)"
    )
    compression: Literal["none", "gzip"] = Field(
        default="none", description="of each export's body (OTEL_EXPORTER_OTLP_COMPRESSION)"
    )
    sampler: TraceSampler = Field(
        default="parentbased_always_on",
        description="which requests are traced (OTEL_TRACES_SAMPLER); a request not traced sends the engine a "
        "traceparent that says so, so that it does not trace it either",
    )
    sampler_ratio: float = Field(
        default=1.0,
        ge=0,
        le=1,
        description="the share of requests the traceidratio samplers trace (OTEL_TRACES_SAMPLER_ARG)",
    )
    service_name: str = Field(default="bulkhead", min_length=1, description="the service.name (OTEL_SERVICE_NAME)")
    resource_attributes: dict[str, str] = Field(
        default={},
        description="more attributes of the service, e.g. deployment.environment (OTEL_RESOURCE_ATTRIBUTES)",
    )
    client_context: Literal["link", "parent"] = Field(
        default="link",
        description="a client's traceparent header: link: recorded as a link, the trace and its sampling the "
        "gateway's own (a tenant chooses neither); parent: the request's span joins the client's trace, traced as "
        "its flags say (only where every client is trusted, or a proxy in front sets the header)",
    )
    max_queue_size: int = Field(
        default=2048,
        ge=1,
        description="finished spans waiting to be sent; past it new ones are dropped (OTEL_BSP_MAX_QUEUE_SIZE)",
    )
    export_interval_s: float = Field(
        default=5.0, gt=0, description="spans are sent this often (OTEL_BSP_SCHEDULE_DELAY, in milliseconds)"
    )


class Settings(_Section):
    """Every setting of the gateway; the top-level keys of the YAML file."""

    listen: ListenSettings = ListenSettings()
    workers: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        default=1, description="gateway processes on the port (`auto`: one per core); more than 1 needs redis_url"
    )
    redis_url: str | None = Field(
        default=None,
        pattern=r"^(redis|rediss|unix)://",
        description="shared state for many gateway instances; unset = in memory, this process only",
    )
    redis_cluster: bool = Field(
        default=False,
        description="redis_url is a node of a Redis Cluster: the gateway learns the others from it, and names every "
        "key with a hash tag (docs/architecture.md)",
    )
    redis_max_connections: int = Field(
        default=64,
        ge=1,
        description="the Redis pool's size; more wait their turn (on a cluster: per node, and more fail)",
    )
    redis_pool_timeout_s: float = Field(
        default=5.0,
        gt=0,
        description="longest wait for a free Redis connection (not on a cluster, which does not wait)",
    )
    redis_wait_replicas: int = Field(
        default=0,
        ge=0,
        le=16,
        description="queued jobs, runtime tenants and keys, notices, verdict bounds and replicas taken out count as "
        "written once this many replicas hold them (Redis WAIT), so a failover loses none; 0: once the primary does",
    )
    redis_wait_timeout_s: float = Field(
        default=0.5,
        gt=0,
        le=60,
        description="longest wait for those replicas: past it the write fails as if Redis were down",
    )
    redis_key_prefix: str = Field(
        default=REDIS_KEY_PREFIX, description="starts every Redis name; deployments on one Redis need different ones"
    )
    admin_token: str | None = Field(default=None, min_length=16, repr=False, description="for /admin/*")
    admin_url: str | None = Field(
        default=None,
        pattern=URL_PATTERN,
        description="where `bulkhead tenants`, `incidents` and `webhooks` reach this gateway's admin API (a load "
        "balancer's address, say); unset: the address it listens on. The gateway itself never reads it",
    )
    metrics_token: str | None = Field(
        default=None, min_length=16, repr=False, description="for /metrics (it names tenants); unset = open"
    )
    cache_salt_secret: str | None = Field(
        default=None, min_length=16, repr=False, description="per-tenant cache_salt = HMAC(this, tenant)"
    )
    routing: RoutingSettings = RoutingSettings()
    rate_limits: RateLimitSettings = RateLimitSettings()
    tenant_directory: TenantDirectorySettings = TenantDirectorySettings()
    queue: QueueSettings = QueueSettings()
    responses: ResponsesSettings = ResponsesSettings()
    isolation: IsolationSettings = IsolationSettings()
    webhooks: WebhookSettings = WebhookSettings()
    admission: AdmissionSettings = AdmissionSettings()
    log_level: str = Field(
        default="INFO", pattern=r"^(DEBUG|INFO|WARNING|ERROR)$", description="JSON log lines at this level and above"
    )
    limits: LimitSettings = LimitSettings()
    upstream: UpstreamSettings = UpstreamSettings()
    edge: EdgeSettings = EdgeSettings()
    tracing: TracingSettings = TracingSettings()
    backends: list[BackendSettings] = []
    models: list[ModelSettings] = []
    tenants: list[TenantSettings] = []

    @field_validator("redis_key_prefix", mode="before")
    @classmethod
    def _key_prefix(cls, value: Any) -> Any:
        if isinstance(value, dict):
            # BULKHEAD_REDIS_KEY_PREFIX=app: is read as YAML, where `app:` is the mapping {app: null}.
            raise ValueError("a prefix ending in ':' must be quoted to be read as text, as in '\"app:\"'")
        if isinstance(value, str) and not REDIS_KEY_PREFIX_PATTERN.match(value):
            raise ValueError(f"{value[:80]!r}: 1 to 64 characters, each a letter, a digit or one of : _ . {{ }} -")
        return value

    @model_validator(mode="after")
    def _cluster(self) -> Self:
        if not self.redis_cluster:
            return self
        if self.redis_url is None or self.redis_url.startswith("unix://"):
            raise ValueError("redis_cluster: needs redis_url, a redis:// or rediss:// address of one of its nodes")
        if urlsplit(self.redis_url).path.strip("/") not in ("", "0"):
            raise ValueError("redis_url: a Redis Cluster has database 0 alone; keep deployments apart by prefix")
        return self

    @model_validator(mode="after")
    def _references(self) -> Self:
        _unique("backends", [b.name for b in self.backends])
        _unique("models", [m.name for m in self.models])
        _unique("tenants", [t.id for t in self.tenants])
        _unique("tenants[].key_hashes", [h for t in self.tenants for h in t.key_hashes])
        backend_names = {b.name for b in self.backends}
        tasks: dict[str, ModelSettings] = {}
        kinds = {b.name: b.kind for b in self.backends}
        for i, model in enumerate(self.models):
            for backend in model.backends:
                if backend not in backend_names:
                    raise ValueError(f"models[{i}].backends: model '{model.name}' names unknown backend '{backend}'")
                if kinds[backend] == "sglang" and model.tokenizer is None:
                    # SGLang's /v1/tokenize takes text alone: a chat prompt could not be counted as it is rendered.
                    raise ValueError(
                        f"models[{i}].tokenizer: model '{model.name}' is served by SGLang backend '{backend}', which "
                        "cannot count a chat prompt: give the model its tokenizer"
                    )
                # A vLLM server runs one task; and an embedding replica's inputs carry no marker, so it must never
                # also answer with text.
                other = tasks.setdefault(backend, model)
                if other.task != model.task:
                    raise ValueError(
                        f"models[{i}].backends: backend '{backend}' serves '{other.name}' ({other.task}) and "
                        f"'{model.name}' ({model.task}); a backend serves one task"
                    )
        model_names = {m.name for m in self.models}
        for i, tenant in enumerate(self.tenants):
            for name in tenant.models:
                if name != "*" and name not in model_names:
                    raise ValueError(f"tenants[{i}].models: tenant '{tenant.id}' names unknown model '{name}'")
        return self

    def model(self, name: str) -> ModelSettings | None:
        return next((m for m in self.models if m.name == name), None)


def _unique(what: str, names: list[str]) -> None:
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise ValueError(f"{what}: '{name}' appears twice")
        seen.add(name)


# Kubernetes injects service links for a Service named bulkhead-redis as BULKHEAD_REDIS_PORT=tcp://..., and so on;
# they are not settings (a setting's nested keys are joined by a double underscore, never a single one).
_SERVICE_LINK = re.compile(
    r"(?<!_)_(SERVICE_HOST|SERVICE_PORT(_\w+)?|PORT(_\d+_(TCP|UDP|SCTP)(_(PROTO|PORT|ADDR))?)?)$"
)


def _env_overrides(environ: Mapping[str, str]) -> dict[tuple[str, ...], tuple[str, Any]]:
    overrides: dict[tuple[str, ...], tuple[str, Any]] = {}
    for variable, raw in environ.items():
        if not variable.startswith(ENV_PREFIX) or _SERVICE_LINK.search(variable):
            continue
        path = tuple(part.lower() for part in variable[len(ENV_PREFIX) :].split("__"))
        try:
            value = yaml.safe_load(raw) if raw else raw
        except yaml.YAMLError as exc:
            raise SettingsError(f"environment variable {variable}: {yaml_problem(exc)}") from exc
        overrides[path] = (variable, value)
    return overrides


def _apply(data: dict[str, Any], path: tuple[str, ...], value: Any, variable: str) -> None:
    node = data
    for part in path[:-1]:
        child = node.setdefault(part, {})
        if not isinstance(child, dict):
            raise SettingsError(f"environment variable {variable}: '{part}' is not a section")
        node = child
    node[path[-1]] = value


def load_settings(path: Path | None = None, environ: Mapping[str, str] | None = None) -> Settings:
    """Read the file (if any), apply the environment on top, validate; raise SettingsError saying where and what."""
    if path is None:
        return parse_settings(None, "defaults", environ)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise SettingsError(f"{path}: cannot read: {exc.strerror}") from exc
    except UnicodeDecodeError as exc:
        raise SettingsError(f"{path}: not UTF-8 text (byte {exc.start})") from exc
    return parse_settings(text, str(path), environ)


def parse_settings(text: str | None, name: str, environ: Mapping[str, str] | None = None) -> Settings:
    """The settings a file's `text` (None: no file) and the environment make; errors name the file as `name`."""
    data: dict[str, Any] = {}
    document = None
    if text is not None:
        try:
            loaded, document = read_yaml(text)
        except yaml.YAMLError as exc:
            raise SettingsError(f"{name}, {yaml_problem(exc)}") from exc
        if loaded is not None and not isinstance(loaded, dict):
            raise SettingsError(f"{name}: the top level must be a mapping of settings")
        data = loaded or {}
    try:
        standard = tracing_overrides(environ or {})
    except ValueError as exc:
        raise SettingsError(str(exc)) from exc
    # The standard OTEL_* variables first, so that the gateway's own, more specific, win.
    overrides = {**standard, **_env_overrides(environ or {})}
    if sdk_disabled(environ or {}):
        overrides.pop(("tracing", "enabled"), None)  # applied last: after a whole BULKHEAD_TRACING section too
        overrides[("tracing", "enabled")] = (DISABLED, False)
    for key_path, (variable, value) in overrides.items():
        _apply(data, key_path, value, variable)
    try:
        return Settings.model_validate(data)
    except ValidationError as exc:
        variables: dict[Loc, str] = {key_path: variable for key_path, (variable, _) in overrides.items()}
        raise SettingsError(report(exc, Settings, Sources(name, document, variables))) from exc
