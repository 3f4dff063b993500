"""The webhook outbox and its delivery rules: one suite for the memory and the Redis twin (as tests/unit/test_twins.py,
whose fixtures these are). Receivers are httpx's in-memory transport; the clock is the test's."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import httpx
import pytest
import standardwebhooks
from redis.asyncio import Redis

from gateway.metrics import GatewayMetrics
from gateway.settings import WebhookSettings
from gateway.webhooks import Deliveries, MemoryOutbox, Message, Outbox, RedisOutbox, Target, whsec
from tests.poisoned import Counted
from tests.unit.test_twins import TWINS, forget, prefix, redis_for, redis_url

__all__ = ["prefix", "redis_url"]  # fixtures, used by name

METRICS = GatewayMetrics()  # one registry for the module: prometheus names are global
KEY = b"a key of the receiver's, 32 byte"
SETTINGS = WebhookSettings(retry_schedule_s=[5, 30, 120], dead_after=3, max_age_s=1000, max_pending_per_target=3)
LEASE_S = 40.0


@pytest.fixture(params=TWINS)
async def outbox(request: pytest.FixtureRequest, prefix: str) -> AsyncIterator[Outbox]:
    async with redis_for(request, prefix) as redis:
        yield MemoryOutbox() if redis is None else RedisOutbox(redis, prefix=prefix, poison=Counted().poison)


@dataclass
class Receiver:
    """What the receiver answers (the next status each time, the last one repeated) and what it was sent."""

    statuses: list[int] = field(default_factory=lambda: [204])
    received: list[httpx.Request] = field(default_factory=list)

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.received.append(request)
        status = self.statuses.pop(0) if len(self.statuses) > 1 else self.statuses[0]
        return httpx.Response(status)


@dataclass
class World:
    outbox: Outbox
    deliveries: Deliveries
    receiver: Receiver
    targets: dict[str, Target]
    now: float

    async def due(self, at: float | None = None) -> list[Message]:
        """Claim and attempt everything due at `at` (default: now), as the loop does; returns what was claimed."""
        self.now = self.now if at is None else at
        claimed = await self.outbox.claim(self.now, LEASE_S, 100)
        for message in claimed:
            await self.deliveries.attempt(message)
        return claimed


@pytest.fixture
async def world(outbox: Outbox) -> AsyncIterator[World]:
    receiver = Receiver()
    targets = {"operator": Target("http://receiver/hook", KEY), "tenant:a": Target("http://tenant-a/hook", KEY)}

    async def resolve(name: str) -> Target | None:
        return targets.get(name)

    async with httpx.AsyncClient(transport=httpx.MockTransport(receiver)) as client:
        world = World(outbox, None, receiver, targets, time.time())  # type: ignore[arg-type]  # set just below
        world.deliveries = Deliveries(outbox, resolve, client, SETTINGS, METRICS, clock=lambda: world.now)
        yield world


def count(kind: str, outcome: str) -> float:
    labels = {"target_kind": kind, "outcome": outcome}
    return METRICS.registry.get_sample_value("bulkhead_webhook_deliveries_total", labels) or 0.0


async def test_messages_are_claimed_in_the_order_they_were_sent(world: World) -> None:
    sent = []
    for n in range(3):
        world.now += 0.001
        sent.append(await world.deliveries.send("operator", "test.order", {"n": n}))
    first = await world.outbox.claim(world.now, LEASE_S, 2)
    rest = await world.outbox.claim(world.now, LEASE_S, 2)
    assert [m.id for m in first + rest] == sent
    assert await world.outbox.claim(world.now, LEASE_S, 2) == []


async def test_a_claim_holds_a_message_for_its_lease_then_any_instance_reclaims_it(world: World) -> None:
    sent = await world.deliveries.send("operator", "test.lease", {})
    claims = await asyncio.gather(*(world.outbox.claim(world.now, LEASE_S, 10) for _ in range(4)))
    assert [m.id for claimed in claims for m in claimed] == [sent], "claimed once, however many claim at once"
    # The claimer died mid-send: nothing was stored, and the message is due again when its lease ends.
    assert await world.outbox.claim(world.now + LEASE_S - 1, LEASE_S, 10) == []
    [again] = await world.outbox.claim(world.now + LEASE_S, LEASE_S, 10)
    assert (again.id, again.attempts) == (sent, 0)
    assert await world.outbox.counts() == (1, 0)


async def test_a_delivered_notice_is_signed_by_the_standard_and_removed(world: World) -> None:
    sent = await world.deliveries.send("operator", "test.delivered", {"x": 1})
    before = count("operator", "delivered")
    await world.due()
    [request] = world.receiver.received
    headers = dict(request.headers)
    body = standardwebhooks.Webhook(whsec(KEY)).verify(request.content, headers)
    assert body["type"] == "test.delivered" and body["data"] == {"x": 1} and body["timestamp"].endswith("Z")
    assert headers["webhook-id"] == sent and headers["webhook-timestamp"] == str(int(world.now))
    assert "x-bulkhead-signature" not in headers, "the deprecated header is the operators' legacy target's only"
    assert await world.outbox.get(sent) is None and await world.outbox.counts() == (0, 0)
    assert count("operator", "delivered") == before + 1


async def test_failures_follow_the_retry_schedule_under_the_same_id_and_body(world: World) -> None:
    world.receiver.statuses = [500]
    sent = await world.deliveries.send("operator", "test.retry", {})
    start = world.now
    waits = []
    for _ in range(5):
        [claimed] = await world.due()
        stored = await world.outbox.get(sent)
        assert stored is not None and stored.attempts == claimed.attempts + 1 and stored.last_error == "HTTP 500"
        waits.append(stored.next_at - world.now)
        assert await world.due(world.now + waits[-1] - 0.5) == [], "not due before its time"
        world.now = stored.next_at
    assert waits == [5, 30, 120, 120, 120], "the schedule, then its last wait repeated"
    requests = world.receiver.received
    assert {r.headers["webhook-id"] for r in requests} == {sent}
    assert {r.content for r in requests} == {requests[0].content}
    # Each attempt is signed at its own time.
    stamps = [int(r.headers["webhook-timestamp"]) for r in requests]
    assert stamps == [int(start + t) for t in (0, 5, 35, 155, 275)]


async def test_a_message_is_a_dead_letter_after_dead_after_failures_and_still_retried(world: World) -> None:
    world.receiver.statuses = [503, 503, 503, 204]
    sent = await world.deliveries.send("tenant:a", "test.dead", {})
    dead_before = count("tenant", "dead")
    for attempt in range(3):
        assert await world.outbox.dead_letters(10) == [], f"not dead after {attempt} failures"
        [_] = await world.due()
        world.now += 200
    [dead] = await world.outbox.dead_letters(10)
    assert (dead.id, dead.attempts, dead.dead, dead.expired) == (sent, 3, True, False)
    assert count("tenant", "dead") == dead_before + 1
    assert await world.outbox.counts() == (1, 1), "still to be tried, and listed"
    await world.due()  # the receiver is back
    assert await world.outbox.dead_letters(10) == [] and await world.outbox.counts() == (0, 0)


async def test_a_message_past_max_age_expires_and_stays_listed_until_replayed(world: World) -> None:
    world.receiver.statuses = [500]
    sent = await world.deliveries.send("operator", "test.expiry", {})
    created = world.now
    expired_before = count("operator", "expired")
    while (stored := await world.outbox.get(sent)) is not None and not stored.expired:
        [_] = await world.due(max(world.now, stored.next_at))
    assert stored is not None and stored.dead
    # Its 11th attempt, at 5 + 30 + 120 × 8 = 995 s, failed; the next would fall past 1000 s of its making.
    assert stored.attempts == 11 and world.now - created == pytest.approx(995)
    assert count("operator", "expired") == expired_before + 1
    assert await world.due(world.now + 10 * SETTINGS.max_age_s) == [], "never due again"
    assert [m.id for m in await world.outbox.dead_letters(10)] == [sent]
    assert await world.outbox.counts() == (0, 1)

    world.receiver.statuses = [204]
    replayed = await world.deliveries.replay(sent)
    assert replayed is not None and replayed.attempts == 11 and not replayed.expired
    [claimed] = await world.due()
    assert claimed.attempts == 11, "attempts kept"
    assert await world.outbox.get(sent) is None and await world.outbox.dead_letters(10) == []


async def test_only_a_dead_letter_can_be_replayed_or_discarded(world: World) -> None:
    world.receiver.statuses = [500]
    live = await world.deliveries.send("operator", "test.live", {})
    assert await world.deliveries.replay(live) is None and not await world.deliveries.discard(live)
    assert await world.deliveries.replay("msg_unknown") is None and not await world.deliveries.discard("msg_unknown")
    for _ in range(3):
        await world.due(world.now + 200)
    assert await world.deliveries.discard(live)
    assert await world.outbox.get(live) is None and await world.outbox.dead_letters(10) == []
    assert await world.due(world.now + 200) == [] and await world.outbox.counts() == (0, 0)
    assert not await world.deliveries.discard(live), "gone already"


async def test_a_message_discarded_while_it_is_sent_is_not_brought_back(world: World) -> None:
    world.receiver.statuses = [500]
    sent = await world.deliveries.send("operator", "test.discard", {})
    for _ in range(3):
        await world.due(world.now + 200)
    assert await world.deliveries.replay(sent) is not None
    [claimed] = await world.outbox.claim(world.now, LEASE_S, 10)
    assert await world.deliveries.discard(sent)
    await world.deliveries.attempt(claimed)  # fails, and finds it gone
    assert await world.outbox.get(sent) is None and await world.outbox.counts() == (0, 0)


async def test_a_target_holds_at_most_max_pending_its_oldest_dropped(world: World) -> None:
    world.receiver.statuses = [500]
    other = await world.deliveries.send("operator", "test.other", {})
    dropped_before = count("tenant", "dropped")
    sent = []
    for n in range(5):
        world.now += 0.001
        sent.append(await world.deliveries.send("tenant:a", "test.bound", {"n": n}))
    assert count("tenant", "dropped") == dropped_before + 2
    assert [await world.outbox.get(i) for i in sent[:2]] == [None, None]
    claimed = await world.outbox.claim(world.now, LEASE_S, 10)
    assert [m.id for m in claimed] == [other, *sent[2:]], "another target's message is not its to drop"


async def test_what_a_target_holds_is_listed_with_its_state_until_delivered(world: World) -> None:
    world.receiver.statuses = [500, 204]
    first = await world.deliveries.send("tenant:a", "test.held", {"n": 1})
    world.now += 0.001
    second = await world.deliveries.send("tenant:a", "test.held", {"n": 2})
    world.now += 0.001
    await world.deliveries.send("operator", "test.other", {})
    assert [m.id for m in await world.outbox.held_for("tenant:a", 10)] == [first, second]
    assert [m.id for m in await world.outbox.held_for("tenant:a", 1)] == [first]
    await world.due()  # the first attempt fails, the second is delivered
    [held] = await world.outbox.held_for("tenant:a", 10)
    assert (held.attempts, held.last_error) == (1, "HTTP 500")
    assert await world.outbox.held_for("tenant:b", 10) == []


async def test_a_message_whose_target_is_gone_is_dropped(world: World) -> None:
    sent = await world.deliveries.send("tenant:a", "test.gone", {})
    del world.targets["tenant:a"]
    before = count("tenant", "dropped")
    await world.due()
    assert world.receiver.received == [] and await world.outbox.get(sent) is None
    assert count("tenant", "dropped") == before + 1


async def test_a_target_is_a_name_never_a_url(world: World) -> None:
    for bad in ("https://example.com/hook", "tenant:", "operators"):
        with pytest.raises(ValueError):
            await world.deliveries.send(bad, "test.bad", {})
    assert await world.outbox.counts() == (0, 0)


async def test_what_is_stored_as_a_message_and_is_none_is_dropped_and_the_messages_read_with_it_are_not(
    redis_url: str, prefix: str
) -> None:
    # The Redis twin alone: the memory twin holds only the messages it was given.
    counted, now = Counted(), time.time()
    names = ("messages", "due", "dead", "target:operator")
    messages, due, dead, target = (f"{prefix}webhooks:{name}" for name in names)
    good = [Message(f"msg_good_{n}", "operator", "test", b"{}", now, now + n) for n in (0, 2)]
    poison = {"msg_bad_json": b"notjson", "msg_bad_shape": b'{"id": "msg_bad_shape"}', "msg_bad_utf8": b"\xff"}
    async with Redis.from_url(redis_url) as redis:
        try:
            outbox = RedisOutbox(redis, prefix=prefix, poison=counted.poison)
            for message in good:
                await outbox.add(message, 10)
            # Due between the good ones: one claim takes all five.
            await redis.hset(messages, mapping=poison)
            await redis.zadd(due, dict.fromkeys(poison, now + 1))
            claimed = await outbox.claim(now + 5, LEASE_S, 10)
            assert [m.id for m in claimed] == [m.id for m in good]
            assert counted.dropped("webhook_outbox") == 3
            assert await redis.hlen(messages) == 2 and await redis.zcard(due) == 2
            # A dead letter that is none, when operators list them; one past its target's bound, when it is dropped.
            await redis.hset(messages, mapping={"msg_dead": b"[]", "msg_oldest": b"[]"})
            await redis.zadd(dead, {"msg_dead": now})
            await redis.zadd(target, {"msg_oldest": now - 10})
            assert await outbox.dead_letters(10) == []
            newest = Message("msg_newest", "operator", "test", b"{}", now + 3, now + 3)
            assert await outbox.add(newest, 3) == []
            assert counted.dropped("webhook_outbox") == 5
            assert sorted(map(bytes, await redis.hkeys(messages))) == [b"msg_good_0", b"msg_good_2", b"msg_newest"]
        finally:
            await forget(redis, prefix)
