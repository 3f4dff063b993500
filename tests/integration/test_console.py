"""The incident console (/admin/ui) over real HTTP to a real gateway: behind a login that takes the admin token once
(never in a URL) for a cookie no script can read; every change a form of the session's own, with its CSRF token, from
a page of this origin; every name escaped, under a policy that runs no script; a key shown by its id and hash prefix
only. The browser's side is tests/integration/test_console_browser.py."""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from http.cookies import SimpleCookie
from pathlib import Path

import httpx
import pytest

from tests.integration.conftest import GatewayFactory
from tests.integration.support import MODEL
from tests.integration.tenant_support import ADMIN_TOKEN, Admin

CONSOLE = "/admin/ui"
HOSTILE = '<img src=x onerror="alert(1)">'
SCRIPT = "<script>alert('owned')</script>"
IN_A_PATH = "<svg onload=alert(1)>"  # no slash: a path segment
FORM = {"content-type": "application/x-www-form-urlencoded"}


def csrf_of(page: str) -> str:
    found = re.search(r'name="csrf" value="([^"]+)"', page)
    assert found is not None, "no CSRF token in the page"
    return found.group(1)


async def logged_in(client: httpx.AsyncClient, gateway: str) -> str:
    """Log the client in (its cookie jar keeps the session); the CSRF token of its session."""
    answer = await client.post(f"{gateway}{CONSOLE}/login", data={"token": ADMIN_TOKEN})
    assert answer.status_code == 303 and answer.headers["location"] == CONSOLE, answer.text
    page = await client.get(f"{gateway}{CONSOLE}/replicas")
    assert page.status_code == 200
    return csrf_of(page.text)


async def state_of(client: httpx.AsyncClient, gateway: str, replica: str) -> str:
    answer = await client.get(f"{gateway}/admin/replicas", headers={"authorization": f"Bearer {ADMIN_TOKEN}"})
    states = {r["name"]: r["state"] for r in answer.json()["replicas"]}
    return states[replica]


@pytest.fixture
def gateway(make_gateway: GatewayFactory, sim_url: str) -> str:
    return make_gateway({"sim": sim_url}, admin_token=ADMIN_TOKEN)


@pytest.fixture
async def console() -> AsyncIterator[httpx.AsyncClient]:
    """A client whose cookie jar keeps a session, as a browser's does."""
    async with httpx.AsyncClient(timeout=10) as client:
        yield client


async def test_every_page_is_behind_the_login_and_the_token_is_posted_once_for_a_cookie(
    console: httpx.AsyncClient, gateway: str
) -> None:
    for path in ("", "/replicas", "/tenants", "/tenants/alice", "/incidents/inc_nothing"):
        answer = await console.get(f"{gateway}{CONSOLE}{path}")
        assert (answer.status_code, answer.headers["location"]) == (303, f"{CONSOLE}/login"), path
    refused = await console.post(f"{gateway}{CONSOLE}/replicas/release", data={"replica": "sim", "csrf": "x"})
    assert refused.status_code == 401
    form = await console.get(f"{gateway}{CONSOLE}/login")
    assert form.status_code == 200 and 'type="password"' in form.text and 'method="post"' in form.text
    wrong = await console.post(f"{gateway}{CONSOLE}/login", data={"token": "not-the-token"})
    assert wrong.status_code == 401 and "set-cookie" not in wrong.headers
    # The API's bearer header opens no page: a browser cannot send it on a navigation, and the console takes no token
    # but the one posted to its login form.
    bearer = await console.get(f"{gateway}{CONSOLE}", headers={"authorization": f"Bearer {ADMIN_TOKEN}"})
    assert bearer.status_code == 303

    answer = await console.post(f"{gateway}{CONSOLE}/login", data={"token": ADMIN_TOKEN})
    assert answer.status_code == 303 and answer.headers["location"] == CONSOLE
    [header] = answer.headers.get_list("set-cookie")
    cookie = SimpleCookie(header)["bulkhead_console"]
    assert cookie["httponly"] and cookie["samesite"].lower() == "strict" and cookie["path"] == CONSOLE
    assert not cookie["secure"], "over plain http (loopback) a Secure cookie would never come back"
    assert int(cookie["max-age"]) == 8 * 3600
    assert ADMIN_TOKEN not in header and ADMIN_TOKEN not in answer.headers["location"]
    # Behind a TLS proxy on this host (uvicorn trusts 127.0.0.1's X-Forwarded-Proto), the cookie is Secure.
    async with httpx.AsyncClient(timeout=10) as proxied:
        https = await proxied.post(
            f"{gateway}{CONSOLE}/login", data={"token": ADMIN_TOKEN}, headers={"x-forwarded-proto": "https"}
        )
    assert https.status_code == 303 and SimpleCookie(https.headers["set-cookie"])["bulkhead_console"]["secure"]
    page = await console.get(f"{gateway}{CONSOLE}")
    assert page.status_code == 200 and ADMIN_TOKEN not in page.text
    assert (await console.get(f"{gateway}{CONSOLE}/login")).headers["location"] == CONSOLE, "logged in already"

    # Logging out is a form too: the cookie goes, and with it every page.
    out = await console.post(f"{gateway}{CONSOLE}/logout", data={"csrf": csrf_of(page.text)})
    assert (out.status_code, out.headers["location"]) == (303, f"{CONSOLE}/login")
    assert (await console.get(f"{gateway}{CONSOLE}")).status_code == 303


