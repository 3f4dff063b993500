"""create_app(settings) → the Starlette app. Its lifespan owns the httpx client, Redis pool and background tasks."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import hashlib
import hmac
import logging
import math
import os
import random
import secrets
import socket
import sys
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import Any

import httpx
import orjson
from prometheus_client import CONTENT_TYPE_LATEST, Gauge
from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.accesslog import RequestIdHeader
from gateway.api.admin import AdminRoutes, bearer_matches
from gateway.api.admin_incidents import IncidentAdminRoutes
from gateway.api.admin_tenants import TenantAdminRoutes
from gateway.api.admin_webhooks import WebhookAdminRoutes
from gateway.api.anthropic import AnthropicRoutes
from gateway.api.body import BodyReader
from gateway.api.catalog import CatalogRoutes
from gateway.api.console import ConsoleRoutes
from gateway.api.intake import Intake
from gateway.api.notices import NoticeRoutes
from gateway.api.openai import OpenAIRoutes
from gateway.api.responses import Background, ResponsesRoutes
from gateway.api.tokenization import TokenizationRoutes
from gateway.api.workers import WorkersRoutes
from gateway.errors import (
    AuthenticationFailed,
    GatewayError,
    MethodNotAllowed,
    NotFound,
    error_response,
)
from gateway.incidents.handling import incident_handling
from gateway.incidents.ledger import LedgerWriter
from gateway.incidents.pgledger import ledger_pool
from gateway.incidents.prober import Prober
from gateway.incidents.quarantine import Responder
from gateway.incidents.tracking import Tracker
from gateway.incidents.verdicts import VerdictBound
from gateway.jobs.worker import Worker
from gateway.metrics import GatewayMetrics
from gateway.offload import SWITCH_INTERVAL_S
from gateway.pipeline.counting import BackendCounter, LocalCounter, PromptCounter
from gateway.pipeline.inference import RESPONSES, Pipeline
from gateway.pipeline.judging import Judging
from gateway.pipeline.slot import Slots
from gateway.server.openapi import openapi_document
from gateway.server.readiness import ReadinessCheck
from gateway.server.stores import build_stores, replication_of
from gateway.settings import Settings, SettingsError
from gateway.store import shared_key
from gateway.supervisor import Supervisor
from gateway.tenancy.lookups import GetAddrInfo, NameLookups
from gateway.tenancy.ratelimit import RateLimiter
from gateway.tenancy.tenants import TenantDirectory
from gateway.tenancy.webhooks import SigningKey, TenantWebhooks
from gateway.tracing import Tracing
from gateway.upstream.backends import Replica, ReplicaPool
from gateway.upstream.capacity import CapacityMonitor
from gateway.upstream.fairness import Gate
from gateway.upstream.proxy import Upstream, make_client, make_session
from gateway.upstream.routing import Router
from gateway.upstream.saturation import LoadMonitor
from gateway.webhooks import TENANT_PREFIX, Deliveries, Resolver, Target, settings_resolver
from isolation.fingerprint_feed import RedisFingerprintFeed
from isolation.fingerprints import Fingerprinter, FingerprintIndex, PromptIndex, public_fingerprints
from isolation.inject import system_leads
from isolation.markers import CanaryKey, MarkerRegistry, ModelMarkers, RedisMarkerStore
from isolation.poison import Poison
from isolation.redis_keys import RedisClient, tag
from isolation.replica_index import ReplicaIndexes
from isolation.replication import Replication
from isolation.salts import CacheSalts
from isolation.spelling import of_tokenizer
from isolation.tokens import ModelTokenizer, TokenizerLoadError
from isolation.winnowing import Hasher, Shape

log = logging.getLogger("bulkhead")

SHUTDOWN_WAIT_S = 5.0
# One-shot work's time to end at shutdown: a settlement, a report or a notice is a Redis round trip or two. A probe
# cut short is taken over by another instance once its hold lapses (Responder.take_over): not waited for.
WORK_GRACE_S = 1.0


async def write_last(writer: LedgerWriter) -> None:
    """The ledger's last records, before the store closes: what was served is on record though this instance goes."""
    try:
        await asyncio.wait_for(writer.flush(), SHUTDOWN_WAIT_S)
    except (RedisError, OSError, TimeoutError) as exc:
        log.error("exposure ledger: the last records were not written: %s", type(exc).__name__)


async def healthz(request: Request) -> Response:
    return JSONResponse({"status": "ok"})


