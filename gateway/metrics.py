"""Every Prometheus metric the gateway exports, defined once, in a registry owned by one app instance.

Under `--workers N` (PROMETHEUS_MULTIPROC_DIR set before the process starts) every process writes its values to
prometheus_client's multiprocess files and /metrics reads them all, so a scrape of any process sees the machine's
totals: counters and histograms summed, each gauge combined as its `multiprocess_mode` says.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, Self

import prometheus_client
from prometheus_client import CollectorRegistry, disable_created_metrics, generate_latest
from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead

# Prompt sizes span tiny chat turns to million-token contexts.
PROMPT_TOKEN_BUCKETS = (16, 64, 256, 1024, 4096, 16384, 65536, 262144, 1048576)
# Gateway latency is dominated by the engine; buckets reach from sub-millisecond overhead to long generations.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
QUEUE_WAIT_BUCKETS = (0.005, 0.025, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)  # per tenant: few; 5 ms = did not wait
MULTIPROC_DIR_VARIABLE = "PROMETHEUS_MULTIPROC_DIR"
_LIVE_FILE = re.compile(r"^gauge_live\w+_(\d+)\.db$")


# Children kept per metric: every model × route × status, replica × state and the like many times over; past it the
# oldest kept goes (it is looked up again, and kept again, when next used), so labels that keep coming (tenants) cost
# bounded memory here.
KEPT_CHILDREN = 4096


class _KeptChildren(MetricWrapperBase):
    """labels() converts, checks and locks on every call (~3 µs, eight times a request); the children of a metric
    are few (configured models, routes, replicas, statuses), so each one is kept from its lookup, up to
    KEPT_CHILDREN."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._kept: dict[tuple[Any, ...], Self] = {}

    def labels(self, *values: Any, **named: Any) -> Self:
        if named:
            return super().labels(*values, **named)
        child = self._kept.get(values)
        if child is None:
            if len(self._kept) >= KEPT_CHILDREN:
                del self._kept[next(iter(self._kept))]
            child = self._kept[values] = super().labels(*values)
        return child

    @property
    def label_names(self) -> tuple[str, ...]:
        """Its labels, for docs/metrics.md (prometheus_client keeps them private)."""
        return tuple(self._labelnames)

    def remove(self, *values: Any) -> None:
        self._kept.clear()
        super().remove(*values)

    def remove_by_labels(self, labels: dict[str, str]) -> None:
        self._kept.clear()
        super().remove_by_labels(labels)

    def clear(self) -> None:
        self._kept.clear()
        super().clear()


class Counter(_KeptChildren, prometheus_client.Counter):
    pass


class Gauge(_KeptChildren, prometheus_client.Gauge):
    pass


class Histogram(_KeptChildren, prometheus_client.Histogram):
    pass


def clear_metric_files(directory: Path) -> None:
    """Remove the value files of an earlier run (prometheus_client's rule: the directory starts empty)."""
    for file in directory.glob("*.db"):
        file.unlink(missing_ok=True)


def _forget_dead_processes(directory: Path) -> None:
    """A process killed without its shutdown leaves its live gauges (in-flight requests) behind: drop them."""
    for file in directory.glob("gauge_live*.db"):
        match = _LIVE_FILE.match(file.name)
        if match is None:
            continue
        pid = int(match.group(1))
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            mark_process_dead(pid, str(directory))  # type: ignore[no-untyped-call]  # unannotated upstream
        except PermissionError:  # alive, another user's
            pass


