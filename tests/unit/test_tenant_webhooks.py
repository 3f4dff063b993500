"""Tenants' webhooks (gateway/tenancy/webhooks.py): the URLs the gateway refuses to POST to, the address a delivery
is pinned to, the secrets (derived, never stored; new after a rotation or a delete), the signing key kept in Redis;
and a pinned target delivered with its name as Host and TLS server name."""

from __future__ import annotations

import asyncio
import time
from contextlib import closing

import httpx
import pytest
from redis.asyncio import Redis
from redis.exceptions import RedisError

from gateway.metrics import GatewayMetrics
from gateway.settings import NoticeSettings, WebhookSettings
from gateway.tenancy.lookups import PER_TENANT, NameLookups
from gateway.tenancy.webhooks import MemoryRegistrationStore, Registration, SigningKey, TenantWebhooks, UnsafeUrl
from gateway.webhooks import Deliveries, MemoryOutbox, Target
from tests.unit.test_lookups import StallingResolver, resolver
from tests.unit.test_twins import redis_url

__all__ = ["redis_url", "resolver"]  # fixtures, used by name

KEY = SigningKey(b"the gateway's notice signing key")
LOOKUPS = NameLookups()  # its threads are made when first used, and end with the process


def webhooks(**settings: bool) -> TenantWebhooks:
    return TenantWebhooks(MemoryRegistrationStore(), KEY, NoticeSettings(**settings), LOOKUPS)


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("http://93.184.216.34/hook", "https"),
        ("https://127.0.0.1/hook", "public"),
        ("https://[64:ff9b::a9fe:a9fe]/latest", "public"),
        ("https://localhost/hook", "public"),
        ("https://no-such-name.invalid/hook", "public"),  # the same words: no oracle for internal names
        ("https://straße.example/hook", "ASCII"),
        ("https://user@93.184.216.34/hook", "user"),
        ("https://93.184.216.34:0x50/hook", "port"),
        ("https://[zz::1]/hook", "does not parse"),
        ("https://[::1/hook", "does not parse"),
        # Written as an address: refused with what it is.
        ("https://[::ffff:0:7f00:1]/hook", r"::ffff:0:7f00:1 is IPv4-translated \(SIIT\)"),
        ("https://[::ffff:0:127.0.0.1]/hook", "SIIT"),
        ("https://[fec0::1]/hook", "site-local"),
        ("https://[::FFFF:7F00:1]/hook", "IPv4-mapped 127.0.0.1, which is loopback"),
        ("https://[0:0:0:0:0:ffff:a9fe:a9fe]/latest", "IPv4-mapped 169.254.169.254, which is link-local"),
        ("https://[::127.0.0.1]/hook", "IPv4-compatible"),
        ("https://[64:ff9b::10.0.0.1]/hook", "NAT64 10.0.0.1, which is private-use"),
        ("https://[2002:c0a8:101::1]/hook", "6to4"),
        ("https://[2001:0:4136:e378:8000:63bf:3fff:fdd2]/hook", "Teredo"),
        ("https://[fd00::1]/hook", "unique-local"),
        ("https://[fe80::1%25eth0]/hook", "zone id"),
        ("https://[fe80::1%eth0]/hook", "zone id"),
        ("https://[ff02::1]/hook", "multicast"),
        ("https://100.64.0.1/hook", "carrier-grade NAT"),
        ("https://192.0.0.9/hook", "IETF protocol assignments"),
        # The forms getaddrinfo reads as IPv4 (inet_aton's): judged by the address they resolve to.
        ("https://2130706433/hook", "public"),
        ("https://0x7f000001/hook", "public"),
        ("https://017700000001/hook", "public"),
        ("https://0177.0.0.1/hook", "public"),
        ("https://0x7f.0.0.1/hook", "public"),
        ("https://127.000.000.001/hook", "public"),
        ("https://127.1/hook", "public"),
        ("https://0x7f.1/hook", "public"),
        ("https://0/hook", "public"),
        ("https://2852039166/latest", "public"),  # 169.254.169.254
        ("https://0xa9.0xfe.0xa9.0xfe/latest", "public"),
        ("https://3232235777/hook", "public"),  # 192.168.1.1
    ],
)
async def test_urls_the_gateway_will_not_post_to(url: str, why: str) -> None:
    with pytest.raises(UnsafeUrl, match=why):
        await webhooks().check_url("acme", url)


@pytest.mark.parametrize(
    ("url", "addresses"),
    [
        ("https://[64:ff9b::5db8:d822]/hook", ["64:ff9b::5db8:d822"]),  # NAT64 of a public address: DNS64's answer
        ("https://[::ffff:93.184.216.34]/hook", ["::ffff:93.184.216.34"]),
        ("https://1572395042/hook", ["93.184.216.34"]),
        ("https://[2606:4700:4700::1111]/hook", ["2606:4700:4700::1111"]),
    ],
)
async def test_public_addresses_in_any_form_are_accepted(url: str, addresses: list[str]) -> None:
    assert await webhooks().check_url("acme", url) == addresses


