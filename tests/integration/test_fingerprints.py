"""Leaks without a marker, over real HTTP: a stale-KV engine answering one tenant from another's long document is
caught by prompt fingerprints alone (canaries off), across two gateway instances sharing one Redis, and text that
several tenants send is never evidence."""

from __future__ import annotations

import asyncio
import random
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest

from gateway.server.app import create_app
from gateway.server.serving import run_server
from gateway.settings import SettingsError
from isolation.tokens import ModelTokenizer
from isolation.winnowing import words
from tests.integration.adversary import Adversary, Plan
from tests.integration.support import (
    ALICE_KEY,
    BOB_KEY,
    MODEL,
    auth,
    canaries_only,
    chat_body,
    forwarded,
    gateway_settings,
    metric,
)
from tests.integration.tenant_support import until
from tests.redis_server import redis_server

CHAT = "/v1/chat/completions"
ADMIN = "admin-token-0123456789"
# The key every instance hashes with derives from the canary secret: instances that share prompts share it.
SECRET = [{"id": "k1", "secret": "fingerprint-test-secret-0123456789"}]
FINGERPRINTS_ONLY = {"canary": {"enabled": False, "quarantine_on_leak": False, "keys": SECRET}}
VOCABULARY = (
    "ledger orchid quokka harbour meadow copper lantern violet summit tunnel anchor beacon cobalt delta ember "
    "falcon granite hazel ivory jasper kettle lagoon marble nectar onyx pepper quartz raven saffron tundra umber "
    "velvet willow yarrow zephyr amber birch cedar dune fjord glacier heron iris juniper kelp lotus maple"
).split()


def document(seed: int, words: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(VOCABULARY) for _ in range(words))


async def events(client: httpx.AsyncClient, gateway_url: str) -> list[dict[str, str]]:
    answer = await client.get(f"{gateway_url}/admin/isolation-events", headers={"authorization": f"Bearer {ADMIN}"})
    found: list[dict[str, str]] = answer.json()["events"]
    return found


def stale_kv_gateway(make_gateway: Any, make_sim: Any, tokenizer_dir: Path, **overrides: Any) -> tuple[str, str]:
    sim = make_sim(num_gpu_blocks=64, output_tokens=160, fault="stale-kv")
    gateway_url = make_gateway(
        {"sim": sim}, models=canaries_only(tokenizer_dir, ["sim"]), admin_token=ADMIN,
        **{"isolation": FINGERPRINTS_ONLY, **overrides},
    )  # fmt: skip
    return sim, gateway_url


@contextmanager
def adversary_gateway(tokenizer_dir: Path, isolation: dict[str, Any]) -> Iterator[tuple[Adversary, str]]:
    """An adversarial backend and a gateway in front of it with these isolation settings."""
    adversary = Adversary(ModelTokenizer.from_dir(tokenizer_dir))
    with run_server(adversary.app()) as backend:
        settings = gateway_settings({"adversary": backend}, tokenizer_dir, admin_token=ADMIN, isolation=isolation)
        with run_server(create_app(settings)) as gateway_url:
            yield adversary, gateway_url


async def bob_sends_his_document(client: httpx.AsyncClient, gateway_url: str, text: str) -> None:
    body = chat_body(f"Please review this document:\n{text}", max_tokens=4)
    response = await client.post(f"{gateway_url}{CHAT}", json=body, headers=auth(BOB_KEY))
    assert response.status_code == 200, response.text


# Over the engine's 1,024-token KV cache, inside its 2,048-token window: answered from stale pages.
OVER_CAPACITY = chat_body("Summarise this contract clause by clause. " * 75, max_tokens=160)


def assert_withheld_for_bob(
    response: httpx.Response, text: str, found: list[dict[str, str]], replica: str = "sim"
) -> None:
    assert response.status_code == 502 and response.json()["error"]["code"] == "answer_withheld", response.text
    assert not any(word in response.text for word in text.split()[:50])
    # The events of this request (a shared Redis can hold other tests' too).
    [leak] = [e for e in found if e["request_id"] == response.headers["x-request-id"]]
    assert (leak["kind"], leak["tenant"], leak["victim_tenant"], leak["replica"]) == (
        "fingerprint_leak", "alice", "bob", replica,
    )  # fmt: skip


