"""Webhook notices end to end: a real leak on a real gateway, the operators' notice POSTed to a real receiver on
127.0.0.1, kept in the Redis outbox while the receiver is down (a dead letter, shown by the admin API) and delivered
when it is back, by another gateway instance if the first is gone; what a receiver checks (`bulkhead webhooks
verify`), and the admin API's dead letters (`bulkhead webhooks dead-letters | discard`)."""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
import standardwebhooks
from redis.asyncio import Redis

from gateway.cli.commands import main
from gateway.server.app import create_app
from gateway.server.serving import run_server
from gateway.settings import Settings
from gateway.webhooks import Message, RedisOutbox, whsec
from tests.integration.receiver import Notice, Receiver, webhook_receiver
from tests.integration.support import BOB_KEY, auth, canaries_only, gateway_settings, metric
from tests.integration.test_canaries import alice_fills_the_cache, over_capacity
from tests.poisoned import Counted
from tests.redis_server import redis_server

ADMIN = "admin-token-0123456789"
SECRET = "webhook-secret-0123456789"  # the earlier form: its UTF-8 bytes are the key, whsec(SECRET.encode()) its whsec_
ADMIN_AUTH = {"authorization": f"Bearer {ADMIN}"}
DEAD_LETTERS = "/admin/webhooks/dead-letters"


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    with webhook_receiver() as found:
        yield found


@pytest.fixture
def redis_url() -> Iterator[str]:
    with redis_server() as url:
        yield url


def leaky_gateway(redis_url: str, receiver: Receiver, sim: str, tokenizer_dir: Path, **webhooks: Any) -> Settings:
    """A gateway with only the canaries standing over a stale-kv engine, the operators' webhook at `receiver`, and a
    Redis key prefix of its own (its outbox is no other test's)."""
    return gateway_settings(
        {"sim": sim},
        tokenizer_dir,
        models=canaries_only(tokenizer_dir, ["sim"]),
        redis_url=redis_url,
        redis_key_prefix=f"test-webhooks-{uuid.uuid4().hex[:8]}:",
        admin_token=ADMIN,
        # No probe after the leak: one isolation event, one notice.
        isolation={"canary": {"webhook_url": receiver.url, "webhook_secret": SECRET, "quarantine_on_leak": False}},
        webhooks={"retry_schedule_s": [0.2, 0.2, 0.5], "dead_after": 2, "poll_interval_s": 0.05, **webhooks},
    )


async def leak(client: httpx.AsyncClient, gateway_url: str) -> str:
    """Bob's answer carries alice's marker and is withheld: the request id of the isolation event."""
    await alice_fills_the_cache(client, gateway_url, "a")
    response = await client.post(f"{gateway_url}/v1/chat/completions", json=over_capacity(), headers=auth(BOB_KEY))
    assert response.status_code == 502 and response.json()["error"]["code"] == "answer_withheld"
    return response.headers["x-request-id"]


async def dead_letters(client: httpx.AsyncClient, gateway_url: str, count: int, timeout_s: float = 10) -> Any:
    """The dead letters, once there are `count` of them."""
    deadline = time.monotonic() + timeout_s
    while True:
        response = await client.get(f"{gateway_url}{DEAD_LETTERS}", headers=ADMIN_AUTH)
        assert response.status_code == 200, response.text
        found = response.json()["dead_letters"]
        if len(found) == count:
            return found
        assert time.monotonic() < deadline, found
        await asyncio.sleep(0.05)


async def scraped(client: httpx.AsyncClient, gateway_url: str, name: str, value: float, **labels: str) -> None:
    """The gateway's /metrics shows `value` for the series (gauges are read at the loop's pace: waited for)."""
    deadline = time.monotonic() + 5
    while (found := metric((await client.get(f"{gateway_url}/metrics")).text, name, **labels)) != value:
        assert time.monotonic() < deadline, f"{name}{labels} = {found}, not {value}"
        await asyncio.sleep(0.05)


def verify_command(notice: Notice, *args: str, secret: str = whsec(SECRET.encode())) -> list[str]:
    """`bulkhead webhooks verify`'s arguments for the notice as received, its body on stdin."""
    headers = [f"--header={name}: {notice.headers[name]}" for name in ("webhook-id", "webhook-timestamp")]
    headers.append(f"--header=webhook-signature: {notice.headers['webhook-signature']}")
    return ["webhooks", "verify", f"--secret={secret}", "--body=-", *headers, *args]


