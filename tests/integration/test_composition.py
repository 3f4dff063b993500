"""The pipeline and a surface's routes are built from what they use, and nothing else: here a Pipeline made by hand
from real in-memory parts (no app, no lifespan, no tenant directory, no queue, no admin API), the OpenAI chat route
given it and an intake alone, served on its own, answering through every defence (docs/architecture.md, "The
composition root")."""

from __future__ import annotations

import random
import time
from collections import Counter
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

import httpx
import orjson
from starlette.applications import Starlette
from starlette.routing import Route

from gateway.api.body import BodyReader
from gateway.api.intake import Intake
from gateway.api.openai import OpenAIRoutes
from gateway.incidents.handling import incident_handling
from gateway.incidents.ledger import LedgerWriter
from gateway.incidents.verdicts import VerdictBound
from gateway.metrics import GatewayMetrics
from gateway.pipeline.counting import LocalCounter, Prompt
from gateway.pipeline.inference import Pipeline
from gateway.pipeline.judging import Judging
from gateway.pipeline.slot import Slots
from gateway.server.app import build_counters, load_tokenizers, make_fingerprinter, marker_registry, write_last
from gateway.server.serving import run_server
from gateway.server.stores import Stores, build_stores
from gateway.settings import Settings
from gateway.supervisor import Supervisor
from gateway.tenancy.lookups import NameLookups
from gateway.tenancy.ratelimit import RateLimiter
from gateway.tenancy.tenants import TenantDirectory
from gateway.tenancy.webhooks import SigningKey, TenantWebhooks
from gateway.upstream.backends import ReplicaPool
from gateway.upstream.capacity import CapacityMonitor
from gateway.upstream.fairness import Gate
from gateway.upstream.proxy import Upstream, make_client, make_session
from gateway.upstream.routing import Router
from gateway.upstream.saturation import LoadMonitor
from gateway.webhooks import Deliveries, settings_resolver
from isolation.markers import CanaryKey
from isolation.salts import CacheSalts
from tests.integration.support import MODEL, auth, chat_body, forwarded, gateway_settings
from tests.poisoned import Counted


async def compose(settings: Settings, stores: Stores, stack: AsyncExitStack) -> Pipeline:
    """The pipeline over the settings' backends, each collaborator built once and passed by keyword, as the
    lifespan builds them; what it opens is closed by `stack`."""
    metrics = GatewayMetrics()
    executor = stack.enter_context(ThreadPoolExecutor(1))
    client = await stack.enter_async_context(make_client(settings.upstream))
    session = await stack.enter_async_context(make_session(settings.upstream))
    pool = ReplicaPool(settings.backends, metrics, stores.store)
    capacity = CapacityMonitor(settings.models, settings.backends, pool, metrics, settings.upstream)
    await pool.refresh(client, 1.0)
    await capacity.refresh_all(client, 1.0)
    upstream = Upstream(session, settings.upstream, pool, metrics)
    tokenizers = load_tokenizers(settings)
    markers = await marker_registry(settings, [CanaryKey("k", b"s" * 32)], None, metrics, tokenizers)
    ledger = LedgerWriter(stores.ledger, 100, 60.0, metrics.ledger_dropped)
    stack.push_async_callback(write_last, ledger)
    tasks = Supervisor(metrics.task_crashes)
    stack.push_async_callback(tasks.stop, 1.0, 5.0)
    deliveries = Deliveries(
        stores.outbox, settings_resolver(settings.isolation.canary), client, settings.webhooks, metrics
    )
    webhooks = TenantWebhooks(stores.registrations, SigningKey(b"k" * 32), settings.isolation.notices, NameLookups())
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
        tenant_webhooks=webhooks,
        deliveries=deliveries,
        spawn=tasks.spawn,
    )
    in_flight: Counter[str] = Counter()
    gate = Gate(pool, LoadMonitor(settings.backends, pool, metrics), metrics, in_flight)
    limiter = RateLimiter(None, fail_open=True, metrics=metrics)
    slots = Slots(in_flight=in_flight, metrics=metrics, limiter=limiter, gate=gate, spawn=tasks.spawn)
    fingerprints = make_fingerprinter(settings, b"f" * 32, None, executor)
    verdicts = VerdictBound(stores.store, 10, 10)
    judging = Judging(
        pool=pool,
        upstream=upstream,
        fingerprints=fingerprints,
        verdicts=verdicts,
        ledger=ledger,
        metrics=metrics,
        gate=gate,
        slots=slots,
        reporter=incident.reporter,
        spawn=tasks.spawn,
    )
    return Pipeline(
        settings=settings,
        counters=build_counters(settings, tokenizers, pool, upstream, executor),
        capacity=capacity,
        verdicts=verdicts,
        router=Router(pool, metrics, settings.routing, random.Random()),
        gate=gate,
        slots=slots,
        salts=CacheSalts(b"c" * 32),
        markers=markers,
        fingerprints=fingerprints,
        upstream=upstream,
        judging=judging,
        metrics=metrics,
        ledger=ledger,
        reporter=incident.reporter,
        responder=incident.responder,
        tracker=incident.tracker,
        spawn=tasks.spawn,
    )