async def test_a_stale_page_of_a_long_document_is_caught_by_fingerprints_alone(
    client: httpx.AsyncClient, make_gateway: Any, make_sim: Any, tokenizer_dir: Path
) -> None:
    sim, gateway_url = stale_kv_gateway(make_gateway, make_sim, tokenizer_dir)
    text = document(1, 250)
    await bob_sends_his_document(client, gateway_url, text)
    response = await client.post(f"{gateway_url}{CHAT}", json=OVER_CAPACITY, headers=auth(ALICE_KEY))
    stale = metric((await client.get(f"{sim}/metrics")).text, "sim:stale_kv_replies_total")
    assert stale == 1, "the engine really answered from stale pages"
    assert_withheld_for_bob(response, text, await events(client, gateway_url))
    assert not [e for e in await events(client, gateway_url) if e["kind"] == "leak"], "no marker was there to see"


@pytest.mark.parametrize("coverage", ["time", "kv_cache"])
async def test_two_gateway_instances_on_one_redis_share_what_they_fingerprint(
    client: httpx.AsyncClient, make_gateway: Any, make_sim: Any, tokenizer_dir: Path, coverage: str
) -> None:
    isolation = {**FINGERPRINTS_ONLY, "fingerprints": {"coverage": coverage}}
    with redis_server() as redis_url:
        prefix = f"t-{uuid.uuid4().hex[:8]}:"  # a stream of this test's own: the other run's are on the same Redis
        sim, first = stale_kv_gateway(
            make_gateway, make_sim, tokenizer_dir, redis_url=redis_url, redis_key_prefix=prefix, isolation=isolation
        )
        second = make_gateway(
            {"sim": sim}, models=canaries_only(tokenizer_dir, ["sim"]), admin_token=ADMIN,
            isolation=isolation, redis_url=redis_url, redis_key_prefix=prefix,
        )  # fmt: skip
        text = document(3, 250)
        await bob_sends_his_document(client, first, text)
        deadline = time.monotonic() + 5
        while metric((await client.get(f"{second}/metrics")).text, "bulkhead_prompt_fingerprints") == 0:
            assert time.monotonic() < deadline, "the second instance never received bob's fingerprints"
            await asyncio.sleep(0.05)
        response = await client.post(f"{second}{CHAT}", json=OVER_CAPACITY, headers=auth(ALICE_KEY))
        assert_withheld_for_bob(response, text, await events(client, second))


@pytest.mark.parametrize(
    ("listed", "senders", "prompt"),
    [
        (False, (BOB_KEY, ALICE_KEY), "What does this licence allow?\n{}"),
        # Only alice sends it, alone: words of her own around it (a question before it) would be hers.
        (True, (ALICE_KEY,), "{}"),
    ],
    ids=["sent by several tenants", "listed in public_texts, sent by one"],
)
async def test_public_text_is_no_evidence(
    client: httpx.AsyncClient, tokenizer_dir: Path, tmp_path: Path, listed: bool, senders: tuple[str, ...], prompt: str
) -> None:
    adversary = Adversary(ModelTokenizer.from_dir(tokenizer_dir))
    licence, private = document(5, 120), document(6, 120)
    isolation: dict[str, Any] = FINGERPRINTS_ONLY
    if listed:
        (tmp_path / "public").mkdir()
        (tmp_path / "public" / "LICENSE").write_text(licence)
        isolation = {**FINGERPRINTS_ONLY, "fingerprints": {"public_texts": [str(tmp_path / "public")]}}

    async def ask(key: str, content: str) -> httpx.Response:
        return await client.post(f"{gateway_url}{CHAT}", json=chat_body(content, max_tokens=4), headers=auth(key))

    with run_server(adversary.app()) as backend:
        settings = gateway_settings({"adversary": backend}, tokenizer_dir, admin_token=ADMIN, isolation=isolation)
        with run_server(create_app(settings)) as gateway_url:
            for key in senders:
                assert (await ask(key, prompt.format(licence))).status_code == 200
            adversary.plan = Plan("content")  # bob is answered with alice's prompt: the licence
            answer = await ask(BOB_KEY, "And this?")
            assert answer.status_code == 200 and licence.split()[40] in answer.text
            assert await events(client, gateway_url) == []
            # The control: alice's own notes are no public text.
            assert (await ask(ALICE_KEY, f"My notes: {private}")).status_code == 200
            adversary.plan = Plan("content")
            assert (await ask(BOB_KEY, "And this?")).status_code == 502
            assert [e["kind"] for e in await events(client, gateway_url)] == ["fingerprint_leak"]


async def test_an_unreadable_public_text_stops_the_start(tokenizer_dir: Path, sim_url: str, tmp_path: Path) -> None:
    isolation = {"fingerprints": {"public_texts": [str(tmp_path / "missing")]}}
    # Checked with the other files the settings name, before anything is served (and before the lifespan).
    with pytest.raises(SettingsError, match=r"public_texts\[0\]: .*missing does not exist"):
        create_app(gateway_settings({"sim": sim_url}, tokenizer_dir, isolation=isolation))