def verify_here(notice: Notice, *args: str, secret: str = whsec(SECRET.encode())) -> tuple[int, str, str]:
    """The command run in this process (a process of its own takes 2 s to import the gateway): exit code, stdout,
    stderr."""
    stdin, stdout, stderr = sys.stdin, io.StringIO(), io.StringIO()
    sys.stdin = io.TextIOWrapper(io.BytesIO(notice.body))
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            code = main(verify_command(notice, *args, secret=secret))
    finally:
        sys.stdin = stdin
    return code, stdout.getvalue(), stderr.getvalue()


async def test_a_notice_waits_out_a_receiver_that_is_down_even_when_its_gateway_goes(
    client: httpx.AsyncClient, make_sim: Any, tokenizer_dir: Path, redis_url: str, receiver: Receiver, tmp_path: Path
) -> None:
    settings = leaky_gateway(
        redis_url, receiver, make_sim(num_gpu_blocks=16, output_tokens=64, fault="stale-kv"), tokenizer_dir
    )
    receiver.down = True
    with run_server(create_app(settings), settings.edge) as first:
        request_id = await leak(client, first)
        [letter] = await dead_letters(client, first, 1)
        assert (letter["target"], letter["type"], letter["last_error"]) == ("operator", "isolation.event", "HTTP 503")
        assert letter["attempts"] >= 2 and not letter["expired"] and letter["next_attempt_at"].endswith("Z")
        assert letter["body"]["data"]["request_id"] == request_id
        listing = await client.get(f"{first}{DEAD_LETTERS}", headers=ADMIN_AUTH)
        assert SECRET not in listing.text and whsec(SECRET.encode()) not in listing.text
        await scraped(client, first, "bulkhead_webhook_dead_letters", 1)
        await scraped(client, first, "bulkhead_webhook_pending_messages", 1)
        text = (await client.get(f"{first}/metrics")).text
        assert metric(text, "bulkhead_webhook_deliveries_total", target_kind="operator", outcome="dead") == 1
        assert metric(text, "bulkhead_webhook_deliveries_total", target_kind="operator", outcome="failed") >= 2
    tried = len(receiver.received)

    # The gateway that queued it is gone; the notice is in Redis, and another instance delivers it.
    receiver.down = False
    with run_server(create_app(settings), settings.edge) as second:
        [notice] = await receiver.wait_for(1)
        assert await dead_letters(client, second, 0) == []
        await scraped(client, second, "bulkhead_webhook_deliveries_total", 1, outcome="delivered")
        await scraped(client, second, "bulkhead_webhook_dead_letters", 0)
        for bad in ("replay", "discard"):  # delivered: no dead letter any more
            method, path = ("POST", f"{letter['id']}/replay") if bad == "replay" else ("DELETE", letter["id"])
            answer = await client.request(method, f"{second}{DEAD_LETTERS}/{path}", headers=ADMIN_AUTH)
            assert answer.status_code == 404 and answer.json()["error"]["code"] == "not_found"
    body = standardwebhooks.Webhook(whsec(SECRET.encode())).verify(notice.body, notice.headers)
    assert body["type"] == "isolation.event" and body["data"]["request_id"] == request_id
    assert "x-bulkhead-signature" in notice.headers, "the deprecated header, one more release"
    # One message: every attempt under its id, with the same body, each signed at its own time.
    assert len(receiver.received) == tried + 1
    assert {n.headers["webhook-id"] for n in receiver.received} == {letter["id"]}
    assert {n.body for n in receiver.received} == {notice.body}

    # What a receiver enforces: the signature, the id not seen before, the time within the tolerance.
    seen = tmp_path / "seen.json"
    code, out, err = verify_here(notice, f"--seen={seen}")
    assert code == 0 and orjson.loads(out)["data"]["request_id"] == request_id, err
    # As a receiver's script runs it: a process of its own.
    command = [sys.executable, "-m", "gateway", *verify_command(notice, f"--seen={seen}")]
    again = subprocess.run(command, input=notice.body, capture_output=True, timeout=60)
    assert again.returncode == 1 and f"webhook-id {letter['id']} was seen already" in again.stderr.decode()
    assert verify_here(notice, secret=SECRET)[0] == 0, "the configured text is the same key"
    tampered = Notice(notice.headers, notice.body.replace(b"isolation.event", b"isolation.evenT"), 204)
    code, _, err = verify_here(tampered)
    assert code == 1 and "bad signature" in err
    first_try = receiver.received[0]
    await asyncio.sleep(max(0.0, int(first_try.headers["webhook-timestamp"]) + 2.5 - time.time()))
    code, _, err = verify_here(first_try, "--tolerance-s=1")
    assert code == 1 and "outside the tolerance of 1 s" in err
    assert verify_here(first_try)[0] == 0, "within the default 300 s"
    assert verify_here(first_try, secret="whsec_!")[0] == 2, "a secret that is not one: the command cannot run"


