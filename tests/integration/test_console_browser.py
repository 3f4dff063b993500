"""The incident console in a real browser: Debian's chromium, headless, driven by its chromedriver through selenium.

A replica goes bad after a clean probe (the simulator's stale-KV fault) and answers bob from alice's KV pages; the
probe confirms it and it is quarantined. In the browser an operator logs in with the admin token, finds the
incident, sees its exposure drawn (bars per tenant, the leak among them, under a policy that blocked nothing: no
script, the console's own stylesheet applied) with each notice's delivery (alice's delivered, bob's to a receiver that
is down a dead letter), and releases the replica from the page; the admin API then says it is back in rotation and
its incident closed. chromium and chromedriver missing is a failure, not a skip: .ci/run installs them.

BULKHEAD_CONSOLE_SCREENSHOTS=docs/img keeps the pages' screenshots there (docs/operations.md shows them); else
they are written to the test's temporary directory.
"""

from __future__ import annotations

import asyncio
import base64
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from selenium import webdriver
from selenium.webdriver.chrome.options import Options
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver

from tests.integration.receiver import webhook_receiver
from tests.integration.support import ALICE_KEY, BOB_KEY, auth, canaries_only, chat_body, session_on
from tests.integration.test_canaries import alice_fills_the_cache, over_capacity
from tests.integration.test_exposure import CAROL_KEY, DAVE_KEY, NAMES, TENANTS, ask, clean_pass
from tests.integration.test_notices import LOCAL_URLS, register
from tests.integration.test_quarantine import ADMIN, ADMIN_AUTH, FAST_PROBE, states, wait_for_event

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
# Without the background services' flags chromium waits on a network it cannot reach.
FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
WIDTH = 1280
WAIT_S = 20.0


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[WebDriver]:
    for path in (CHROMIUM, CHROMEDRIVER):
        if not os.access(path, os.X_OK):
            raise RuntimeError(f"{path} is missing: apt-get install chromium chromium-driver (.ci/run does)")
    options = Options()
    options.binary_location = CHROMIUM
    for flag in [*FLAGS, f"--user-data-dir={tmp_path / 'profile'}", f"--window-size={WIDTH},900"]:
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    # The driver named: Selenium Manager would try to download one.
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def until(driver: WebDriver, found: Any, what: str, reload: bool = False) -> Any:
    """`found(driver)` once it is truthy (reloading the page between tries, for what a background task changes)."""
    deadline = time.monotonic() + WAIT_S
    while True:
        value = found(driver)
        if value:
            return value
        assert time.monotonic() < deadline, f"not seen in {WAIT_S} s: {what}"
        time.sleep(0.2)
        if reload:
            driver.refresh()


def screenshot(driver: WebDriver, directory: Path, name: str) -> Path:
    """The whole page, as tall as it is (by the DevTools protocol: WebDriver's own stops at the window)."""
    driver.set_window_size(WIDTH, 400)
    size = driver.execute_cdp_cmd("Page.getLayoutMetrics", {})["cssContentSize"]
    clip = {"x": 0, "y": 0, "width": WIDTH, "height": size["height"], "scale": 1}
    shot = driver.execute_cdp_cmd("Page.captureScreenshot", {"captureBeyondViewport": True, "clip": clip})
    path = directory / f"console-{name}.png"
    path.write_bytes(base64.b64decode(shot["data"]))
    return path


def cell(driver: WebDriver, table: str, first: str, column: int) -> str:
    """The text of a column of the row whose first cell is `first`, in a table of that class ("" when none is)."""
    for row in driver.find_elements(By.CSS_SELECTOR, f"table.{table} tbody tr"):
        cells = row.find_elements(By.TAG_NAME, "td")
        if cells and cells[0].text == first:
            return str(cells[column].text)
    return ""


