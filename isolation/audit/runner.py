"""Running the probes: discovery, then each probe in turn, within one budget.

`run_audit` is the whole audit, as the command runs it. `probe_replica` runs only the canary and accounting
probes against one server with identities the caller made: what a background task inside the gateway can call
for each replica, with its own client and its own low budget.
"""

from __future__ import annotations

import random
import time
from collections.abc import Sequence
from datetime import UTC, datetime

import httpx

from isolation.audit import accounting, canary, interleaving, overlength
from isolation.audit.budget import Budget
from isolation.audit.canaries import CanaryBook
from isolation.audit.config import AuditConfig, Identity, make_identities
from isolation.audit.context import Observer, Probe, ProbeContext, Quiet
from isolation.audit.discovery import EndpointFacts, discover
from isolation.audit.endpoint import Endpoint
from isolation.audit.errors import BudgetExhausted, CannotRun
from isolation.audit.findings import ProbeResult
from isolation.audit.prompts import PromptBuilder
from isolation.audit.report import Report

PROBES: tuple[Probe, ...] = (overlength.PROBE, accounting.PROBE, canary.PROBE, interleaving.PROBE)
REPLICA_PROBES: tuple[Probe, ...] = (canary.PROBE, accounting.PROBE)


def _describe(keys: Sequence[str]) -> str:
    if len(keys) == 2:
        return "two API keys (A: the first --key, B: the second)"
    shared = "one API key" if keys else "no API key"
    return f"{shared}; A and B differ by `user` and `cache_salt`"


async def run_probes(ctx: ProbeContext, probes: Sequence[Probe]) -> list[ProbeResult]:
    """Each probe in turn; one that runs out of budget stops the rest, one whose endpoint fails stops itself."""
    results = []
    budget = ctx.endpoint.budget
    stopped: str | None = None
    for probe in probes:
        result = ProbeResult(probe.name)
        results.append(result)
        if stopped is not None:
            result.incomplete = f"not run: {stopped}"
            continue
        ctx.observer.phase(probe.name, probe.steps(ctx))
        used, failures = budget.used, ctx.endpoint.failures
        try:
            await probe.run(ctx, result)
        except BudgetExhausted as exc:
            stopped = result.incomplete = str(exc)
        except CannotRun as exc:
            result.incomplete = str(exc)
        result.requests = budget.used - used
        lost = ctx.endpoint.failures - failures
        if lost and result.incomplete is None:
            # A request that got no answer tested nothing: the probe cannot vouch for the endpoint.
            result.incomplete = f"{lost} request(s) got no HTTP answer (timeout or connection error)"
    return results


def _context(
    endpoint: Endpoint,
    facts: EndpointFacts,
    identities: tuple[Identity, Identity],
    rng: random.Random,
    rounds: int,
    answer_tokens: int,
    observer: Observer,
) -> ProbeContext:
    return ProbeContext(
        endpoint=endpoint,
        facts=facts,
        identities=identities,
        prompts=PromptBuilder(endpoint, identities[0], facts.exact_counts, rng),
        book=CanaryBook(identities),
        rng=rng,
        rounds=rounds,
        answer_tokens=answer_tokens,
        observer=observer,
    )


async def run_audit(config: AuditConfig, client: httpx.AsyncClient, observer: Observer | None = None) -> Report:
    """The whole audit against `config.endpoint`, over the caller's client. Never raises for the endpoint's sake."""
    observer = observer or Quiet()
    seed = config.seed if config.seed is not None else random.SystemRandom().randrange(1 << 32)
    started = time.monotonic()
    report = Report(
        endpoint=config.endpoint,
        model=config.model,
        identities=_describe(config.keys),
        seed=seed,
        started_at=datetime.now(UTC).isoformat(timespec="seconds"),
        secrets=config.keys,
    )
    budget = Budget(config.max_requests, config.timeout_s, config.rate)
    endpoint = Endpoint(client, config.base_url, config.model, budget)
    identities = make_identities(config.keys)
    observer.phase("discovery", 1)
    try:
        report.facts = await discover(endpoint, identities, config.limit, config.stages)
        observer.step("discovery")
        rng = random.Random(seed)
        ctx = _context(endpoint, report.facts, identities, rng, config.rounds, config.answer_tokens, observer)
        report.probes = await run_probes(ctx, PROBES)
    except (CannotRun, BudgetExhausted) as exc:
        report.error = str(exc)
    report.requests = budget.used
    report.duration_s = time.monotonic() - started
    return report


async def probe_replica(
    client: httpx.AsyncClient,
    base_url: str,
    model: str,
    identities: tuple[Identity, Identity],
    *,
    limit: int | None = None,
    max_requests: int = 60,
    time_limit_s: float = 120.0,
    rate: float = 1.0,
    rounds: int = 1,
    answer_tokens: int = 64,
    seed: int | None = None,
) -> list[ProbeResult]:
    """Canary and accounting probes against one replica.

    Raises CannotRun when the replica cannot be probed at all, BudgetExhausted when discovery alone used the
    budget up.
    The caller makes the identities once (`make_identities`) and keeps them, so its markers stay known to it.
    """
    budget = Budget(max_requests, time_limit_s, rate)
    endpoint = Endpoint(client, base_url.rstrip("/"), model, budget)
    facts = await discover(endpoint, identities, limit)
    ctx = _context(endpoint, facts, identities, random.Random(seed), rounds, answer_tokens, Quiet())
    return await run_probes(ctx, REPLICA_PROBES)