async def test_a_forged_or_altered_session_cookie_opens_nothing(console: httpx.AsyncClient, gateway: str) -> None:
    await logged_in(console, gateway)
    real = console.cookies["bulkhead_console"]
    expires, session_id, signature = real.split(".")
    for forged in (
        f"{int(expires) + 3600}.{session_id}.{signature}",  # a longer life
        f"{expires}.other.{signature}",
        f"{expires}.{session_id}.{signature[:-2]}AA",
        "",
        "garbage",
    ):
        async with httpx.AsyncClient(timeout=10) as stranger:
            answer = await stranger.get(f"{gateway}{CONSOLE}", headers={"cookie": f"bulkhead_console={forged}"})
        assert answer.status_code == 303, forged


async def test_a_change_needs_the_sessions_csrf_token_from_a_page_of_this_origin(
    console: httpx.AsyncClient, gateway: str
) -> None:
    csrf = await logged_in(console, gateway)
    release = f"{gateway}{CONSOLE}/replicas/quarantine"
    async with httpx.AsyncClient(timeout=10) as other:
        others = await logged_in(other, gateway)
    assert others != csrf, "each session's token is its own"
    for data, headers in (
        ({"replica": "sim"}, {}),
        ({"replica": "sim", "csrf": ""}, {}),
        ({"replica": "sim", "csrf": csrf[:-1] + ("A" if csrf[-1] != "A" else "B")}, {}),
        ({"replica": "sim", "csrf": others}, {}),
        ({"replica": "sim", "csrf": csrf}, {"sec-fetch-site": "cross-site"}),
        ({"replica": "sim", "csrf": csrf}, {"sec-fetch-site": "same-site"}),
    ):
        answer = await console.post(release, data=data, headers=headers)
        assert answer.status_code == 403, (data, headers)
        assert await state_of(console, gateway, "sim") == "healthy"
    json_body = await console.post(release, json={"replica": "sim", "csrf": csrf})
    assert json_body.status_code == 400, "forms only"

    # The session's own token, from its own page: quarantined, then released, as the API then says.
    back = f"{CONSOLE}/replicas"
    done = await console.post(release, data={"replica": "sim", "csrf": csrf, "back": back})
    assert (done.status_code, done.headers["location"]) == (303, back)
    assert await state_of(console, gateway, "sim") == "quarantined"
    released = await console.post(
        f"{gateway}{CONSOLE}/replicas/release",
        data={"replica": "sim", "csrf": csrf, "back": "https://elsewhere.example/"},
        headers={"sec-fetch-site": "same-origin"},
    )
    assert (released.status_code, released.headers["location"]) == (303, back), "never back to another site"
    assert await state_of(console, gateway, "sim") == "healthy"
    unknown = await console.post(release, data={"replica": SCRIPT, "csrf": csrf})
    assert unknown.status_code == 404 and SCRIPT not in unknown.text and "&lt;script&gt;" in unknown.text


async def test_every_page_runs_no_script_and_escapes_what_operators_and_tenants_named(
    console: httpx.AsyncClient, make_gateway: GatewayFactory, sim_url: str, tokenizer_dir: Path
) -> None:
    models = [{"name": MODEL, "backends": [HOSTILE], "tokenizer": str(tokenizer_dir), "context_window": 2048}]
    gateway = make_gateway({HOSTILE: sim_url}, admin_token=ADMIN_TOKEN, models=models)
    admin = Admin(console, gateway)
    tenant_id, key_id, key = await admin.tenant_with_key()
    labelled = await admin.create_key(tenant_id, label=SCRIPT)
    await logged_in(console, gateway)

    pages = {
        path: await console.get(f"{gateway}{CONSOLE}{path}")
        for path in ("", "/replicas", "/tenants", f"/tenants/{tenant_id}")
    }
    async with httpx.AsyncClient(timeout=10) as stranger:
        pages["login"] = await stranger.get(f"{gateway}{CONSOLE}/login")
    pages["missing tenant"] = await console.get(f"{gateway}{CONSOLE}/tenants/{IN_A_PATH}")
    pages["missing incident"] = await console.get(f"{gateway}{CONSOLE}/incidents/{IN_A_PATH}")
    for name, page in pages.items():
        assert page.status_code == (404 if name.startswith("missing") else 200), name
        policy = page.headers["content-security-policy"]
        assert "default-src 'none'" in policy and "script-src" not in policy and "frame-ancestors 'none'" in policy
        assert page.headers["x-content-type-options"] == "nosniff" and page.headers["cache-control"] == "no-store"
        assert not re.search(r"<(script|img|svg)\b", page.text) and " style=" not in page.text, name
    assert "&lt;img src=x onerror=&#34;alert(1)&#34;&gt;" in pages["/replicas"].text
    assert "&lt;script&gt;alert(&#39;owned&#39;)&lt;/script&gt;" in pages[f"/tenants/{tenant_id}"].text
    assert "&lt;svg onload=alert(1)&gt;" in pages["missing tenant"].text
    assert "&lt;svg onload=alert(1)&gt;" in pages["missing incident"].text

    # Keys by id and hash prefix: never the key, nor its whole hash.
    tenant_page = pages[f"/tenants/{tenant_id}"].text
    assert key_id in tenant_page and labelled["key_id"] in tenant_page and labelled["hash_prefix"] in tenant_page
    assert key not in tenant_page and labelled["key"] not in tenant_page
    styles = await console.get(f"{gateway}{CONSOLE}/console.css")
    assert styles.status_code == 200 and styles.headers["content-type"].startswith("text/css")


async def test_the_console_is_off_without_an_admin_token(
    console: httpx.AsyncClient, make_gateway: GatewayFactory, sim_url: str
) -> None:
    gateway = make_gateway({"sim": sim_url})
    for path in ("", "/login", "/console.css"):
        assert (await console.get(f"{gateway}{CONSOLE}{path}")).status_code == 404
    answer = await console.post(f"{gateway}{CONSOLE}/login", data={"token": "anything"})
    assert answer.status_code == 404 and "set-cookie" not in answer.headers