async def test_an_operator_sees_a_stale_kv_incident_drawn_and_releases_its_replica_from_the_page(
    client: httpx.AsyncClient, make_gateway: Any, make_sim: Any, tokenizer_dir: Path, browser: WebDriver, tmp_path: Path
) -> None:
    sims = {"leaky": make_sim(num_gpu_blocks=16, output_tokens=64), "healthy": make_sim()}
    shots = Path(os.environ.get("BULKHEAD_CONSOLE_SCREENSHOTS") or tmp_path)
    with webhook_receiver() as alices, webhook_receiver() as bobs:
        gateway = make_gateway(
            sims,
            models=canaries_only(tokenizer_dir, NAMES),
            tenants=TENANTS,
            admin_token=ADMIN,
            isolation={
                "canary": {"policy": "alert"},  # the leak reaches bob: the timeline shows what leaked, not withheld
                "prober": {"enabled": True, "interval_s": 600, **FAST_PROBE},
                "notices": LOCAL_URLS,
            },
            webhooks={"retry_schedule_s": [0.2, 0.2, 0.5], "dead_after": 2, "poll_interval_s": 0.05},
        )
        await register(client, gateway, ALICE_KEY, alices.url)
        await register(client, gateway, BOB_KEY, bobs.url)
        bobs.down = True
        await clean_pass(client, gateway, "leaky")
        for tenant, key in [("dave", DAVE_KEY), ("carol", CAROL_KEY)] * 3:
            await ask(client, gateway, tenant, key, "leaky")
            await asyncio.sleep(0.1)
        # The replica goes bad after its clean probe; alice's prompt is in its cache when bob's outgrows it.
        assert (await client.put(f"{sims['leaky']}/sim/fault", json={"fault": "stale-kv"})).status_code == 200
        await ask(client, gateway, "dave", DAVE_KEY, "leaky")
        await alice_fills_the_cache(client, gateway, session_on("alice", "leaky", NAMES))
        headers = auth(BOB_KEY) | {"x-session-affinity": session_on("bob", "leaky", NAMES)}
        leaked = await client.post(f"{gateway}/v1/chat/completions", json=over_capacity(), headers=headers)
        assert leaked.status_code == 200
        check = await wait_for_event(client, gateway, "leak_check")
        assert (check["confirmed"], check["action"]) == ("yes", "quarantined")
        healthy = headers | {"x-session-affinity": session_on("bob", "healthy", NAMES)}
        for _ in range(2):
            answer = await client.post(f"{gateway}/v1/chat/completions", json=chat_body(max_tokens=2), headers=healthy)
            assert answer.status_code == 200
        [incident] = (await client.get(f"{gateway}/admin/incidents", headers=ADMIN_AUTH)).json()["incidents"]

        # The console sends a stranger to its login form; the token is typed once, and goes in no URL.
        browser.get(f"{gateway}/admin/ui")
        assert browser.current_url == f"{gateway}/admin/ui/login"
        browser.find_element(By.ID, "token").send_keys(ADMIN)
        browser.find_element(By.CSS_SELECTOR, "form.login button").click()
        until(browser, lambda d: d.current_url == f"{gateway}/admin/ui", "the incidents after the login")
        assert ADMIN not in browser.current_url and ADMIN not in browser.page_source
        header = browser.find_element(By.TAG_NAME, "header").value_of_css_property("background-color")
        assert header == "rgba(29, 35, 43, 1)", "the console's stylesheet applies under its policy"
        assert cell(browser, "incidents", incident["id"], 1) == "open"
        screenshot(browser, shots, "incidents")

        browser.find_element(By.LINK_TEXT, incident["id"]).click()
        until(browser, lambda d: d.current_url.endswith(f"/admin/ui/incidents/{incident['id']}"), "the incident")
        bars = browser.find_elements(By.CSS_SELECTOR, "svg.timeline rect.bar")
        lanes = [e.text for e in browser.find_elements(By.CSS_SELECTOR, "svg.timeline text.lane-label")]
        assert bars and all(bar.size["width"] > 0 and bar.size["height"] > 0 for bar in bars), "drawn, not empty"
        assert {"alice", "bob", "carol", "dave"} <= set(lanes)
        [leak] = browser.find_elements(By.CSS_SELECTOR, "svg.timeline rect.bar-leaked")
        assert leak.find_element(By.TAG_NAME, "title").get_attribute("textContent").startswith("bob, ")
        assert browser.find_elements(By.CSS_SELECTOR, "svg.timeline line.mark-opened")
        assert cell(browser, "exposure", "bob", 7) == "1", "one answer of bob's carried a leak"
        # Each notice's delivery as the outbox has it: alice's taken by her receiver, bob's failing into a dead letter.
        until(browser, lambda d: cell(d, "notices", "alice", 3) == "delivered", "alice's notice delivered", True)
        until(browser, lambda d: cell(d, "notices", "bob", 3) == "dead letter", "bob's notice a dead letter", True)
        assert len(browser.find_elements(By.CSS_SELECTOR, "svg.timeline line.mark-notice")) == 2
        screenshot(browser, shots, "incident")

        browser.get(f"{gateway}/admin/ui/replicas")
        assert cell(browser, "replicas", "leaky", 1) == "quarantined"
        screenshot(browser, shots, "replicas")
        browser.get(f"{gateway}/admin/ui/incidents/{incident['id']}")
        browser.find_element(By.CSS_SELECTOR, "button[aria-label='Release leaky']").click()
        until(browser, lambda d: not d.find_elements(By.CSS_SELECTOR, "button.release"), "the release done")
        assert browser.current_url.endswith(f"/admin/ui/incidents/{incident['id']}"), "back where it was pressed"

        assert (await states(client, gateway))["leaky"] == "healthy"
        released = (await client.get(f"{gateway}/admin/incidents/{incident['id']}", headers=ADMIN_AUTH)).json()
        assert (released["state"], released["close_reason"]) == ("closed", "the replica was released by an operator")
        refused = [e for e in browser.get_log("browser") if "Content Security Policy" in e["message"]]
        assert refused == [], "the policy refused nothing the console itself needs"