@pytest.mark.parametrize("instances", [1, 2], ids=["one instance", "two instances on one Redis, no canary keys"])
async def test_a_prompt_still_being_answered_is_known_before_it_is_forwarded(
    client: httpx.AsyncClient, tokenizer_dir: Path, instances: int
) -> None:
    """Bob's document is still being generated (a slow, whole answer: its headers come at the end) when alice's
    answer carries it, at once and, with two instances, through the other one: fingerprinting it only once its
    answer began left it unknown for the whole generation."""
    adversary = Adversary(ModelTokenizer.from_dir(tokenizer_dir))
    text = document(11, 250)
    # Without canary keys each instance's secret is its own: the fingerprint key is shared through Redis.
    isolation = {"canary": {"enabled": False, "quarantine_on_leak": False}}
    with ExitStack() as stack:
        backend = stack.enter_context(run_server(adversary.app()))
        redis: dict[str, str] = {}
        if instances == 2:  # with a prefix of its own: a Redis it did not start holds other runs' bounds and blocks
            redis = {"redis_url": stack.enter_context(redis_server()), "redis_key_prefix": f"t-{uuid.uuid4().hex[:8]}:"}
        urls = [
            stack.enter_context(
                run_server(
                    create_app(
                        gateway_settings(
                            {"adversary": backend}, tokenizer_dir, admin_token=ADMIN, isolation=isolation, **redis
                        )
                    )
                )
            )
            for _ in range(instances)
        ]
        adversary.plan = Plan("content", source="benign", delay_s=2.0)
        bobs = asyncio.create_task(bob_sends_his_document(client, urls[0], text))

        async def forwarded() -> bool:
            return len(adversary.prompts) == 1

        await until(forwarded)
        adversary.plan = Plan("content")  # alice is answered with bob's prompt while his answer is generated
        response = await client.post(f"{urls[-1]}{CHAT}", json=chat_body("And this?"), headers=auth(ALICE_KEY))
        assert_withheld_for_bob(response, text, await events(client, urls[-1]), replica="adversary")
        await bobs


async def test_a_prompt_of_token_ids_without_the_models_tokenizer_is_refused(
    client: httpx.AsyncClient, make_gateway: Any, sim_url: str
) -> None:
    """Token ids are text to the engine, and without the tokenizer the gateway cannot fingerprint them."""
    models = [{"name": MODEL, "backends": ["sim"], "context_window": 2048}]  # counted by the backend's /tokenize
    gateway_url = make_gateway({"sim": sim_url}, models=models)
    before = len(forwarded(sim_url))
    body = {"model": MODEL, "prompt": [5, 6, 7, 8], "max_tokens": 2}
    response = await client.post(f"{gateway_url}/v1/completions", json=body, headers=auth(ALICE_KEY))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "prompt" and "models[].tokenizer" in error["message"]
    assert len(forwarded(sim_url)) == before, "never forwarded"
    text = {**body, "prompt": "Once upon a time"}  # the same as text passes
    assert (await client.post(f"{gateway_url}/v1/completions", json=text, headers=auth(ALICE_KEY))).status_code == 200


async def test_one_tenants_flood_of_prompts_never_evicts_another_tenants_fingerprints(
    client: httpx.AsyncClient, tokenizer_dir: Path
) -> None:
    text = document(12, 250)
    isolation = {**FINGERPRINTS_ONLY, "fingerprints": {"max_entries": 1000}}
    with adversary_gateway(tokenizer_dir, isolation) as (adversary, gateway_url):
        await bob_sends_his_document(client, gateway_url, text)
        for seed in range(40):  # ~45 fingerprints each: twice what the index may hold
            body = chat_body(document(100 + seed, 250), max_tokens=4)
            response = await client.post(f"{gateway_url}{CHAT}", json=body, headers=auth(ALICE_KEY))
            assert response.status_code == 200
        adversary.plan = Plan("content", source="first")  # alice is answered with bob's prompt
        response = await client.post(f"{gateway_url}{CHAT}", json=chat_body("And this?"), headers=auth(ALICE_KEY))
        assert_withheld_for_bob(response, text, await events(client, gateway_url), replica="adversary")


def streamed_text(response: httpx.Response) -> str:
    pieces = []
    for line in response.text.split("\n"):
        if line.startswith("data: {"):
            for choice in orjson.loads(line.removeprefix("data: ")).get("choices") or ():
                pieces.append((choice.get("delta") or {}).get("content") or "")
    return "".join(pieces)