async def test_operators_replay_and_discard_dead_letters(
    client: httpx.AsyncClient, make_sim: Any, tokenizer_dir: Path, redis_url: str, receiver: Receiver
) -> None:
    sim = make_sim(num_gpu_blocks=16, output_tokens=64, fault="stale-kv")
    # Dead at the first failure, and not tried again for a minute: only a replay sends it sooner.
    settings = leaky_gateway(redis_url, receiver, sim, tokenizer_dir, dead_after=1, retry_schedule_s=[60])
    receiver.down = True
    with run_server(create_app(settings), settings.edge) as gateway:
        request_id = await leak(client, gateway)
        [letter] = await dead_letters(client, gateway, 1)
        assert letter["attempts"] == 1 and letter["body"]["data"]["request_id"] == request_id
        receiver.down = False
        replayed = await client.post(f"{gateway}{DEAD_LETTERS}/{letter['id']}/replay", headers=ADMIN_AUTH)
        assert replayed.status_code == 200 and replayed.json()["attempts"] == 1, replayed.text
        [notice] = await receiver.wait_for(1, timeout_s=5)
        assert notice.headers["webhook-id"] == letter["id"]
        assert await dead_letters(client, gateway, 0) == []

        # A dead letter another instance left in the shared outbox (a tenant's, expired): listed here, discarded.
        async with Redis.from_url(redis_url) as redis:
            outbox = RedisOutbox(redis, prefix=settings.redis_key_prefix, poison=Counted().poison)
            now = time.time() - 3600
            old = Message(Message.new_id(now), "tenant:gone", "test.old", b'{"data":{}}', now, now, 9, "HTTP 500")
            await outbox.add(old, 10)
            await outbox.update(Message(**{**old.__dict__, "dead": True, "expired": True}))
        [listed] = await dead_letters(client, gateway, 1)
        assert (listed["id"], listed["expired"], listed["next_attempt_at"]) == (old.id, True, None)
        # ... and by an operator's shell, which finds the gateway and its token in the environment.
        shell = {k: v for k, v in os.environ.items() if not k.startswith("BULKHEAD_")}
        shell |= {"BULKHEAD_ADMIN_URL": gateway, "BULKHEAD_ADMIN_TOKEN": ADMIN}
        listing = subprocess.run(
            [sys.executable, "-m", "gateway", "webhooks", "dead-letters"], capture_output=True, text=True, env=shell
        )
        assert listing.returncode == 0, listing.stderr
        [row] = listing.stdout.splitlines()[1:]
        assert row.split()[:6] == [old.id, "tenant:gone", "test.old", listed["created_at"], "9", "expired"], row
        command = [sys.executable, "-m", "gateway", "webhooks", "discard", old.id, "--json"]
        discarded = subprocess.run(command, capture_output=True, text=True, env=shell)
        assert discarded.returncode == 0 and orjson.loads(discarded.stdout) == {"id": old.id, "deleted": True}
        assert await dead_letters(client, gateway, 0) == []

        # Bad input is a 4xx with an OpenAI-style error body.
        for method, path, headers, status in [
            ("GET", f"{DEAD_LETTERS}?limit=0", ADMIN_AUTH, 400),
            ("GET", f"{DEAD_LETTERS}?limit=many", ADMIN_AUTH, 400),
            ("POST", f"{DEAD_LETTERS}/{old.id}/replay", ADMIN_AUTH, 404),
            ("DELETE", f"{DEAD_LETTERS}/{old.id}", ADMIN_AUTH, 404),
            ("POST", f"{DEAD_LETTERS}/msg_%2E%2E%2Fnot-an-id/replay", ADMIN_AUTH, 404),
            ("GET", DEAD_LETTERS, {}, 401),
            ("GET", DEAD_LETTERS, {"authorization": "Bearer a-tenant-key-0123456789"}, 401),
            ("PUT", DEAD_LETTERS, ADMIN_AUTH, 405),
        ]:
            answer = await client.request(method, f"{gateway}{path}", headers=headers)
            assert answer.status_code == status, (method, path, answer.text)
            error = answer.json()["error"]
            assert error["message"] and error["type"], answer.text