async def test_a_public_address_is_pinned_with_its_name_as_host_and_server_name() -> None:
    registry = webhooks()
    await registry.register("acme", "https://93.184.216.34:8443/hook?x=1", rotate=False)
    target = await registry.resolve("tenant:acme")
    assert target is not None
    assert (target.url, target.host, target.server_name) == (
        "https://93.184.216.34:8443/hook?x=1",
        "93.184.216.34:8443",
        "93.184.216.34",
    )
    assert await registry.resolve("tenant:nobody") is None


async def test_a_delivery_checks_its_url_again_by_the_same_rule() -> None:
    store = MemoryRegistrationStore()
    registry = TenantWebhooks(store, KEY, NoticeSettings(), LOOKUPS)
    now = time.time()
    # As if registered while allowed, or under an older rule: the address is judged again at each attempt.
    await store.put("acme", Registration("https://[::ffff:0:7f00:1]/hook", 1, now, now))
    await store.put("beta", Registration("https://[fec0::1]/hook", 1, now, now))
    assert await registry.resolve("tenant:acme") is None
    assert await registry.resolve("tenant:beta") is None


async def test_secrets_change_with_a_rotation_and_with_a_delete_and_never_show_again() -> None:
    registry = webhooks(allow_http=True, allow_private_urls=True)
    _, first = await registry.register("acme", "http://127.0.0.1:9/a", rotate=False)
    _, moved = await registry.register("acme", "http://127.0.0.1:9/b", rotate=False)
    _, rotated = await registry.register("acme", "http://127.0.0.1:9/b", rotate=True)
    assert first is not None and moved is None and rotated is not None and rotated != first
    assert await registry.delete("acme")
    time.sleep(0.001)  # a new registration is a new making
    _, again = await registry.register("acme", "http://127.0.0.1:9/b", rotate=False)
    assert again is not None and again not in (first, rotated)
    _, other = await registry.register("beta", "http://127.0.0.1:9/b", rotate=False)
    assert other not in (first, rotated, again)


async def test_the_signing_key_kept_in_redis_is_shared_and_never_invented_while_redis_is_down(redis_url: str) -> None:
    async with Redis.from_url(redis_url) as redis:
        name = f"test-notice-key-{time.time_ns()}"
        one, two = SigningKey(None, redis, name), SigningKey(None, redis, name)
        assert await one.get() == await two.get()
        await redis.delete(name)
    async with Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.5) as down:
        registry = TenantWebhooks(MemoryRegistrationStore(), SigningKey(None, down, "k"), NoticeSettings(), LOOKUPS)
        with pytest.raises((RedisError, OSError)):
            await registry.register("acme", "https://93.184.216.34/hook", rotate=False)
        assert await registry.registration("acme") is None, "no key, no registration"


async def test_a_pinned_target_is_delivered_to_its_address_with_its_name() -> None:
    seen: list[httpx.Request] = []

    def receiver(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(204)

    target = Target(
        "https://93.184.216.34/hook", b"k" * 32, host="hooks.acme.example", server_name="hooks.acme.example"
    )

    async def resolve(name: str) -> Target | None:
        return target

    async with httpx.AsyncClient(transport=httpx.MockTransport(receiver)) as client:
        deliveries = Deliveries(MemoryOutbox(), resolve, client, WebhookSettings(), GatewayMetrics())
        await deliveries.send("tenant:acme", "test.pinned", {})
        [message] = await deliveries.outbox.claim(time.time(), 60, 10)
        await deliveries.attempt(message)
    [request] = seen
    assert request.url.host == "93.184.216.34"
    assert request.headers["host"] == "hooks.acme.example"
    assert request.extensions["sni_hostname"] == "hooks.acme.example"


async def test_a_delivery_looks_its_host_up_among_its_tenants_lookups_and_waits_while_they_are_held(
    resolver: StallingResolver,
) -> None:
    with closing(NameLookups(resolver)) as lookups:
        store = MemoryRegistrationStore()
        registry = TenantWebhooks(store, KEY, NoticeSettings(), lookups)
        await registry.register("acme", "https://hooks.bob.test/hook", rotate=False)
        stuck = [asyncio.create_task(registry.check_url("acme", "https://a.stall.test/")) for _ in range(PER_TENANT)]
        await resolver.stalling(PER_TENANT)
        async with httpx.AsyncClient(transport=httpx.MockTransport(lambda _: httpx.Response(204))) as client:
            deliveries = Deliveries(MemoryOutbox(), registry.resolve, client, WebhookSettings(), GatewayMetrics())
            sent = await deliveries.send("tenant:acme", "test.held", {})
            [message] = await deliveries.outbox.claim(time.time(), 60, 10)
            await deliveries.attempt(message)
            assert await deliveries.outbox.get(sent) is not None, "kept, to be tried again: its target is not gone"
            resolver.release.set()
            await asyncio.gather(*stuck, return_exceptions=True)
            target = await registry.resolve("tenant:acme")
        assert target is not None and target.url == "https://93.184.216.34/hook"
        assert (target.host, target.server_name) == ("hooks.bob.test", "hooks.bob.test")
