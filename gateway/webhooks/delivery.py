"""Delivering notices: `send` stores one in the outbox and returns its id; `run`, the lifespan's task, sends what is
due, retries what failed on the schedule, and lists what keeps failing as a dead letter.

Every attempt resolves the target again (its URL and secret may have changed, or it may be gone: then the message
is dropped), signs the same body under the same id with the attempt's time, and POSTs it; a 2xx removes the message.
Anything else (another status, no answer within `timeout_s`) counts a failed attempt: the next one comes after
`retry_schedule_s[attempts - 1]` (the last value once the schedule is spent). From `dead_after` failed attempts
the message is a dead letter, still retried; when the next attempt would fall past `max_age_s` of its making, it is
expired instead: no more attempts until an operator replays it (or discards it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import httpx
from redis.exceptions import RedisError

from gateway.metrics import GatewayMetrics
from gateway.settings import WebhookSettings
from gateway.webhooks.outbox import Message, Outbox
from gateway.webhooks.signing import notice_body, signed_headers
from gateway.webhooks.targets import Resolver, Target, target_kind

log = logging.getLogger("bulkhead.webhooks")

# A claim must outlive its attempt, or another instance sends the message too: the POST's timeout, plus the target's
# lookup and the outcome's write, each of which can wait on a busy Redis pool (redis_pool_timeout_s, 5 s by default).
LEASE_MARGIN_S = 30.0
# At shutdown, the longest wait for the attempts in flight (stop_tasks asks again sooner: 0.2 s).
FINISH_S = 1.0


class Deliveries:
    """The outbox, and the loop that empties it."""

    def __init__(
        self,
        outbox: Outbox,
        resolve: Resolver,
        client: httpx.AsyncClient,
        settings: WebhookSettings,
        metrics: GatewayMetrics,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.outbox = outbox
        self._resolve = resolve
        self._client = client
        self._settings = settings
        self._metrics = metrics
        self._clock = clock
        self._wake = asyncio.Event()
        self._store_down = False
        self._counted_at = -float("inf")

    async def send(self, target: str, event_type: str, data: Mapping[str, Any]) -> str:
        """Store a notice for `target` ("operator" or "tenant:<id>"); returns its id (its webhook-id) once stored.
        Raises ValueError for another target name, and the store's error when it cannot take it."""
        message = self.message(target, event_type, data)
        self.queued(message, await self.outbox.add(message, self._settings.max_pending_per_target))
        return message.id

    def message(self, target: str, event_type: str, data: Mapping[str, Any]) -> Message:
        """A new notice for `target`, due now, for whoever stores it (send, or a store that keeps it with something
        else in one step); ValueError for a target name that is neither "operator" nor "tenant:<id>"."""
        target_kind(target)
        now = self._clock()
        return Message(Message.new_id(now), target, event_type, notice_body(event_type, data, now), now, now)

    def queued(self, message: Message, dropped: list[Message]) -> None:
        """`message` is in the outbox, and `dropped` (its target's oldest past the bound) are not: counted, and the
        loop woken to send it."""
        for old in dropped:
            self._metrics.webhook_deliveries.labels(target_kind(old.target), "dropped").inc()
            log.warning(
                "webhook notice %s (%s) to %s dropped: the target holds %d newer ones",
                old.id,
                old.type,
                old.target,
                self._settings.max_pending_per_target,
            )
        self._wake.set()

    async def replay(self, message_id: str) -> Message | None:
        """A dead letter, due now (its attempts kept); None when no dead letter has that id."""
        message = await self.outbox.get(message_id)
        if message is None or not message.dead:
            return None
        replayed = replace(message, next_at=self._clock(), expired=False)
        if not await self.outbox.update(replayed):
            return None
        self._wake.set()
        return replayed

    async def discard(self, message_id: str) -> bool:
        """Forget a dead letter; False when no dead letter has that id."""
        message = await self.outbox.get(message_id)
        return message is not None and message.dead and await self.outbox.remove(message)

    async def run(self) -> None:
        """Until cancelled: claim what is due, as many as there are free places, and send each in a task of its own."""
        lease_s = self._settings.timeout_s + LEASE_MARGIN_S
        attempts: set[asyncio.Task[None]] = set()

        def ended(task: asyncio.Task[None]) -> None:
            attempts.discard(task)
            self._wake.set()

        try:
            while True:
                self._wake.clear()
                free = self._settings.concurrency - len(attempts)
                claimed = await self._claim(lease_s, free) if free > 0 else []
                for message in claimed:
                    task = asyncio.create_task(self.attempt(message))
                    attempts.add(task)
                    task.add_done_callback(ended)
                if free == 0 or len(claimed) < free:
                    await self._count()
                    # Woken by a new message, a replay or a free place; else the next poll.
                    try:
                        await asyncio.wait_for(self._wake.wait(), self._settings.poll_interval_s)
                    except TimeoutError:
                        pass
        finally:
            # What is in flight may end and store its outcome (a receiver answers within milliseconds, as a rule)
            # until the shutdown asks again; the rest is cancelled, and sent again when its claim lapses.
            if attempts:
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait(attempts, timeout=FINISH_S)
            for task in list(attempts):
                task.cancel()

    async def _claim(self, lease_s: float, limit: int) -> list[Message]:
        try:
            claimed = await self.outbox.claim(self._clock(), lease_s, limit)
        except (RedisError, OSError) as exc:
            if not self._store_down:
                log.error("webhook outbox unreadable, nothing is sent until it is back: %s", type(exc).__name__)
            self._store_down = True
            return []
        if self._store_down:
            log.warning("webhook outbox readable again")
        self._store_down = False
        return claimed

    async def _count(self) -> None:
        """The gauges, read at most once per poll interval (a busy loop wakes at every attempt's end)."""
        now = time.monotonic()
        if now - self._counted_at < self._settings.poll_interval_s:
            return
        self._counted_at = now
        try:
            pending, dead = await self.outbox.counts()
        except (RedisError, OSError):
            return  # said by _claim
        self._metrics.webhook_pending.set(pending)
        self._metrics.webhook_dead_letters.set(dead)

    async def attempt(self, message: Message) -> None:
        """One attempt at a claimed message, and its outcome stored. When the store (or the target's lookup) fails,
        nothing is stored: the claim lapses and the message is tried again, sent twice if it was delivered (under
        the same webhook-id, which receivers deduplicate on)."""
        try:
            await self._attempt(message, target_kind(message.target))
        except (RedisError, OSError) as exc:
            log.error("webhook notice %s: tried again when its claim lapses: %s", message.id, type(exc).__name__)

    async def _attempt(self, message: Message, kind: str) -> None:
        target = await self._resolve(message.target)
        if target is None:
            await self.outbox.remove(message)
            self._metrics.webhook_deliveries.labels(kind, "dropped").inc()
            log.warning("webhook notice %s (%s) dropped: target %s is gone", message.id, message.type, message.target)
            return
        error = await self._post(message, target)
        if error is not None:
            await self._failed(message, error, kind)
            return
        await self.outbox.remove(message)
        self._metrics.webhook_deliveries.labels(kind, "delivered").inc()

    async def _post(self, message: Message, target: Target) -> str | None:
        """None when the receiver took it (2xx), else why not."""
        timestamp = int(self._clock())
        headers = signed_headers(target.secret, message.id, timestamp, message.body, legacy=target.legacy_signature)
        extensions = {}
        if target.host is not None:
            headers["host"] = target.host
        if target.server_name is not None:
            extensions["sni_hostname"] = target.server_name
        timeout = self._settings.timeout_s
        try:
            # httpx's timeout is per phase: a receiver trickling bytes would hold the attempt (and a slot) for good.
            async with asyncio.timeout(timeout):
                # Streamed and never read: what a receiver answers with is not the gateway's to hold.
                async with self._client.stream(
                    "POST", target.url, content=message.body, headers=headers, timeout=timeout, extensions=extensions
                ) as response:
                    status = response.status_code
        except TimeoutError:
            return "Timeout"
        except httpx.HTTPError as exc:
            return type(exc).__name__
        return None if 200 <= status < 300 else f"HTTP {status}"

    async def _failed(self, message: Message, error: str, kind: str) -> None:
        settings, now = self._settings, self._clock()
        attempts = message.attempts + 1
        wait = settings.retry_schedule_s[min(attempts, len(settings.retry_schedule_s)) - 1]
        expired = now + wait > message.created + settings.max_age_s
        dead = expired or attempts >= settings.dead_after
        failed = replace(message, attempts=attempts, last_error=error, next_at=now + wait, dead=dead, expired=expired)
        if not await self.outbox.update(failed):
            return  # discarded while it was being sent
        self._metrics.webhook_deliveries.labels(kind, "failed").inc()
        if expired:
            self._metrics.webhook_deliveries.labels(kind, "expired").inc()
            log.error(
                "webhook notice %s (%s) to %s expired after %d attempts (last: %s): a dead letter until replayed",
                message.id,
                message.type,
                message.target,
                attempts,
                error,
            )
        elif dead and not message.dead:
            self._metrics.webhook_deliveries.labels(kind, "dead").inc()
            log.error(
                "webhook notice %s (%s) to %s is a dead letter after %d attempts (last: %s); still retried",
                message.id,
                message.type,
                message.target,
                attempts,
                error,
            )
        else:
            log.warning(
                "webhook notice %s to %s: attempt %d failed (%s); next in %g s",
                message.id,
                message.target,
                attempts,
                error,
                wait,
            )
