"""The admin API for tenants and keys, over real HTTP to a real gateway: one suite, run with the tenant directory in
memory and in Redis alike. Bad input is a 400 naming the field, unknown ids 404, an id that exists 409; a key is in
the answer that makes it and nowhere else — not in listings, not in the audit trail, not in the log."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import ExitStack
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gateway.pipeline.counting import LocalCounter
from gateway.server.app import create_app
from gateway.server.serving import run_server
from gateway.tenancy.auditlog import token_id
from gateway.tenancy.tenants import hash_key
from isolation.markers import MARKER_PATTERN
from tests.integration.conftest import GatewayFactory
from tests.integration.support import ALICE_KEY, BOB_KEY, MODEL, auth, chat_body, forwarded, gateway_settings
from tests.integration.tenant_support import ADMIN_TOKEN, Admin, chat, new_id, redis_database, until
from tests.redis_server import redis_server


@pytest.fixture(params=["memory", "redis"])
def gateway(request: pytest.FixtureRequest, make_gateway: GatewayFactory, sim_url: str) -> Iterator[str]:
    if request.param == "memory":
        yield make_gateway({"sim": sim_url}, admin_token=ADMIN_TOKEN)
        return
    with redis_server() as url:
        yield make_gateway({"sim": sim_url}, admin_token=ADMIN_TOKEN, redis_url=redis_database(url))


@pytest.fixture
def admin(client: httpx.AsyncClient, gateway: str) -> Admin:
    return Admin(client, gateway)


def in_future(seconds: float) -> str:
    return (datetime.now(UTC) + timedelta(seconds=seconds)).isoformat()


def refused(response: httpx.Response, status: int, code: str | None = None, param: str | None = None) -> None:
    """An error in the OpenAI shape, with this status (and code, and the field it names)."""
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if code is not None:
        assert error["code"] == code, error
    if param is not None:
        assert error["param"] == param, error


async def test_a_tenant_is_created_read_listed_changed_and_deleted(admin: Admin) -> None:
    tenant_id = new_id()
    body = {"id": tenant_id, "models": [MODEL], "limits": {"requests_per_minute": 60, "max_output_tokens": 100}}
    created = await admin.call("POST", "/tenants", body)
    assert created.status_code == 201
    view = created.json()
    assert view["id"] == tenant_id and view["source"] == "api" and view["enabled"] is True
    assert view["models"] == [MODEL] and view["limits"]["requests_per_minute"] == 60
    assert view["created_at"].endswith("Z") and view["created_at"] == view["updated_at"]
    assert (await admin.call("GET", f"/tenants/{tenant_id}")).json() == view

    changed = await admin.call("PATCH", f"/tenants/{tenant_id}", {"limits": {"requests_per_minute": None}})
    assert changed.status_code == 200
    limits = changed.json()["limits"]
    assert limits["requests_per_minute"] is None and limits["max_output_tokens"] == 100, "merged, not replaced"
    disabled = await admin.call("PATCH", f"/tenants/{tenant_id}", {"enabled": False, "models": ["*"]})
    assert disabled.json()["enabled"] is False and disabled.json()["models"] == ["*"]
    assert disabled.json()["updated_at"] >= view["updated_at"]

    listed = (await admin.call("GET", "/tenants", limit="1000")).json()
    by_id = {t["id"]: t for t in listed["tenants"]}
    assert by_id[tenant_id]["enabled"] is False
    assert by_id["alice"]["source"] == "config" and by_id["alice"]["created_at"] is None, "configured tenants too"

    deleted = await admin.call("DELETE", f"/tenants/{tenant_id}")
    assert deleted.status_code == 204 and deleted.content == b""
    refused(await admin.call("GET", f"/tenants/{tenant_id}"), 404, "not_found")


async def test_tenants_are_listed_in_pages_by_id(admin: Admin) -> None:
    prefix = new_id("page")
    ids = [await admin.create_tenant(f"{prefix}-{n}") for n in range(5)]
    seen: list[str] = []
    after = f"{prefix}"
    while True:
        page = (await admin.call("GET", "/tenants", limit="2", after=after)).json()
        seen += [t["id"] for t in page["tenants"] if t["id"].startswith(prefix)]
        if page["next"] is None or not page["next"].startswith(prefix):
            break
        assert len(page["tenants"]) == 2
        after = page["next"]
    assert seen == ids


async def test_a_new_key_works_at_once_and_is_never_shown_again(client: httpx.AsyncClient, admin: Admin) -> None:
    tenant_id = await admin.create_tenant()
    created = await admin.create_key(tenant_id, label="ci pipeline", expires_at=in_future(3600))
    key = created["key"]
    assert key.startswith("bk-") and created["label"] == "ci pipeline" and created["expired"] is False
    assert created["hash_prefix"] == hash_key(key)[: len("sha256:") + 12]
    answer = await chat(client, admin.url, key)
    assert answer.status_code == 200, answer.text
    models = await client.get(f"{admin.url}/v1/models", headers=auth(key))
    assert [m["id"] for m in models.json()["data"]] == [MODEL]

    listed = await admin.call("GET", f"/tenants/{tenant_id}/keys")
    [view] = listed.json()["keys"]
    assert view["key_id"] == created["key_id"] and "key" not in view
    for response in (listed, await admin.call("GET", f"/tenants/{tenant_id}"), await admin.call("GET", "/tenants")):
        assert key not in response.text and hash_key(key) not in response.text
    # The last use is written within a second or two (at most once a minute per key and instance).
    await until(lambda: last_used(admin, tenant_id), timeout=5)


async def last_used(admin: Admin, tenant_id: str) -> bool:
    [view] = (await admin.call("GET", f"/tenants/{tenant_id}/keys")).json()["keys"]
    return view["last_used_at"] is not None


async def test_a_runtime_tenants_models_and_limits_apply_and_change_at_once(
    client: httpx.AsyncClient, admin: Admin
) -> None:
    tenant_id, _, key = await admin.tenant_with_key(models=[], limits={"max_output_tokens": 2})
    refused(await chat(client, admin.url, key), 403, "model_not_allowed")
    await admin.call("PATCH", f"/tenants/{tenant_id}", {"models": [MODEL]})
    refused(await chat(client, admin.url, key), 400, param="max_tokens")  # 3 asked, 2 allowed
    await admin.call("PATCH", f"/tenants/{tenant_id}", {"limits": {"max_output_tokens": 3}})
    assert (await chat(client, admin.url, key)).status_code == 200


async def test_a_disabled_tenant_is_refused_and_an_enabled_one_served_again(
    client: httpx.AsyncClient, admin: Admin
) -> None:
    tenant_id, _, key = await admin.tenant_with_key()
    assert (await chat(client, admin.url, key)).status_code == 200
    await admin.call("PATCH", f"/tenants/{tenant_id}", {"enabled": False})
    refused(await chat(client, admin.url, key), 403, "tenant_disabled")
    refused(await client.get(f"{admin.url}/v1/models", headers=auth(key)), 403, "tenant_disabled")
    await admin.call("PATCH", f"/tenants/{tenant_id}", {"enabled": True})
    assert (await chat(client, admin.url, key)).status_code == 200


async def test_revoked_expired_and_deleted_keys_are_refused(client: httpx.AsyncClient, admin: Admin) -> None:
    tenant_id, key_id, key = await admin.tenant_with_key()
    short = await admin.create_key(tenant_id, expires_at=in_future(1.0))
    assert (await chat(client, admin.url, short["key"])).status_code == 200
    assert (await chat(client, admin.url, key)).status_code == 200
    assert (await admin.call("DELETE", f"/tenants/{tenant_id}/keys/{key_id}")).status_code == 204
    refused(await chat(client, admin.url, key), 401, "invalid_api_key")
    await until(lambda: refused_now(client, admin.url, short["key"]), timeout=3)
    expired = await chat(client, admin.url, short["key"])
    refused(expired, 401, "invalid_api_key")
    assert "expired" in expired.json()["error"]["message"]
    [listed] = (await admin.call("GET", f"/tenants/{tenant_id}/keys")).json()["keys"]
    assert listed["expired"] is True
    other_tenant, _, other_key = await admin.tenant_with_key()
    assert (await admin.call("DELETE", f"/tenants/{other_tenant}")).status_code == 204
    refused(await chat(client, admin.url, other_key), 401, "invalid_api_key")


async def test_a_rotated_key_overlaps_with_its_successor(client: httpx.AsyncClient, admin: Admin) -> None:
    tenant_id, key_id, old = await admin.tenant_with_key()
    rotated = await admin.call("POST", f"/tenants/{tenant_id}/keys/{key_id}/rotate", {"overlap_s": 1.5})
    assert rotated.status_code == 201, rotated.text
    new = rotated.json()
    assert new["key"] != old and new["key_id"] != key_id and new["label"] == f"rotated from {key_id}"
    assert new["previous"]["key_id"] == key_id and new["previous"]["expires_at"] is not None
    assert "key" not in new["previous"]
    for key in (old, new["key"]):
        assert (await chat(client, admin.url, key)).status_code == 200
    await until(lambda: refused_now(client, admin.url, old), timeout=3)
    assert (await chat(client, admin.url, new["key"])).status_code == 200
    keys = (await admin.call("GET", f"/tenants/{tenant_id}/keys")).json()["keys"]
    assert [(k["key_id"], k["expired"]) for k in keys] == [(key_id, True), (new["key_id"], False)]


async def refused_now(client: httpx.AsyncClient, url: str, key: str) -> bool:
    return (await chat(client, url, key)).status_code == 401


BAD_CREATES: list[tuple[Any, str | None]] = [
    ({"id": "has space"}, "id"),
    ({"id": ""}, "id"),
    ({"id": "x" * 65}, "id"),
    ({"models": ["*"]}, "id"),
    ({"id": "ok", "models": "*"}, "models"),
    ({"id": "ok", "models": ["no-such-model"]}, "models[0]"),
    ({"id": "ok", "limits": {"requests_per_minute": "5"}}, "limits.requests_per_minute"),
    ({"id": "ok", "limits": {"requests_per_minute": 0}}, "limits.requests_per_minute"),
    ({"id": "ok", "limits": {"tokens_per_hour": 5}}, "limits.tokens_per_hour"),
    ({"id": "ok", "limits": {"on_output_overflow": "truncate"}}, "limits.on_output_overflow"),
    ({"id": "ok", "enabled": 1}, "enabled"),
    ({"id": "ok", "key_hashes": [hash_key("bk-x")]}, "key_hashes"),
    ([{"id": "ok"}], None),
    ("not an object", None),
]


@pytest.mark.parametrize(("body", "param"), BAD_CREATES)
async def test_a_bad_tenant_body_is_a_400_naming_the_field(admin: Admin, body: Any, param: str | None) -> None:
    refused(await admin.call("POST", "/tenants", body), 400, "invalid_request", param)


async def test_bad_bodies_of_every_route_are_400s(admin: Admin) -> None:
    tenant_id, key_id, _ = await admin.tenant_with_key()
    patch, keys = f"/tenants/{tenant_id}", f"/tenants/{tenant_id}/keys"
    cases: list[tuple[str, str, Any, str | None]] = [
        ("PATCH", patch, {}, None),
        ("PATCH", patch, {"enabled": None}, "enabled"),
        ("PATCH", patch, {"models": None}, "models"),
        ("PATCH", patch, {"id": "renamed"}, "id"),
        ("PATCH", patch, {"limits": {"max_prompt_tokens": -1}}, "limits.max_prompt_tokens"),
        ("PATCH", patch, {"limits": {"on_output_overflow": None}}, "limits.on_output_overflow"),
        ("PATCH", patch, {"limits": []}, "limits"),
        ("POST", keys, {"label": ""}, "label"),
        ("POST", keys, {"label": "a\nb"}, "label"),
        ("POST", keys, {"label": "x" * 201}, "label"),
        ("POST", keys, {"expires_at": "2000-01-01T00:00:00Z"}, "expires_at"),
        ("POST", keys, {"expires_at": "2999-01-01T00:00:00"}, "expires_at"),
        ("POST", keys, {"expires_at": 4102444800}, "expires_at"),
        ("POST", keys, {"key": "bk-chosen-by-the-caller"}, "key"),
        ("POST", f"{keys}/{key_id}/rotate", {"overlap_s": -1}, "overlap_s"),
        ("POST", f"{keys}/{key_id}/rotate", {"overlap_s": 10**9}, "overlap_s"),
        ("POST", f"{keys}/{key_id}/rotate", {"overlap_s": "60"}, "overlap_s"),
        ("GET", "/tenants?limit=0", None, "limit"),
        ("GET", "/tenants?limit=1001", None, "limit"),
        ("GET", "/audit-events?limit=x", None, "limit"),
    ]
    for method, path, body, param in cases:
        refused(await admin.call(method, path, body), 400, "invalid_request", param)
    raw = await admin.client.post(f"{admin.url}/admin/tenants", content=b'{"id": ', headers=admin.headers)
    refused(raw, 400, "invalid_request")
    deep = await admin.client.post(
        f"{admin.url}/admin/tenants",
        content=b'{"id": "x", "limits": ' + b"[" * 20 + b"]" * 20 + b"}",
        headers=admin.headers,
    )
    refused(deep, 400, "invalid_request")
    huge = await admin.call("POST", "/tenants", {"id": "x", "models": ["m" * 100] * 1000})
    refused(huge, 413, "request_too_large")
    [unchanged] = (await admin.call("GET", f"{keys}")).json()["keys"]
    assert unchanged["key_id"] == key_id, "no refused request changed anything"


async def test_unknown_ids_are_404s(admin: Admin) -> None:
    tenant_id, key_id, _ = await admin.tenant_with_key()
    missing = new_id("missing")
    for method, path, body in [
        ("GET", f"/tenants/{missing}", None),
        ("PATCH", f"/tenants/{missing}", {"enabled": False}),
        ("DELETE", f"/tenants/{missing}", None),
        ("GET", f"/tenants/{missing}/keys", None),
        ("POST", f"/tenants/{missing}/keys", {}),
        ("DELETE", f"/tenants/{tenant_id}/keys/key-0000000000000000", None),
        ("POST", f"/tenants/{tenant_id}/keys/key-0000000000000000/rotate", {"overlap_s": 1}),
        ("DELETE", f"/tenants/{missing}/keys/{key_id}", None),
    ]:
        refused(await admin.call(method, path, body), 404, "not_found")


async def test_an_existing_id_is_a_409_and_configured_tenants_are_read_only(admin: Admin) -> None:
    tenant_id = await admin.create_tenant()
    refused(await admin.call("POST", "/tenants", {"id": tenant_id}), 409, "tenant_exists")
    refused(await admin.call("POST", "/tenants", {"id": "alice"}), 409, "tenant_configured")
    for method, path, body in [
        ("PATCH", "/tenants/bob", {"enabled": False}),
        ("DELETE", "/tenants/bob", None),
        ("POST", "/tenants/bob/keys", {}),
        ("DELETE", "/tenants/bob/keys/config-0123", None),
        ("POST", "/tenants/bob/keys/config-0123/rotate", {}),
    ]:
        refused(await admin.call(method, path, body), 409, "tenant_configured")
    bob = (await admin.call("GET", "/tenants/bob")).json()
    assert bob["source"] == "config" and bob["limits"]["max_output_tokens"] == 64
    [key] = (await admin.call("GET", "/tenants/bob/keys")).json()["keys"]
    assert key["source"] == "config" and key["hash_prefix"] == hash_key(BOB_KEY)[: len("sha256:") + 12]


async def test_only_the_admin_token_opens_the_admin_api(client: httpx.AsyncClient, admin: Admin) -> None:
    for headers in ({}, auth(ALICE_KEY), {"authorization": f"Bearer {ADMIN_TOKEN}x"}):
        answer = await client.post(f"{admin.url}/admin/tenants", json={"id": new_id()}, headers=headers)
        refused(answer, 401, "invalid_api_key")
    # And the admin token is no tenant key.
    refused(await client.post(f"{admin.url}/v1/chat/completions", json=chat_body(), headers=admin.headers), 401)


async def test_every_change_is_audited_and_no_secret_is_ever_logged(
    client: httpx.AsyncClient, admin: Admin, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    tenant_id, key_id, key = await admin.tenant_with_key(limits={"requests_per_minute": 5})
    await admin.call("PATCH", f"/tenants/{tenant_id}", {"enabled": False})
    rotated = (await admin.call("POST", f"/tenants/{tenant_id}/keys/{key_id}/rotate", {"overlap_s": 60})).json()
    await admin.call("DELETE", f"/tenants/{tenant_id}/keys/{rotated['key_id']}")
    await chat(client, admin.url, key)
    await admin.call("DELETE", f"/tenants/{tenant_id}")

    events = (await admin.call("GET", "/audit-events", limit="100")).json()["events"]
    mine = [e for e in events if e["tenant"] == tenant_id][::-1]
    assert [e["action"] for e in mine] == [
        "tenant.create", "key.create", "tenant.update", "key.rotate", "key.revoke", "tenant.delete",
    ]  # fmt: skip
    assert {e["actor"] for e in mine} == {token_id(ADMIN_TOKEN)}
    assert mine[2]["detail"] == '{"enabled":false}' and mine[3]["key_id"] == key_id
    assert all(time.time() - 60 < e["time"] <= time.time() for e in mine)
    logged = [r.getMessage() for r in caplog.records if r.name == "bulkhead.audit"]
    assert sum(tenant_id in line for line in logged) == len(mine), "each change is in the log as well"
    trail = str(events) + caplog.text
    for secret in (key, rotated["key"], hash_key(key), hash_key(rotated["key"]), ADMIN_TOKEN):
        assert secret not in trail


async def test_queued_requests_of_a_runtime_tenant_run_as_the_tenant_is_now(
    client: httpx.AsyncClient, admin: Admin
) -> None:
    tenant_id, _, key = await admin.tenant_with_key()
    run = f"{admin.url}/accounts/{tenant_id}/ai/run/{MODEL}?queueRequest=true"
    queued = await client.post(run, json={"prompt": "hello", "max_tokens": 2}, headers=auth(key))
    assert queued.json()["result"]["status"] == "queued", queued.text
    poll = f"{admin.url}/v1/requests/{queued.json()['result']['request_id']}"

    async def done() -> bool:
        return bool((await client.get(poll, headers=auth(key))).json()["status"] == "done")

    await until(done, timeout=10)
    assert (await client.get(poll, headers=auth(key))).json()["results"][0]["status"] == 200


async def test_the_openapi_document_describes_the_admin_routes(client: httpx.AsyncClient, admin: Admin) -> None:
    document = (await client.get(f"{admin.url}/openapi.json")).json()
    paths = document["paths"]
    assert set(paths["/admin/tenants"]) == {"get", "post"}
    assert set(paths["/admin/tenants/{tenant}"]) - {"parameters"} == {"get", "patch", "delete"}
    assert "post" in paths["/admin/tenants/{tenant}/keys/{key_id}/rotate"]
    assert paths["/admin/tenants"]["post"]["security"] == [{"admin": []}]
    # The schemas are the ones the gateway validates with: what one accepts, the other does.
    schemas = document["components"]["schemas"]
    resolver = {"components": {"schemas": schemas}}
    for body, accepted in [({"id": "a-b.c_1"}, True), ({"id": "a", "limits": {"tokens_per_minute": 9}}, True),
                           ({"id": "a b"}, False), ({"id": "a", "color": "red"}, False)]:  # fmt: skip
        schema = {**schemas["TenantCreate"], **resolver}
        valid = jsonschema.Draft202012Validator(schema).is_valid(body)
        answer = await admin.call("POST", "/tenants", {**body, "id": new_id() if accepted else body["id"]})
        assert valid == accepted == (answer.status_code == 201), (body, answer.text)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)
LIMIT_NAMES = ["max_concurrent_requests", "max_output_tokens", "max_prompt_tokens", "requests_per_minute",
               "tokens_per_minute", "on_output_overflow", "per_day"]  # fmt: skip
LIMITS = st.dictionaries(
    st.sampled_from(LIMIT_NAMES),
    st.integers(min_value=-2, max_value=10**6) | st.sampled_from(["reject", "clamp"]) | JSON,
)
TENANT_BODIES = (
    st.fixed_dictionaries(
        {},
        optional={
            "id": st.from_regex(r"\A[a-z0-9][a-z0-9._-]{0,8}\Z") | st.text(max_size=70) | JSON,
            "models": st.lists(st.sampled_from(["*", MODEL, "other"]), max_size=3) | JSON,
            "limits": LIMITS | JSON,
            "enabled": st.booleans() | JSON,
            "extra": JSON,
        },
    )
    | JSON
)


def test_generated_tenant_bodies_are_created_or_refused_as_the_schema_says(gateway: str) -> None:
    """Never a 5xx; what the published schema refuses is a 400; what is created, the schema accepts."""
    with httpx.Client(timeout=30, headers={"authorization": f"Bearer {ADMIN_TOKEN}"}) as client:
        document = client.get(f"{gateway}/openapi.json").json()
        validator = jsonschema.Draft202012Validator(
            {"$ref": "#/components/schemas/TenantCreate", "components": document["components"]}
        )

        @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))
        @given(body=TENANT_BODIES)
        def check(body: Any) -> None:
            response = client.post(f"{gateway}/admin/tenants", json=body)
            assert response.status_code in (201, 400, 409), (body, response.text)
            if response.status_code != 201:
                assert set(response.json()["error"]) == {"message", "type", "param", "code"}
            schema_accepts = validator.is_valid(body)
            if not schema_accepts:
                assert response.status_code == 400, (body, response.text)
            if response.status_code == 201:
                assert schema_accepts, body
                client.delete(f"{gateway}/admin/tenants/{body['id']}")

        check()


@pytest.mark.parametrize("store", ["memory", "redis"])
async def test_a_tenant_made_again_under_a_deleted_ones_id_inherits_none_of_its_kept_prompt_counts(
    client: httpx.AsyncClient, sim_url: str, tokenizer_dir: Path, store: str
) -> None:
    """Prompt pieces' counts are kept per tenant (gateway/pipeline/piece_counts.py); how fast a text is counted would
    tell whether it was sent before, so a new tenant under an old id must start with none of them."""
    with ExitStack() as stack:
        redis = {"redis_url": redis_database(stack.enter_context(redis_server()))} if store == "redis" else {}
        app = create_app(gateway_settings({"sim": sim_url}, tokenizer_dir, admin_token=ADMIN_TOKEN, **redis))
        url = stack.enter_context(run_server(app))
        counter = app.state.pipeline.counters[MODEL]
        assert isinstance(counter, LocalCounter) and counter.pieces.piecewise
        admin = Admin(client, url)
        tenant_id, _, key = await admin.tenant_with_key()
        words = [{"role": "user", "content": f"the first tenant's own words, {new_id()}"}]
        assert (await chat(client, url, key, messages=words)).status_code == 200
        tokenized = counter.pieces.misses
        assert (await chat(client, url, key, messages=words)).status_code == 200
        assert counter.pieces.misses == tokenized, "the same tenant's prompt again: every piece was kept"
        assert (await admin.call("DELETE", f"/tenants/{tenant_id}")).status_code == 204
        await admin.create_tenant(tenant_id)
        again = (await admin.create_key(tenant_id))["key"]
        assert (await chat(client, url, again, messages=words)).status_code == 200
        assert counter.pieces.misses > tokenized, "the new tenant's prompt was counted from the old one's pieces"


async def test_a_tenant_made_again_under_a_deleted_ones_id_shares_no_cache_salt_marker_or_job(
    client: httpx.AsyncClient, admin: Admin, sim_url: str
) -> None:
    """A new customer under an old id must not join the old one's prefix cache, own its marker (whose leak would
    then read as its own, stripped and unrecorded) or read its queued results."""
    tenant_id, _, key = await admin.tenant_with_key()

    async def sent(key: str) -> tuple[str, str]:
        assert (await chat(client, admin.url, key)).status_code == 200
        body = forwarded(sim_url)[-1]["body"]
        found = MARKER_PATTERN.search(str(body["messages"]))
        assert found is not None
        return body["cache_salt"], found.group()

    before = await sent(key)
    run = f"{admin.url}/accounts/{tenant_id}/ai/run/{MODEL}?queueRequest=true"
    queued = await client.post(run, json={"prompt": "the old customer's words", "max_tokens": 2}, headers=auth(key))
    poll = f"{admin.url}/v1/requests/{queued.json()['result']['request_id']}"

    async def done() -> bool:
        return bool((await client.get(poll, headers=auth(key))).json()["status"] == "done")

    await until(done, timeout=10)
    assert (await admin.call("DELETE", f"/tenants/{tenant_id}")).status_code == 204
    await admin.create_tenant(tenant_id)
    again = (await admin.create_key(tenant_id))["key"]
    after = await sent(again)
    assert after[0] != before[0], "the same cache salt: the new customer would hit the old one's prefix cache"
    assert after[1] != before[1], "the same marker"
    assert (await client.get(poll, headers=auth(again))).status_code == 404


async def test_a_tenant_made_again_under_a_deleted_ones_id_starts_with_a_rate_budget_of_its_own(
    client: httpx.AsyncClient, admin: Admin
) -> None:
    limits = {"requests_per_minute": 1}
    tenant_id, _, key = await admin.tenant_with_key(limits=limits)
    assert (await chat(client, admin.url, key)).status_code == 200
    assert (await chat(client, admin.url, key)).status_code == 429
    assert (await admin.call("DELETE", f"/tenants/{tenant_id}")).status_code == 204
    await admin.create_tenant(tenant_id, limits=limits)
    again = (await admin.create_key(tenant_id))["key"]
    assert (await chat(client, admin.url, again)).status_code == 200, "the deleted customer's budget, spent"