class ProcessRoutes:
    """/readyz and /metrics: this instance's own state, for its probes and its scraper."""

    def __init__(self, *, readiness: ReadinessCheck, metrics: GatewayMetrics, metrics_token: str | None) -> None:
        self._readiness = readiness
        self._metrics = metrics
        self._metrics_token = metrics_token

    async def readyz(self, request: Request) -> Response:
        """200 while this instance can serve (what is degraded in the body), 503 when it cannot: see readiness.py."""
        found = await self._readiness.check()
        return JSONResponse(found.body(), status_code=200 if found.ready else 503)

    async def metrics(self, request: Request) -> Response:
        token = self._metrics_token
        if token is not None:
            # Its labels name tenants, and its series say when each is busy and what waits: not for tenants to read.
            if not bearer_matches(request, token):
                return error_response(AuthenticationFailed("This route needs the metrics token."))
        return Response(self._metrics.render(), media_type=CONTENT_TYPE_LATEST)


async def openapi(request: Request) -> Response:
    return Response(request.app.state.openapi, media_type="application/json")


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    if exc.status_code == 405:
        return error_response(MethodNotAllowed(f"{request.method} is not allowed on {request.url.path}."))
    path = request.url.path
    hint = "; routes take no trailing slash" if path.endswith("/") and path != "/" else ""
    return error_response(NotFound(f"No route {request.method} {path}{hint}."))