def chat_alone(settings: Settings, stores: Stores, built: list[Pipeline]) -> Starlette:
    """An app serving /v1/chat/completions and nothing else, its lifespan building what that route uses: the pipeline,
    and an intake (the tenants, the body reader). No queue, no admin API, no other surface."""

    @asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        async with AsyncExitStack() as stack:
            pipeline = await compose(settings, stores, stack)
            metrics = pipeline.metrics
            tenants = TenantDirectory(settings.tenants, stores.directory, settings.tenant_directory, metrics)
            await tenants.start()
            bodies = BodyReader(settings.limits, settings.edge.body_timeout_s, metrics)
            stack.push_async_callback(bodies.close)
            chat = OpenAIRoutes(pipeline=pipeline, intake=Intake(tenants=tenants, bodies=bodies), metrics=metrics)
            app.router.routes[:] = [Route("/v1/chat/completions", chat.chat_completions, methods=["POST"])]
            built.append(pipeline)
            yield

    return Starlette(lifespan=lifespan)


async def test_a_chat_route_given_only_the_pipeline_and_an_intake_answers_through_every_defence(
    client: httpx.AsyncClient, sim_url: str, tokenizer_dir: Path
) -> None:
    settings = gateway_settings({"sim": sim_url}, tokenizer_dir)
    stores, built = build_stores(settings, None, None, poison=Counted().poison), list[Pipeline]()
    started = time.time()
    with run_server(chat_alone(settings, stores, built)) as url:
        answer = await client.post(f"{url}/v1/chat/completions", json=chat_body(max_tokens=4), headers=auth())
        refused = await client.post(f"{url}/v1/chat/completions", json=chat_body(), headers=auth("sk-unknown"))
    assert answer.status_code == 200, answer.text
    assert refused.status_code == 401 and refused.json()["error"]["code"] == "invalid_api_key"
    [pipeline] = built
    [sent] = forwarded(sim_url)
    body = sent["body"]
    # Admitted, salted, marked and bounded on its way, and the answer checked and charged: the pipeline's own work.
    assert body["cache_salt"] and body["max_tokens"] == 4
    marker = pipeline.markers.marker("alice", pipeline.markers.of_model(MODEL).spelling)
    assert marker in orjson.dumps(body["messages"]).decode(), "the tenant's canary marker was planted"
    counter = pipeline.counters[MODEL]
    assert isinstance(counter, LocalCounter)
    own = counter.count_now(Prompt.of_chat(chat_body(), "alice"))
    assert answer.json()["usage"]["prompt_tokens"] == own, "the usage is the tenant's own prompt's, marker aside"
    # Its ledger record, written at the app's stop as the gateway's is.
    served, _ = await stores.ledger.served(settings.backends[0].name, started - 1, time.time() + 1, 10)
    assert [(s.tenant, s.verdict) for s in served] == [("alice", "delivered")]