@pytest.mark.parametrize(("hold", "most"), [("first_hit", 20), ("tail", 0)])
@pytest.mark.parametrize("piece", [1, 6, 40])
async def test_a_stream_releases_at_most_twenty_words_of_a_fragment(
    client: httpx.AsyncClient, tokenizer_dir: Path, piece: int, hold: str, most: int
) -> None:
    """From the first gram of another tenant's prompt on, nothing more of the text leaves until it is decided: at
    most the words before that gram's second window can have gone (k + w - 2 = 20 with the defaults); none when
    every stream holds its last min_fragment - 1 words (stream_hold: tail)."""
    text = document(13, 250)
    isolation = {**FINGERPRINTS_ONLY, "fingerprints": {"stream_hold": hold}}
    with adversary_gateway(tokenizer_dir, isolation) as (adversary, gateway_url):
        await bob_sends_his_document(client, gateway_url, text)
        adversary.plan = Plan("content", piece=piece)  # alice is streamed bob's prompt, `piece` characters a chunk
        body = chat_body("And this?", stream=True)
        response = await client.post(f"{gateway_url}{CHAT}", json=body, headers=auth(ALICE_KEY))
        assert response.status_code == 200 and '"answer_withheld"' in response.text, response.text[-300:]
        seen = words(streamed_text(response))
        leaked = words(f"Please review this document:\n{text}")
        # Whole words, and perhaps the start of the next: a word is known only once it ends.
        whole = seen if not seen or seen[-1] == leaked[len(seen) - 1] else seen[:-1]
        assert whole == leaked[: len(whole)] and len(whole) <= most, (len(seen), seen)
        [leak] = [e for e in await events(client, gateway_url) if e["kind"] == "fingerprint_leak"]
        assert leak["victim_tenant"] == "bob"


@pytest.mark.parametrize("hold", ["first_hit", "tail"])
async def test_a_stream_quoting_one_gram_of_another_tenants_prompt_comes_out_whole(
    client: httpx.AsyncClient, tokenizer_dir: Path, hold: str
) -> None:
    """A hit that no second hit follows is no leak: the text held for it goes out, in order, none lost."""
    text = document(14, 250)
    isolation = {**FINGERPRINTS_ONLY, "fingerprints": {"stream_hold": hold}}
    with adversary_gateway(tokenizer_dir, isolation) as (adversary, gateway_url):
        await bob_sends_his_document(client, gateway_url, text)
        # Every 12-word gram of bob's text alone, each between words of alice's own: single hits, never a pair.
        grams = [" ".join(text.split()[at : at + 12]) for at in range(0, 240, 12)]
        answer = " ".join(f"{gram} unrelated filler words written here by the model itself now" for gram in grams)
        prompt = f"Repeat: {answer}"
        adversary.plan = Plan("content", piece=5, source="own")
        response = await client.post(
            f"{gateway_url}{CHAT}", json=chat_body(prompt, stream=True), headers=auth(ALICE_KEY)
        )
        assert response.status_code == 200 and '"answer_withheld"' not in response.text
        assert streamed_text(response).endswith(answer), streamed_text(response)[-200:]


@pytest.mark.parametrize("rank", [1, 2])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_a_fragment_spelled_in_the_alternatives_of_any_rank_is_caught(
    client: httpx.AsyncClient, tokenizer_dir: Path, rank: int, stream: bool
) -> None:
    text = document(15, 120)
    with adversary_gateway(tokenizer_dir, FINGERPRINTS_ONLY) as (adversary, gateway_url):
        await bob_sends_his_document(client, gateway_url, text)
        # bob's prompt, 8 characters a position, as the alternatives of one rank: the chosen tokens are benign.
        adversary.plan = Plan("top_logprob_token", piece=8, rank=rank)
        body = chat_body("And this?", logprobs=True, top_logprobs=3, stream=stream)
        response = await client.post(f"{gateway_url}{CHAT}", json=body, headers=auth(ALICE_KEY))
        assert '"answer_withheld"' in response.text, response.text[-300:]
        said = " ".join(
            alternative["token"]
            for line in response.text.split("\n")
            if line.startswith("data: {") or line.startswith("{")
            for choice in orjson.loads(line.removeprefix("data: ")).get("choices") or ()
            for entry in ((choice.get("logprobs") or {}).get("content") or ())
            for alternative in entry["top_logprobs"]
        )
        assert len([w for w in words(said) if w in set(words(text))]) <= 20
        [leak] = [e for e in await events(client, gateway_url) if e["kind"] == "fingerprint_leak"]
        assert leak["victim_tenant"] == "bob"