async def _unexpected(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(GatewayError("The gateway failed unexpectedly; the failure has been logged."))


class BadSettingsAtStart:
    """ASGI middleware: settings that only the lifespan can find bad (a tenant id that is also in the tenant
    directory, which needs Redis) fail the start with one line, not Starlette's traceback; the error is kept as
    `app.state.bad_settings`, for the command to exit on."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "lifespan":
            await self.app(scope, receive, send)
            return
        held: list[Message] = []

        async def send_holding_failure(message: Message) -> None:
            if message["type"] == "lifespan.startup.failed":
                held.append(message)  # its message is the traceback: sent once the error is known
                return
            await send(message)

        try:
            await self.app(scope, receive, send_holding_failure)
        except SettingsError as exc:
            scope["app"].state.bad_settings = exc
            await send({"type": "lifespan.startup.failed", "message": f"bulkhead: bad settings: {exc}"})
        except BaseException:
            for message in held:
                await send(message)
            raise


def load_tokenizers(settings: Settings) -> dict[str, ModelTokenizer]:
    """Every configured tokenizer, loaded before serving so that a bad path stops the start."""
    loaded = {}
    for index, model in enumerate(settings.models):
        if model.tokenizer is not None:
            try:
                loaded[model.name] = ModelTokenizer.from_dir(model.tokenizer)
            except TokenizerLoadError as exc:
                raise SettingsError(f"models[{index}].tokenizer: {exc}") from exc
    return loaded


def check_files(settings: Settings) -> dict[str, ModelTokenizer]:
    """The files the settings name, before serving, so that a bad path stops the start with one line: the
    tokenizers loaded, the public texts looked for (read by the lifespan)."""
    tokenizers = load_tokenizers(settings)
    if settings.isolation.fingerprints.enabled:
        for index, path in enumerate(settings.isolation.fingerprints.public_texts):
            if not path.exists():
                raise SettingsError(f"isolation.fingerprints.public_texts[{index}]: {path} does not exist")
    return tokenizers


def build_counters(
    settings: Settings,
    tokenizers: dict[str, ModelTokenizer],
    pool: ReplicaPool,
    upstream: Upstream,
    executor: ThreadPoolExecutor,
) -> dict[str, PromptCounter]:
    counters: dict[str, PromptCounter] = {}
    for model in settings.models:
        tokenizer = tokenizers.get(model.name)
        if tokenizer is None:
            counters[model.name] = BackendCounter(model, pool, upstream)
        else:
            admission = settings.admission
            counters[model.name] = LocalCounter(
                tokenizer, executor, admission.inline_count_chars, admission.count_cache_mib * 2**20
            )
    return counters


def make_redis(settings: Settings) -> RedisClient | None:
    """The process's one Redis pool: bounded, and a request waits for a free connection instead of failing. On a
    cluster, one pool per node, each bounded, and a command that finds none free fails (redis-py's cluster client
    does not wait)."""
    if settings.redis_url is None:
        return None
    if settings.redis_cluster:
        return RedisCluster.from_url(
            settings.redis_url,
            max_connections=settings.redis_max_connections,
            # A command that meets a dead primary is sent again once the cluster has promoted its replica: about
            # 3 s of attempts, then it fails as with Redis down (a failover takes cluster-node-timeout and more).
            retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), retries=8),
        )
    pool = BlockingConnectionPool.from_url(
        settings.redis_url,
        max_connections=settings.redis_max_connections,
        timeout=settings.redis_pool_timeout_s,
        # After a Redis restart every pooled connection is dead: a command that meets one is sent again on a fresh
        # connection (it never reached the server), instead of failing one request per stale connection.
        retry=Retry(ExponentialBackoff(cap=0.5, base=0.05), retries=2),
        retry_on_error=[RedisConnectionError],
    )
    return Redis.from_pool(pool)


def salt_secret(settings: Settings) -> bytes:
    if settings.cache_salt_secret is not None:
        return settings.cache_salt_secret.encode()
    if settings.redis_url is not None:
        log.warning(
            "cache_salt_secret is not set: each gateway instance salts tenants differently, so a tenant's prefix "
            "cache hits are split across instances; set it to the same secret on every instance"
        )
    return secrets.token_bytes(32)


def canary_keys(settings: Settings) -> list[CanaryKey]:
    configured = settings.isolation.canary.keys
    if configured:
        return [CanaryKey(k.id, k.secret.encode()) for k in configured]
    isolation = settings.isolation
    if settings.redis_url is not None and (isolation.canary.enabled or isolation.fingerprints.enabled):
        log.warning(
            "isolation.canary.keys is not set: each gateway instance makes its canary markers with a random key of "
            "its own, so a tenant's prompts differ between instances (their prefix cache hits are lost) and no "
            "instance recognises another's markers in an answer (prompt fingerprints share a key kept in Redis); "
            "set the same keys on every instance"
        )
    return [CanaryKey("random", secrets.token_bytes(32))]


async def marker_registry(
    settings: Settings,
    keys: list[CanaryKey],
    store: RedisMarkerStore | None,
    metrics: GatewayMetrics,
    tokenizers: dict[str, ModelTokenizer],
) -> MarkerRegistry:
    registry = MarkerRegistry(keys, settings.isolation.canary.epoch_s, store)
    for name, tokenizer in tokenizers.items():
        registry.add_model(name, ModelMarkers(of_tokenizer(tokenizer.tokenizer), system_leads(tokenizer)))
    registry.add_tenants(t.id for t in settings.tenants)
    metrics.canary_markers.set(len(registry))
    try:
        await registry.publish()
    except (RedisError, OSError) as exc:
        log.warning("canary markers not published to Redis: %s", type(exc).__name__)
    return registry


async def rotate_markers(registry: MarkerRegistry, metrics: GatewayMetrics) -> None:
    """Check for a new epoch every minute; on one, make and publish the new markers."""
    while True:
        await asyncio.sleep(60)
        if registry.rotate(time.time()):
            metrics.canary_markers.set(len(registry))
            try:
                await registry.publish()
            except (RedisError, OSError) as exc:
                log.warning("canary markers not published to Redis: %s", type(exc).__name__)


async def watch_redis(redis: RedisClient, gauge: Gauge, interval: float) -> None:
    while True:
        try:
            await redis.ping()
            gauge.set(1)
        except (RedisError, OSError):
            gauge.set(0)
        await asyncio.sleep(interval)


async def fingerprint_key(settings: Settings, key: CanaryKey, redis: RedisClient | None) -> bytes:
    """The key every instance hashes prompt words with: derived from the canary secret, so instances configured with
    the same canary keys hash alike. Without configured keys each instance's canary secret is its own, so the
    instances on one Redis share a key kept there instead (the first to start makes it): else none would recognise
    another's prompts."""
    secret = key.secret
    if redis is not None and not settings.isolation.canary.keys:
        name = f"{settings.redis_key_prefix}{tag(redis, 'fingerprint-key')}"
        stored = await kept_in_redis(redis, name, replication_of(settings))
        if stored is None:
            # Redis down is a bad day to serve through, not a reason to stay down: this instance hashes alone.
            log.error(
                "the prompt fingerprint key could not be read from Redis: until this instance restarts with Redis up, "
                "it and the others do not recognise each other's prompts; set isolation.canary.keys (the same on "
                "every instance) to need no key from Redis"
            )
        else:
            secret = stored
    return fingerprint_secret(secret)


async def kept_in_redis(redis: RedisClient, name: str, replication: Replication) -> bytes | None:
    """A random key that every instance on this Redis shares (the first to start makes it); None when Redis could not
    be asked."""
    try:
        return await shared_key(redis, name, replication)
    except (RedisError, OSError) as exc:
        log.error("key %s not read from Redis: %s", name, type(exc).__name__)
        return None


def notice_signing_key(settings: Settings, redis: RedisClient | None) -> SigningKey:
    """What tenants' webhook secrets are derived from (gateway/tenancy/webhooks.py): the configured key, else the one
    kept in Redis (read when first needed, so an instance that started while Redis was down never signs with a key
    of its own), else this process's own (whose secrets end with it, as its in-memory registrations do)."""
    configured = settings.isolation.notices.signing_key
    if configured is not None:
        return SigningKey(configured.encode())
    if redis is not None:
        name = f"{settings.redis_key_prefix}{tag(redis, 'notice-signing-key')}"
        return SigningKey(None, redis, name, replication_of(settings))
    return SigningKey(secrets.token_bytes(32))


async def catch_up(feed: RedisFingerprintFeed, fingerprinter: Fingerprinter) -> dict[str, str] | None:
    """Claim this instance's replicas for its cell, then read what other instances sent them; where each stream was
    read to, None when Redis could not be read. A replica another cell holds stops the start (SettingsError): each
    cell would miss the other's prompts to it."""
    moved: dict[str, str] = {}
    try:
        claimed = await feed.claim()
    except (RedisError, OSError) as exc:
        # As with Redis down at any time: the claim is made by the task that keeps it, once Redis answers.
        log.error("fingerprint streams' cell not claimed at start: %s", type(exc).__name__)
    else:
        if claimed.held and feed.cells is not None:
            raise SettingsError(feed.cells.refusal(claimed.held))
        moved = claimed.moved
    try:
        return await feed.catch_up(fingerprinter.index, moved)
    except (RedisError, OSError) as exc:
        log.warning("fingerprints of other instances not read at start: %s", type(exc).__name__)
        return None


def fingerprint_secret(secret: bytes) -> bytes:
    return hmac.new(secret, b"bulkhead prompt fingerprints", hashlib.sha256).digest()


def make_fingerprinter(
    settings: Settings,
    secret: bytes,
    feed: RedisFingerprintFeed | None,
    executor: ThreadPoolExecutor,
    kv_tokens: Callable[[str], int | None] = lambda replica: None,
) -> Fingerprinter | None:
    """`kv_tokens`: a replica's KV capacity as its engine said (CapacityMonitor.kv_tokens), for `coverage: kv_cache`."""
    config = settings.isolation.fingerprints
    if not config.enabled:
        return None
    hasher = Hasher(secret, Shape.for_fragments(config.min_fragment_tokens))
    public: frozenset[int] = frozenset()
    if config.public_texts:
        started = time.monotonic()
        try:
            public, files = public_fingerprints(hasher, config.public_texts)
        except OSError as exc:
            where = "isolation.fingerprints.public_texts"
            raise SettingsError(f"{where}: cannot read {exc.filename}: {exc.strerror}") from exc
        log.info(
            "public texts: %d fingerprints from %d files in %.1f s", len(public), files, time.monotonic() - started
        )
    index: PromptIndex[Any] = FingerprintIndex(config.ttl_s, config.max_entries, public)
    if config.coverage == "kv_cache":

        def budget(replica: str) -> int:
            return math.ceil(config.kv_multiple * (kv_tokens(replica) or config.kv_tokens_default))

        index = ReplicaIndexes(budget, public)
    return Fingerprinter(hasher, index, feed, executor, config.inline_chars, config.feed_wait_s)


async def sweep_fingerprints(fingerprinter: Fingerprinter, metrics: GatewayMetrics) -> None:
    """Forget expired fingerprints every 30 s."""
    while True:
        fingerprinter.index.sweep(time.time())
        metrics.refresh()
        await asyncio.sleep(30)


def webhook_targets(settings: Settings) -> Resolver:
    """The webhook targets the settings name; a secret that is not usable stops the start with one line."""
    try:
        return settings_resolver(settings.isolation.canary)
    except ValueError as exc:
        raise SettingsError(f"isolation.canary.webhook_secret: {exc}") from exc


def either(operators: Resolver, tenants: Resolver) -> Resolver:
    """Tenants' targets from their registrations, the operators' from the settings."""

    async def resolve(target: str) -> Target | None:
        return await (tenants if target.startswith(TENANT_PREFIX) else operators)(target)

    return resolve


def warn_unreachable(pool: ReplicaPool) -> None:
    for replica in pool.replicas.values():
        if not replica.healthy:
            log.warning(
                "backend %s at %s does not answer its health check at start (%s): it gets no requests until it does",
                replica.name,
                replica.url,
                replica.problem,
            )


def warn_short_grace(settings: Settings) -> None:
    grace, read = settings.edge.shutdown_grace_s, settings.upstream.read_timeout_s
    if grace < read:
        log.warning(
            "edge.shutdown_grace_s (%s s) is shorter than upstream.read_timeout_s (%s s): on SIGTERM a stream that "
            "the engine is still answering can be cut; raise it (and the platform's grace period to match)",
            grace,
            read,
        )


def keep_tasks(
    tasks: Supervisor,
    *,
    settings: Settings,
    client: httpx.AsyncClient,
    pool: ReplicaPool,
    capacity: CapacityMonitor,
    load: LoadMonitor,
    markers: MarkerRegistry,
    metrics: GatewayMetrics,
    tenants: TenantDirectory,
    verdicts: VerdictBound,
    ledger: LedgerWriter,
    tracker: Tracker,
    responder: Responder,
    prober: Prober,
    deliveries: Deliveries,
    redis: RedisClient | None,
    worker: Worker,
    instance: str,
    workers: int,
) -> None:
    """The lifespan's long-lived tasks, each under the supervisor by name; those whose absence breaks a defence say
    what breaks, and /readyz is not ready while one is down. `workers`: how many queue workers run here."""
    upstream, timeout = settings.upstream, settings.upstream.connect_timeout_s
    interval = upstream.health_interval_s
    tasks.keep("replica-health", partial(pool.watch, client, interval, timeout))
    tasks.keep("capacity", partial(capacity.watch, client, upstream.capacity_refresh_s, timeout))
    tasks.keep("load", partial(load.watch, client, upstream.load_interval_s, timeout))
    tasks.keep("canary-rotation", partial(rotate_markers, markers, metrics))
    tasks.keep(
        "tenant-listener",
        tenants.follow,
        breaks="a key revoked or a tenant changed on another instance is heard only at the next resync",
    )
    tasks.keep("tenant-upkeep", tenants.keep_up)
    tasks.keep("verdict-blocks", partial(verdicts.watch, interval))
    tasks.keep(
        "ledger-writer",
        ledger.run,
        breaks="what replicas served is not written to the exposure ledger (held, then dropped, meanwhile)",
    )
    tasks.keep("incident-gauges", partial(tracker.watch, interval, responder.settle))
    tasks.keep("suspension-takeover", responder.take_over)
    tasks.keep("webhook-deliveries", deliveries.run)
    if redis is not None and metrics.redis_up is not None:
        tasks.keep("redis-ping", partial(watch_redis, redis, metrics.redis_up, interval))
    if settings.isolation.prober.enabled:
        tasks.keep("prober", prober.run)
    for n in range(workers):
        tasks.keep(f"queue-worker-{n}", partial(worker.work, f"{instance}-{n}"))


def route_table(
    *,
    process: ProcessRoutes,
    openai: OpenAIRoutes,
    responses: ResponsesRoutes,
    anthropic: AnthropicRoutes,
    tokenization: TokenizationRoutes,
    notices: NoticeRoutes,
    catalog: CatalogRoutes,
    admin: AdminRoutes,
    console: ConsoleRoutes,
    workers: WorkersRoutes,
) -> list[BaseRoute]:
    """Every route of the app, each served by the surface that was given what it uses."""
    return [
        Route("/v1/chat/completions", openai.chat_completions, methods=["POST"]),
        Route("/v1/completions", openai.completions, methods=["POST"]),
        Route("/v1/embeddings", openai.embeddings, methods=["POST"]),
        Route("/pooling", openai.pooling, methods=["POST"]),
        *(Route(path, openai.score, methods=["POST"]) for path in ("/v1/score", "/score")),
        *(Route(path, openai.rerank, methods=["POST"]) for path in ("/v1/rerank", "/rerank")),
        Route("/v1/responses", responses.create, methods=["POST"]),
        Route("/v1/responses/{response_id}", responses.retrieve, methods=["GET"]),
        Route("/v1/responses/{response_id}", responses.delete, methods=["DELETE"]),
        Route("/v1/responses/{response_id}/cancel", responses.cancel, methods=["POST"]),
        Route("/v1/responses/{response_id}/input_items", responses.input_items, methods=["GET"]),
        Route("/v1/messages", anthropic.messages, methods=["POST"]),
        Route("/v1/messages/count_tokens", anthropic.count_tokens, methods=["POST"]),
        Route("/tokenize", tokenization.tokenize, methods=["POST"]),
        Route("/detokenize", tokenization.detokenize, methods=["POST"]),
        Route("/v1/isolation/notices", notices.by_key(notices.notices), methods=["GET"]),
        Route("/v1/isolation/webhook", notices.by_key(notices.show_webhook), methods=["GET"]),
        Route("/v1/isolation/webhook", notices.by_key(notices.set_webhook), methods=["PUT"]),
        Route("/v1/isolation/webhook", notices.by_key(notices.delete_webhook), methods=["DELETE"]),
        Route("/v1/models", catalog.list_models, methods=["GET"]),
        Route("/v1/models/{model:path}", catalog.retrieve_model, methods=["GET"]),
        Route("/healthz", healthz, methods=["GET"]),
        Route("/readyz", process.readyz, methods=["GET"]),
        Route("/metrics", process.metrics, methods=["GET"]),
        Route("/openapi.json", openapi, methods=["GET"]),
        *admin.routes(),
        *console.routes(),
        *workers.routes(),
    ]


def create_app(
    settings: Settings, workers: int | None = None, *, getaddrinfo: GetAddrInfo = socket.getaddrinfo
) -> Starlette:
    """The gateway; `workers` queue workers run inside it (default: settings.queue.workers); tenants' webhook hosts
    are looked up with `getaddrinfo` (lookups.py). A file the settings name that is missing or bad raises
    SettingsError here, before anything is served. Its routes are the lifespan's to install, once what they use is
    built (docs/architecture.md, "The composition root")."""
    tokenizers = check_files(settings)
    targets = webhook_targets(settings)
    workers = settings.queue.workers if workers is None else workers

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        # What start-up opens is closed by this stack in reverse, whether a later step of the start fails or the app
        # stops: the supervisor's tasks first (drained, then cancelled), then what they use (the ledger's last
        # records, the HTTP clients, the executor, the Redis pool and the ledger's PostgreSQL pool).
        async with contextlib.AsyncExitStack() as stack:
            redis = make_redis(settings)
            if redis is not None:
                stack.push_async_callback(redis.aclose)
            kept = settings.isolation.ledger
            postgres = None
            if kept.postgres_url is not None:
                postgres = await stack.enter_async_context(ledger_pool(kept.postgres_url, kept.postgres_pool_size))
            metrics = GatewayMetrics(with_redis=redis is not None)
            stack.callback(metrics.close)
            stores = build_stores(settings, redis, postgres, poison=Poison(metrics.poison_entries))
            instance = f"{socket.gethostname()}-{os.getpid()}"
            tracing = None
            if settings.tracing.enabled:
                # Closed after the tasks and the clients: the spans of what they ended are sent too.
                tracing = Tracing(settings.tracing, instance)
                stack.push_async_callback(tracing.aclose)
            tenants = TenantDirectory(settings.tenants, stores.directory, settings.tenant_directory, metrics)
            await tenants.start()  # a SettingsError is said in one line by BadSettingsAtStart
            fingerprinting = settings.isolation.fingerprints
            verdicts = VerdictBound(
                stores.store, fingerprinting.max_verdicts_per_day, fingerprinting.max_judges_per_day
            )
            pool = ReplicaPool(settings.backends, metrics, stores.store)
            capacity = CapacityMonitor(settings.models, settings.backends, pool, metrics, settings.upstream)
            timeout = settings.upstream.connect_timeout_s
            executor = stack.enter_context(ThreadPoolExecutor(settings.admission.tokenizer_threads, "bulkhead-tokens"))
            lookups = stack.enter_context(contextlib.closing(NameLookups(getaddrinfo)))
            client = await stack.enter_async_context(make_client(settings.upstream))
            session = await stack.enter_async_context(make_session(settings.upstream))
            upstream = Upstream(session, settings.upstream, pool, metrics)
            await pool.refresh(client, timeout)
            warn_unreachable(pool)
            warn_short_grace(settings)
            keys = canary_keys(settings)
            markers = await marker_registry(settings, keys, stores.markers, metrics, tokenizers)
            tenants.joined = markers.publish_tenants
            # Random too: several apps can run in one process (tests, the demo), and must not skip each other.
            feed_name = f"{instance}-{secrets.token_hex(4)}"
            secret = await fingerprint_key(settings, keys[0], redis) if fingerprinting.enabled else b""
            # Before the feed is read: an index keyed to KV capacity holds as much as each replica's cache.
            await capacity.refresh_all(client, timeout)
            by_replica = fingerprinting.coverage == "kv_cache"
            feed = stores.fingerprint_feed(
                feed_name,
                [b.name for b in settings.backends] if by_replica else None,
                cell=fingerprinting.cell,
                replication=replication_of(settings),
            )
            fingerprinter = make_fingerprinter(settings, secret, feed, executor, capacity.kv_tokens)
            feed_ready = None
            if fingerprinter is not None and feed is not None:
                feed_ready = await catch_up(feed, fingerprinter)
            router = Router(pool, metrics, settings.routing, random.Random())
            load = LoadMonitor(settings.backends, pool, metrics)

            def recovered(replica: Replica) -> None:
                # Back from down, perhaps a new engine: other capacity, other slots.
                capacity.refresh_soon(client, replica, timeout)
                load.restarted(replica)

            pool.on_recovered = recovered
            ledger = LedgerWriter(stores.ledger, kept.max_buffered, kept.flush_interval_s, metrics.ledger_dropped)
            stack.push_async_callback(write_last, ledger)
            signing_key = notice_signing_key(settings, redis)
            tenant_webhooks = TenantWebhooks(stores.registrations, signing_key, settings.isolation.notices, lookups)
            deliveries = Deliveries(
                stores.outbox, either(targets, tenant_webhooks.resolve), client, settings.webhooks, metrics
            )
            bodies = BodyReader(settings.limits, settings.edge.body_timeout_s, metrics)
            stack.push_async_callback(bodies.close)
            tasks = Supervisor(metrics.task_crashes)
            stack.push_async_callback(tasks.stop, WORK_GRACE_S, SHUTDOWN_WAIT_S)
            # The composition root (docs/architecture.md): each part built once, from what it uses, by keyword.
            # What a verdict does: reported, kept as an incident (with its notices), probed, answered on its replica.
            incident = incident_handling(
                settings=settings,
                metrics=metrics,
                pool=pool,
                capacity=capacity,
                client=client,
                store=stores.store,
                events=stores.events,
                incidents=stores.incidents,
                notices=stores.notices,
                ledger=ledger,
                tenant_webhooks=tenant_webhooks,
                deliveries=deliveries,
                spawn=tasks.spawn,
            )
            # The request path: a slot held, the fair gate, the judges, the pipeline.
            in_flight: Counter[str] = Counter()  # what each tenant holds here: Slot counts it, the gate reads it
            gate = Gate(pool, load, metrics, in_flight)
            tenants.left = gate.forget
            limiter = RateLimiter(
                stores.buckets, fail_open=settings.rate_limits.on_store_failure == "fail_open", metrics=metrics
            )
            slots = Slots(in_flight=in_flight, metrics=metrics, limiter=limiter, gate=gate, spawn=tasks.spawn)
            judging = Judging(
                pool=pool,
                upstream=upstream,
                fingerprints=fingerprinter,
                verdicts=verdicts,
                ledger=ledger,
                metrics=metrics,
                gate=gate,
                slots=slots,
                reporter=incident.reporter,
                spawn=tasks.spawn,
            )
            counters = build_counters(settings, tokenizers, pool, upstream, executor)
            pipeline = Pipeline(
                settings=settings,
                counters=counters,
                capacity=capacity,
                verdicts=verdicts,
                router=router,
                gate=gate,
                slots=slots,
                salts=CacheSalts(salt_secret(settings)),
                markers=markers,
                fingerprints=fingerprinter,
                upstream=upstream,
                judging=judging,
                metrics=metrics,
                ledger=ledger,
                reporter=incident.reporter,
                responder=incident.responder,
                tracker=incident.tracker,
                spawn=tasks.spawn,
            )
            # The queue's workers: the pipeline, and a background response's finisher (api/responses.py).
            worker = Worker(
                pipeline=pipeline,
                tenants=tenants,
                gate=gate,
                queue=stores.queue,
                finishers={RESPONSES.name: Background(stores.conversations)},
            )
            # The routes: each surface given the pipeline and the few services it uses.
            intake = Intake(tenants=tenants, bodies=bodies, tracing=tracing)
            openai = OpenAIRoutes(pipeline=pipeline, intake=intake, metrics=metrics)
            responses = ResponsesRoutes(
                pipeline=pipeline,
                intake=intake,
                settings=settings,
                conversations=stores.conversations,
                queue=stores.queue,
                metrics=metrics,
            )
            notices = NoticeRoutes(
                tenants=tenants,
                notices=stores.notices,
                tenant_webhooks=tenant_webhooks,
                body_timeout_s=settings.edge.body_timeout_s,
            )
            tenants_admin = TenantAdminRoutes(
                settings=settings,
                tenants=tenants,
                audit=stores.audit,
                tenant_webhooks=tenant_webhooks,
                conversations=stores.conversations,
            )
            incidents_admin = IncidentAdminRoutes(
                settings=settings, incidents=stores.incidents, ledger=ledger, pool=pool, tracker=incident.tracker
            )
            admin = AdminRoutes(
                settings=settings,
                pool=pool,
                capacity=capacity,
                events=stores.events,
                audit=stores.audit,
                verdicts=verdicts,
                tracker=incident.tracker,
                tenants=tenants_admin,
                incidents=incidents_admin,
                webhooks=WebhookAdminRoutes(deliveries=deliveries),
                notices=notices,
            )
            app.router.routes[:] = route_table(
                process=ProcessRoutes(
                    readiness=ReadinessCheck(
                        settings=settings,
                        pool=pool,
                        capacity=capacity,
                        tenants=tenants,
                        tasks=tasks,
                        redis=redis,
                        feed=feed,
                    ),
                    metrics=metrics,
                    metrics_token=settings.metrics_token,
                ),
                openai=openai,
                responses=responses,
                anthropic=AnthropicRoutes(
                    pipeline=pipeline,
                    intake=intake,
                    settings=settings,
                    verdicts=verdicts,
                    slots=slots,
                    router=router,
                    counters=counters,
                    metrics=metrics,
                ),
                tokenization=TokenizationRoutes(
                    intake=intake,
                    settings=settings,
                    verdicts=verdicts,
                    capacity=capacity,
                    slots=slots,
                    counters=counters,
                    metrics=metrics,
                ),
                notices=notices,
                catalog=CatalogRoutes(tenants=tenants, settings=settings),
                admin=admin,
                console=ConsoleRoutes(
                    settings=settings,
                    admin=admin,
                    incidents=incidents_admin,
                    tenants=tenants_admin,
                    notices=stores.notices,
                    tenant_webhooks=tenant_webhooks,
                    outbox=deliveries.outbox,
                ),
                workers=WorkersRoutes(
                    pipeline=pipeline,
                    intake=intake,
                    settings=settings,
                    queue=stores.queue,
                    metrics=metrics,
                    openai=openai,
                    responses=responses,
                ),
            )
            stack.callback(app.router.routes.clear)  # a stopped app serves nothing of what it closed
            # For callers in the same process (the tests): the supervisor's fault hooks, the pipeline's state. No
            # route or task reads app.state: each was handed what it uses.
            app.state.pipeline, app.state.tasks = pipeline, tasks
            keep_tasks(
                tasks,
                settings=settings,
                client=client,
                pool=pool,
                capacity=capacity,
                load=load,
                markers=markers,
                metrics=metrics,
                tenants=tenants,
                verdicts=verdicts,
                ledger=ledger,
                tracker=incident.tracker,
                responder=incident.responder,
                prober=incident.prober,
                deliveries=deliveries,
                redis=redis,
                worker=worker,
                instance=instance,
                workers=workers,
            )
            loop = asyncio.get_running_loop()
            metrics.track(metrics.tasks, lambda: len(asyncio.all_tasks(loop)))
            if fingerprinter is not None:
                metrics.track(metrics.fingerprints, lambda: len(fingerprinter.index))
                if isinstance(indexes := fingerprinter.index, ReplicaIndexes):
                    metrics.track(metrics.fingerprint_bytes, lambda: indexes.nbytes)
                tasks.keep("fingerprint-sweep", partial(sweep_fingerprints, fingerprinter, metrics))
            if fingerprinter is not None and feed is not None:
                # The other instances' prompts as they come, from where the start read the streams to; when it could
                # not, from the last ttl_s (or each stream's start): answers wait on it.
                tasks.keep(
                    "fingerprint-follower",
                    partial(feed.follow, fingerprinter.index, feed.start(feed_ready)),
                    breaks="answers wait for it and are withheld (fingerprint_feed_lag)",
                )
                if feed.cells is not None:
                    tasks.keep("fingerprint-cells", feed.keep_claims)
            # What start-up built (modules, the tokenizer, settings, tables) lives as long as the process: frozen out
            # of the collector's sight, a full collection stops walking it, which took ~40 ms a time under load (a
            # p99 spike for every request in flight then). Thawed at shutdown (the whole process's frozen objects,
            # not only this app's), so that an app made and dropped in a longer-lived process (tests, the demo) does
            # not keep its start-up's cycles out of the collector's reach for good.
            gc.collect()
            gc.freeze()
            stack.callback(gc.unfreeze)
            # A thread's work on a large body (validation, reading, counting) holds the GIL until it is asked for it:
            # the loop waits that long for each of its turns (the process's, restored as the freeze is).
            stack.callback(sys.setswitchinterval, sys.getswitchinterval())
            sys.setswitchinterval(SWITCH_INTERVAL_S)
            yield

    app = Starlette(
        exception_handlers={HTTPException: _http_error, Exception: _unexpected},
        middleware=[Middleware(BadSettingsAtStart), Middleware(RequestIdHeader)],
        lifespan=lifespan,
    )
    # Starlette would answer a path with a trailing slash by a redirect to the path without it, built from the Host
    # header: any client's Host made it an open redirect. OpenAI answers such a path 404, and the SDK never sends one.
    app.router.redirect_slashes = False
    app.state.openapi = orjson.dumps(openapi_document())
    app.state.bad_settings = None
    return app
