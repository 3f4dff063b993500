"""Where shared state lives: with `redis_url`, every store is the Redis twin (shared by every instance on that Redis
or Redis Cluster, under `redis_key_prefix`); without, the memory twin (this process only). The twin is picked here,
once, for all; the exposure ledger alone may live in PostgreSQL instead (`isolation.ledger.postgres_url`: the
lifespan's pool)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from psycopg_pool import AsyncConnectionPool

from gateway.api.conversations import ConversationStore, MemoryConversationStore, RedisConversationStore
from gateway.incidents.incident import IncidentStore, MemoryIncidentStore, RedisIncidentStore
from gateway.incidents.ledger import Ledger, MemoryLedger, RedisLedger
from gateway.incidents.notices import MemoryNoticeStore, NoticeStore, RedisNoticeStore
from gateway.incidents.pgledger import PostgresLedger
from gateway.jobs.queue import JobQueue, MemoryJobQueue, RedisJobQueue
from gateway.settings import Settings
from gateway.store import MemoryStore, RedisStore, Store
from gateway.tenancy.auditlog import AuditLog, MemoryAuditLog, RedisAuditLog
from gateway.tenancy.directory import DirectoryStore, MemoryDirectoryStore, RedisDirectoryStore
from gateway.tenancy.ratelimit import RedisBuckets
from gateway.tenancy.webhooks import MemoryRegistrationStore, RedisRegistrationStore, RegistrationStore
from gateway.webhooks import MemoryOutbox, Outbox, RedisOutbox
from isolation.events import EventLog, MemoryEventLog, RedisEventLog
from isolation.fingerprint_feed import RedisFingerprintFeed
from isolation.markers import RedisMarkerStore
from isolation.poison import Poison
from isolation.redis_keys import RedisClient
from isolation.replication import NO_WAIT, Replication


@dataclass(frozen=True)
class Stores:
    redis: RedisClient | None
    directory: DirectoryStore  # tenants and keys made at runtime
    store: Store  # replicas' admin states and the windowed budgets (suspensions, probes, verdicts)
    events: EventLog  # isolation events
    audit: AuditLog  # admin changes
    queue: JobQueue  # the async API's jobs
    conversations: ConversationStore  # the Responses API's stored responses
    ledger: Ledger  # who each replica served, when (no text)
    incidents: IncidentStore  # replicas' fault episodes
    notices: NoticeStore  # what incidents told each tenant
    registrations: RegistrationStore  # tenants' own webhooks
    outbox: Outbox  # webhook notices not yet delivered, and dead letters
    buckets: RedisBuckets | None  # rate limits across instances; None: each instance counts its own
    markers: RedisMarkerStore | None  # canary markers, for other instances to recognise
    prefix: str  # every Redis name starts with it: deployments on one Redis share nothing
    feed_ttl_s: float  # how long a prompt's fingerprints stay in the feed
    poison: Poison  # where readers of shared state account for the entries they cannot decode

    def fingerprint_feed(
        self,
        instance: str,
        replicas: Sequence[str] | None = None,
        *,
        cell: str | None = None,
        replication: Replication = NO_WAIT,
    ) -> RedisFingerprintFeed | None:
        """Every instance's prompts, for the fingerprint index (`replicas`: a stream for each of these, the replicas
        this instance routes to, under its `cell`'s hash tag on a cluster); None: this instance's only."""
        if self.redis is None:
            return None
        return RedisFingerprintFeed(
            self.redis,
            instance,
            self.feed_ttl_s,
            prefix=self.prefix,
            poison=self.poison,
            replicas=replicas,
            cell=cell,
            replication=replication,
        )


def replication_of(settings: Settings) -> Replication:
    """What must outlive a failover counts as written once this many replicas hold it (isolation/replication.py)."""
    return Replication(settings.redis_wait_replicas, settings.redis_wait_timeout_s)


def build_stores(
    settings: Settings, redis: RedisClient | None, postgres: AsyncConnectionPool | None, *, poison: Poison
) -> Stores:
    """`postgres`: the pool to `isolation.ledger.postgres_url`, None when it is unset; `poison`: where the Redis
    twins account for entries they cannot decode (the memory twins hold none)."""
    events_max, audit_max = settings.isolation.events_max, settings.tenant_directory.audit_events_max
    queue, ttl, prefix = settings.queue, settings.isolation.fingerprints.ttl_s, settings.redis_key_prefix
    kept, ledger = settings.responses, settings.isolation.ledger
    on_postgres = (
        None if postgres is None else PostgresLedger(postgres, ledger.retention_s, schema=ledger.postgres_schema)
    )
    if redis is None:
        outbox = MemoryOutbox()
        return Stores(
            redis=None,
            directory=MemoryDirectoryStore(),
            store=MemoryStore(),
            events=MemoryEventLog(events_max),
            audit=MemoryAuditLog(audit_max),
            queue=MemoryJobQueue(queue.result_ttl_s),
            conversations=MemoryConversationStore(kept.ttl_s, kept.max_bytes_per_tenant),
            ledger=on_postgres or MemoryLedger(ledger.retention_s, ledger.max_memory_records),
            incidents=MemoryIncidentStore(ledger.retention_s),
            notices=MemoryNoticeStore(ledger.retention_s, outbox),
            registrations=MemoryRegistrationStore(),
            outbox=outbox,
            buckets=None,
            markers=None,
            prefix=prefix,
            feed_ttl_s=ttl,
            poison=poison,
        )
    redis_outbox = RedisOutbox(redis, prefix=prefix, poison=poison)
    replication = replication_of(settings)
    return Stores(
        redis=redis,
        directory=RedisDirectoryStore(redis, prefix=prefix, poison=poison, replication=replication),
        store=RedisStore(redis, prefix=prefix, poison=poison, replication=replication),
        events=RedisEventLog(redis, events_max, prefix=prefix),
        audit=RedisAuditLog(redis, audit_max, prefix=prefix),
        queue=RedisJobQueue(
            redis, queue.result_ttl_s, queue.reclaim_after_s, prefix=prefix, poison=poison, replication=replication
        ),
        conversations=RedisConversationStore(redis, kept.ttl_s, kept.max_bytes_per_tenant, prefix=prefix),
        ledger=on_postgres or RedisLedger(redis, ledger.retention_s, prefix=prefix, poison=poison),
        incidents=RedisIncidentStore(redis, ledger.retention_s, prefix=prefix),
        notices=RedisNoticeStore(redis, ledger.retention_s, redis_outbox, replication=replication),
        registrations=RedisRegistrationStore(redis, prefix=prefix),
        outbox=redis_outbox,
        buckets=RedisBuckets(redis, prefix=prefix),
        markers=RedisMarkerStore(redis, prefix=prefix),
        prefix=prefix,
        feed_ttl_s=ttl,
        poison=poison,
    )