class GatewayMetrics:
    def __init__(self, with_redis: bool = False) -> None:
        # `_created` series double every counter's size on the wire and no dashboard or alert of ours reads them.
        disable_created_metrics()  # type: ignore[no-untyped-call]  # prometheus_client leaves it unannotated
        directory = os.environ.get(MULTIPROC_DIR_VARIABLE)
        self.shared_directory = Path(directory) if directory else None
        if self.shared_directory is not None:
            _forget_dead_processes(self.shared_directory)
        self.registry = CollectorRegistry()
        self._tracked: list[tuple[Gauge, Callable[[], float]]] = []
        self.requests = Counter(
            "bulkhead_requests",
            "Requests answered, by model, route and HTTP status.",
            ["model", "route", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "bulkhead_request_duration_seconds",
            "Time from request received to last byte sent.",
            ["model", "route"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.time_to_first_byte = Histogram(
            "bulkhead_time_to_first_byte_seconds",
            "Time from request received to the first response byte (the first token, for streams).",
            ["model", "route"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.in_flight = Gauge(
            "bulkhead_in_flight_requests",
            "Inference requests being served now.",
            registry=self.registry,
            multiprocess_mode="livesum",
        )
        self.upstream_errors = Counter(
            "bulkhead_upstream_errors",
            "Failed backend calls, by backend and kind (unreachable, timeout, bad_response, status_5xx).",
            ["backend", "kind"],
            registry=self.registry,
        )
        self.closed_unanswered = Counter(
            "bulkhead_upstream_closed_unanswered",
            "Requests sent to a backend that closed or reset the connection before answering: they may have run "
            "there, and were not sent again (also counted as upstream errors of kind unreachable).",
            ["backend"],
            registry=self.registry,
        )
        self.backend_up = Gauge(
            "bulkhead_backend_up",
            "1 when the backend's last health check passed.",
            ["backend"],
            registry=self.registry,
            multiprocess_mode="livemostrecent",
        )
        self.tokens = Counter(
            "bulkhead_tokens",
            "Tokens reported by backends, by model and kind (prompt, completion).",
            ["model", "kind"],
            registry=self.registry,
        )
        self.backend_max_model_len = Gauge(
            "bulkhead_backend_max_model_len_tokens",
            "max_model_len a backend reports in /v1/models.",
            ["backend"],
            registry=self.registry,
            multiprocess_mode="livemostrecent",
        )
        self.backend_kv_capacity = Gauge(
            "bulkhead_backend_kv_capacity_tokens",
            "KV cache capacity a backend reports (num_gpu_blocks × block_size).",
            ["backend"],
            registry=self.registry,
            multiprocess_mode="livemostrecent",
        )
        self.stage_kv_capacity = Gauge(
            "bulkhead_stage_kv_capacity_tokens",
            "KV cache capacity a disaggregated backend's stage reports (the last it gave).",
            ["backend", "stage", "role"],
            registry=self.registry,
            multiprocess_mode="livemostrecent",
        )
        self.stage_readable = Gauge(
            "bulkhead_stage_readable",
            "1 when a disaggregated backend's stage gave its KV capacity at the last read, else 0.",
            ["backend", "stage", "role"],
            registry=self.registry,
            multiprocess_mode="livemin",
        )
        self.stage_sets_limit = Gauge(
            "bulkhead_stage_sets_limit",
            "1 when this stage's KV cache sets the prompt limit (prefill) or the prompt + output limit (decode) of a "
            "model it serves, else 0.",
            ["backend", "stage", "role"],
            registry=self.registry,
            multiprocess_mode="livemostrecent",
        )
        self.model_prompt_limit = Gauge(
            "bulkhead_model_prompt_limit_tokens",
            "The longest prompt a model admits now (with one token of output), before any tenant's own cap.",
            ["model"],
            registry=self.registry,
            multiprocess_mode="livemostrecent",
        )
        self.model_context_window = Gauge(
            "bulkhead_model_context_window_tokens",
            "The context window a model advertises.",
            ["model"],
            registry=self.registry,
            multiprocess_mode="livemostrecent",
        )
        self.model_capacity = Gauge(
            "bulkhead_model_capacity_tokens",
            "What a model's deployment can really hold: the least of its backends' windows and KV capacities.",
            ["model"],
            registry=self.registry,
            multiprocess_mode="livemostrecent",
        )
        self.admission_rejections = Counter(
            "bulkhead_admission_rejections",
            "Requests refused before forwarding because prompt + output exceed the limit, by what set it.",
            ["model", "reason"],
            registry=self.registry,
        )
        self.body_refusals = Counter(
            "bulkhead_body_refusals",
            "Request bodies refused for their shape before anything read them, by route and the limit they passed "
            "(max_json_values, max_json_depth, max_messages, max_content_parts, max_tools).",
            ["route", "limit"],
            registry=self.registry,
        )
        self.body_checks = Histogram(
            "bulkhead_body_check_seconds",
            "Time a large request body waited for and took in a worker process's check (limits.inline_json_values), "
            "by route.",
            ["route"],
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.prompt_tokens = Histogram(
            "bulkhead_prompt_tokens",
            "Prompt tokens counted at admission.",
            ["model"],
            buckets=PROMPT_TOKEN_BUCKETS,
            registry=self.registry,
        )
        self.injected_tokens = Histogram(
            "bulkhead_injected_prompt_tokens",
            "Prompt tokens the gateway adds to a request for isolation (canary markers): the engine's cost, which "
            "tenants neither see in their usage nor pay for.",
            ["model"],
            buckets=(0, 8, 16, 32, 64, 128, 256, 512, 1024),
            registry=self.registry,
        )
        self.quarantines = Counter(
            "bulkhead_quarantines",
            "Automatic quarantine decisions after a leak, by replica and outcome (suspended, held, quarantined, "
            "probing, confirmed, unconfirmed, inconclusive, released, probe_bounded, taken_over, disabled).",
            ["replica", "outcome"],
            registry=self.registry,
        )
        self.incidents = Counter(
            "bulkhead_incidents",
            "Incidents (a replica's fault episode: docs/incidents.md) opened and closed, by model and replica; "
            "open now = opened - closed.",
            ["model", "replica", "change"],
            registry=self.registry,
        )
        self.incidents_open = Gauge(
            "bulkhead_incidents_open",
            "1 for each replica with an open incident (read from the store: every instance sees every incident).",
            ["model", "replica"],
            registry=self.registry,
            multiprocess_mode="livemax",
        )
        self.incident_exposed = Gauge(
            "bulkhead_incident_exposed_answers",
            "For each replica with an open incident, its answers that reached their clients, whole or in part, "
            "carrying another tenant's data (read from the store, like bulkhead_incidents_open).",
            ["model", "replica"],
            registry=self.registry,
            multiprocess_mode="livemax",
        )
        self.exposed_answers = Counter(
            "bulkhead_exposed_answers",
            "Answers found to carry another tenant's data (a leak event), by what became of them: withheld, delivered "
            "(policy alert or redact), partial (a stream cut after some of that data went out).",
            ["model", "replica", "verdict"],
            registry=self.registry,
        )
        self.notices = Counter(
            "bulkhead_notices",
            "Notices made for tenants by confirmed incidents, by type (isolation.exposure to victims, "
            "isolation.foreign_data to recipients).",
            ["type"],
            registry=self.registry,
        )
        self.probe_passes = Counter(
            "bulkhead_probe_passes",
            "The prober's passes over a replica, by outcome: clean (where the replica's next exposure window starts), "
            "findings, or not_run.",
            ["replica", "outcome"],
            registry=self.registry,
        )
        self.ledger_dropped = Counter(
            "bulkhead_ledger_dropped",
            "Exposure ledger records lost: the store could not take them and the buffer was full.",
            registry=self.registry,
        )
        self.task_crashes = Counter(
            "bulkhead_task_crashes",
            "Background tasks that failed, by name: a long-lived one that crashed (started again after a pause) or "
            "one-shot work (a probe, a notice, a settlement) that raised.",
            ["task"],
            registry=self.registry,
        )
        self.poison_entries = Counter(
            "bulkhead_poison_entries",
            "Entries of shared state that their reader could not decode, dropped so that they are never read again "
            "(isolation/poison.py), by reader: jobs, deferred_jobs, webhook_outbox, fingerprint_feed, ledger, "
            "verdict_blocks, replica_failures, tenant_changes.",
            ["reader"],
            registry=self.registry,
        )
        self.tasks = Gauge(
            "bulkhead_tasks",
            "asyncio tasks in this process's event loop: requests being served, background tasks and their work "
            "(under --workers one series per live process, by pid).",
            registry=self.registry,
            multiprocess_mode="liveall",
        )
        self.isolation_events = Counter(
            "bulkhead_isolation_events",
            "Answers withheld because they could not be shown safe, by kind (usage_mismatch, leak).",
            ["kind", "model", "replica"],
            registry=self.registry,
        )
        self.count_drift = Counter(
            "bulkhead_prompt_count_drift",
            "Answers whose engine counted the prompt it was sent otherwise than the gateway did (its own /tokenize "
            "agreeing with its usage): the gateway's bug, by the request's shape; never an isolation event.",
            ["model", "route", "shape"],
            registry=self.registry,
        )
        self.replica_state = Gauge(
            "bulkhead_replica_state",
            "1 for the state a replica is in (healthy, unhealthy, quarantined, draining, suspended, held).",
            ["backend", "state"],
            registry=self.registry,
            multiprocess_mode="livemostrecent",
        )
        self.replica_in_flight = Gauge(
            "bulkhead_replica_in_flight_requests",
            "Requests in flight per replica, from this instance.",
            ["backend"],
            registry=self.registry,
            multiprocess_mode="livesum",
        )
        self.routed = Counter(
            "bulkhead_routed_requests",
            "Requests sent to a replica, by why it was chosen (affinity, spill, failover, two-choices).",
            ["backend", "reason"],
            registry=self.registry,
        )
        self.session_remaps = Counter(
            "bulkhead_session_remaps",
            "Affinity sessions routed to another replica than their previous request (a spill counts out and back).",
            registry=self.registry,
        )
        self.leaks = Counter(
            "bulkhead_isolation_leaks",
            "Answers that carried another tenant's data, by model, replica and how it was recognised (kind: leak, a "
            "canary marker; fingerprint_leak, a fragment of its prompt).",
            ["model", "replica", "kind"],
            registry=self.registry,
        )
        self.fragment_verdicts = Counter(
            "bulkhead_fragment_verdicts",
            "Fragments of another tenant's prompt found in answers, by recipient tenant and verdict: induced (the "
            "text came back on a replica its owner's prompt never went to: the answer went out), leak (it did not: "
            "withheld), unjudged (no other replica to judge on: withheld).",
            ["tenant", "model", "replica", "verdict"],
            registry=self.registry,
        )
        self.judges = Counter(
            "bulkhead_judges",
            "Judges asked of another replica (each one more answer of the request), by recipient tenant and when: on "
            "a suspect (suspect), or with the request, for a tenant past max_judges_per_day (start).",
            ["tenant", "model", "when"],
            registry=self.registry,
        )
        self.fingerprints = Gauge(
            "bulkhead_prompt_fingerprints",
            "Fingerprints of recent prompts this instance checks answers against (its own and other instances').",
            registry=self.registry,
            multiprocess_mode="livemax",
        )
        self.fingerprint_bytes = Gauge(
            "bulkhead_fingerprint_index_bytes",
            "Bytes the indexes of the replicas this instance routes to hold (coverage: kv_cache; each bounded by "
            "kv_multiple times its replica's KV capacity).",
            registry=self.registry,
            multiprocess_mode="livemax",
        )
        self.canary_markers = Gauge(
            "bulkhead_canary_markers",
            "Canary markers this instance recognises (tenants × live epochs × keys).",
            registry=self.registry,
            multiprocess_mode="livemax",
        )
        self.ratelimit_rejections = Counter(
            "bulkhead_ratelimit_rejections",
            "Requests refused with 429 by the per-tenant rate limits.",
            registry=self.registry,
        )
        self.ratelimit_fallbacks = Counter(
            "bulkhead_ratelimit_store_failures",
            "Rate-limit checks that could not reach Redis (served by local limits, or 503 under fail_closed).",
            registry=self.registry,
        )
        self.key_lookups = Counter(
            "bulkhead_tenant_key_lookups",
            "API keys not held in memory, by outcome: read from the tenant directory (store), refused without a read "
            "for want of a valid check (bad_check) or as recently unknown (unknown), or refused with 503 over "
            "tenant_directory.cold_lookups_per_s (busy).",
            ["outcome"],
            registry=self.registry,
        )
        self.queue_depth = Gauge(
            "bulkhead_queue_depth",
            "Requests waiting at this gateway for a saturated model, by model and tenant.",
            ["model", "tenant"],
            registry=self.registry,
            multiprocess_mode="livesum",
        )
        self.queue_wait = Histogram(
            "bulkhead_queue_wait_seconds",
            "Time requests waited at the gateway for a saturated model, by model and tenant (placed or refused).",
            ["model", "tenant"],
            buckets=QUEUE_WAIT_BUCKETS,
            registry=self.registry,
        )
        self.shed = Counter(
            "bulkhead_shed_requests",
            "Requests refused with 429 capacity_exceeded because a model was saturated, by reason: queue_full, "
            "wait_too_long (refused at once), timed_out (after fairness.max_queue_wait_s), reject_if_busy (the request "
            "asked not to wait: Workers AI's rejectIfBusy).",
            ["model", "reason"],
            registry=self.registry,
        )
        self.model_saturated = Gauge(
            "bulkhead_model_saturated",
            "1 while no replica of the model has room and its requests queue at the gateway.",
            ["model"],
            registry=self.registry,
            multiprocess_mode="livemax",
        )
        self.replica_running = Gauge(
            "bulkhead_replica_requests_running",
            "vllm:num_requests_running at the last read of the replica's /metrics.",
            ["backend"],
            registry=self.registry,
            multiprocess_mode="livemostrecent",
        )
        self.replica_waiting = Gauge(
            "bulkhead_replica_requests_waiting",
            "vllm:num_requests_waiting at the last read of the replica's /metrics.",
            ["backend"],
            registry=self.registry,
            multiprocess_mode="livemostrecent",
        )
        self.replica_kv_usage = Gauge(
            "bulkhead_replica_kv_cache_usage",
            "vllm:kv_cache_usage_perc at the last read of the replica's /metrics (1 = full).",
            ["backend"],
            registry=self.registry,
            multiprocess_mode="livemostrecent",
        )
        self.webhook_deliveries = Counter(
            "bulkhead_webhook_deliveries",
            "Webhook notices, by target kind (operator, tenant) and outcome: delivered; failed (an attempt that "
            "failed, to be retried); dead (a message listed as a dead letter, after webhooks.dead_after failed "
            "attempts); expired (past webhooks.max_age_s: no longer retried); dropped (its target is gone, or held "
            "too many).",
            ["target_kind", "outcome"],
            registry=self.registry,
        )
        # With Redis every instance reads the one shared outbox (the most recent read is the count); without, each
        # process holds its own (summed).
        outbox_mode = "livemostrecent" if with_redis else "livesum"
        self.webhook_pending = Gauge(
            "bulkhead_webhook_pending_messages",
            "Webhook notices still to be delivered (dead letters that are still retried among them).",
            registry=self.registry,
            multiprocess_mode=outbox_mode,
        )
        self.webhook_dead_letters = Gauge(
            "bulkhead_webhook_dead_letters",
            "Webhook notices listed as dead letters (GET /admin/webhooks/dead-letters), expired or still retried.",
            registry=self.registry,
            multiprocess_mode=outbox_mode,
        )
        self.keys_held = Gauge(
            "bulkhead_tenant_keys_held", "Runtime API keys held in this instance's memory.", registry=self.registry
        )
        # Only with Redis configured: a gauge stuck at 0 in a Redis-less gateway would page as "Redis down".
        self.redis_up = (
            Gauge(
                "bulkhead_redis_up",
                "1 when the last ping to the configured Redis answered.",
                registry=self.registry,
                multiprocess_mode="livemin",
            )
            if with_redis
            else None
        )

    def forget_tenant(self, tenant_id: str) -> None:
        """Remove every series of a deleted tenant. Under --workers prometheus_client cannot remove a series from
        its multiprocess files: there they stay until the processes restart."""
        if self.shared_directory is not None:
            return
        for metric in (self.queue_depth, self.queue_wait, self.fragment_verdicts, self.judges):
            metric.remove_by_labels({"tenant": tenant_id})

    def track(self, gauge: Gauge, read: Callable[[], float]) -> None:
        """`gauge` reads `read()`: when scraped; under --workers, at this process's scrapes and refreshes."""
        if self.shared_directory is None:
            gauge.set_function(read)
        else:
            self._tracked.append((gauge, read))

    def refresh(self) -> None:
        """Write the tracked gauges' values where the other processes' scrapes read them."""
        for gauge, read in self._tracked:
            gauge.set(read())

    def render(self) -> bytes:
        """The exposition text: this registry's, or under --workers every process's."""
        if self.shared_directory is None:
            return generate_latest(self.registry)
        self.refresh()
        merged = CollectorRegistry()
        MultiProcessCollector(merged, str(self.shared_directory))  # type: ignore[no-untyped-call]
        return generate_latest(merged)

    def close(self) -> None:
        """At the process's shutdown: its live gauges stop counting (its counters stay in the totals)."""
        if self.shared_directory is not None:
            mark_process_dead(os.getpid(), str(self.shared_directory))  # type: ignore[no-untyped-call]
