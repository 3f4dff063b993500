"""The incident's own deployment: a router in front of a prefill pool and a decode pool (the simulator's
disaggregated mode), with and without its stages declared to the gateway."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.server.app import create_app
from gateway.server.serving import run_server
from isolation.sim import SimConfig, create_sim_app
from tests.integration.support import BOB_KEY, MODEL, auth, chat_body, forwarded, gateway_settings, metric

CHAT = "/v1/chat/completions"
ADMIN = "admin-token-0123456789"
ADMIN_AUTH = {"authorization": f"Bearer {ADMIN}"}
CANARY = "CNRY-ALICE-SECRET-PAGES"
PREFILL_KV = 256  # behind a 2048-token window, as the incident's 681,280 behind 1,048,576
DECODE_KV = 4096


class Deployment:
    """A disaggregated simulator: the router's URL, and each stage's."""

    def __init__(self, stack: ExitStack, tokenizer_dir: Path, **config: Any) -> None:
        app = create_sim_app(SimConfig(tokenizer_dir=tokenizer_dir, output_tokens=64, **config))
        self.router: str = stack.enter_context(run_server(app))
        self.stages: dict[str, str] = {role: stack.enter_context(run_server(a)) for role, a in app.state.stages.items()}

    def declared(self) -> list[dict[str, str]]:
        return [{"role": role, "url": url} for role, url in self.stages.items()]

    def stale_replies(self) -> float:
        return metric(httpx.get(f"{self.router}/metrics").text, "sim:stale_kv_replies_total")


def start_gateway(stack: ExitStack, tokenizer_dir: Path, backend: dict[str, Any], **overrides: Any) -> str:
    upstream = {"health_interval_s": 0.2, "capacity_refresh_s": 0.2, **overrides.pop("upstream", {})}
    settings = gateway_settings(
        {"pd": backend["url"]},
        tokenizer_dir,
        admin_token=ADMIN,
        backends=[{"name": "pd", **backend}],
        upstream=upstream,
        **overrides,
    )
    url: str = stack.enter_context(run_server(create_app(settings), settings.edge))
    return url


def fill_cache_with_alices_secret(gateway: str) -> None:
    body = chat_body(f"Remember {CANARY} for later. " * 3, max_tokens=4)
    assert httpx.post(f"{gateway}{CHAT}", json=body, headers=auth()).status_code == 200


def over_prefill() -> dict[str, Any]:
    """Over the prefill pool's 256 tokens, well inside the 2048-token window the router advertises."""
    return chat_body("Summarise this contract clause by clause. " * 45, max_tokens=48)


def capacity(gateway: str) -> dict[str, Any]:
    view: dict[str, Any] = httpx.get(f"{gateway}/admin/capacity", headers=ADMIN_AUTH).json()
    return view


def wait_for(condition: Any, what: str, timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@pytest.fixture(scope="module")
def incident(tokenizer_dir: Path) -> Iterator[tuple[Deployment, str, str]]:
    """The incident's deployment, and two gateways in front of it: one blind to its stages, one told them."""
    with ExitStack() as stack:
        deployment = Deployment(
            stack, tokenizer_dir, prefill_kv_tokens=PREFILL_KV, decode_kv_tokens=DECODE_KV, fault="stale-kv"
        )
        blind = start_gateway(stack, tokenizer_dir, {"url": deployment.router})
        told = start_gateway(stack, tokenizer_dir, {"url": deployment.router, "stages": deployment.declared()})
        wait_for(lambda: capacity(told)["models"][0]["limit"] is not None, "the stages' first read")
        yield deployment, blind, told


def test_the_incident_replayed_leaks_with_no_stages_declared(incident: tuple[Deployment, str, str]) -> None:
    deployment, blind, _ = incident
    before = deployment.stale_replies()
    fill_cache_with_alices_secret(blind)
    response = httpx.post(f"{blind}{CHAT}", json=over_prefill(), headers=auth(BOB_KEY))
    # The router advertised 2,048 tokens, so the gateway forwarded; the engine answered from stale pages, and only
    # the answer's checks kept alice's words from bob.
    assert deployment.stale_replies() == before + 1
    assert response.status_code == 502 and response.json()["error"]["code"] == "answer_withheld"
    assert CANARY not in response.text


def test_with_its_stages_declared_the_over_long_prompt_never_leaves(incident: tuple[Deployment, str, str]) -> None:
    deployment, _, told = incident
    before = deployment.stale_replies()
    httpx.delete(f"{deployment.router}/sim/requests").raise_for_status()
    fill_cache_with_alices_secret(told)
    response = httpx.post(f"{told}{CHAT}", json=over_prefill(), headers=auth(BOB_KEY))
    assert response.status_code == 400
    error = response.json()["error"]
    assert error["code"] == "context_length_exceeded" and error["param"] == "messages"
    assert f"at most {PREFILL_KV} tokens" in error["message"] and "prefill stage 'prefill-0'" in error["message"]
    assert deployment.stale_replies() == before
    assert len(forwarded(deployment.router)) == 1, "only alice's request reached the router"


def test_a_prompt_that_fits_the_prefill_pool_is_served(incident: tuple[Deployment, str, str]) -> None:
    _, _, told = incident
    response = httpx.post(f"{told}{CHAT}", json=chat_body("Hello there", max_tokens=8), headers=auth(BOB_KEY))
    assert response.status_code == 200


def test_the_capacity_view_and_metrics_name_the_stage_that_sets_the_limit(
    incident: tuple[Deployment, str, str],
) -> None:
    deployment, blind, told = incident
    [model] = capacity(told)["models"]
    assert model["limit"]["tokens"] == 2048 and model["longest_prompt"] == PREFILL_KV
    assert model["prompt_limit"] == {
        "tokens": PREFILL_KV,
        "set_by": f"the KV cache of prefill stage 'prefill-0' of backend 'pd' ({PREFILL_KV // 16} blocks × 16), "
        "which holds a prompt",
        "reason": "prefill_kv_capacity",
        "stage": "pd/prefill-0",
    }
    [backend] = capacity(told)["backends"]
    assert backend["kv_capacity_tokens"] is None, "the router holds no KV"
    stages = {stage["role"]: stage for stage in backend["stages"]}
    assert stages["prefill"]["kv_capacity_tokens"] == PREFILL_KV and stages["prefill"]["sets_limit"]
    assert stages["decode"]["kv_capacity_tokens"] == DECODE_KV and not stages["decode"]["sets_limit"]
    assert stages["prefill"]["url"] == deployment.stages["prefill"] and stages["prefill"]["readable"]
    text = httpx.get(f"{told}/metrics").text
    assert metric(text, "bulkhead_stage_kv_capacity_tokens", stage="prefill-0", role="prefill") == PREFILL_KV
    assert metric(text, "bulkhead_stage_sets_limit", stage="prefill-0") == 1
    assert metric(text, "bulkhead_stage_sets_limit", stage="decode-0") == 0
    assert metric(text, "bulkhead_model_prompt_limit_tokens", model=MODEL) == PREFILL_KV
    # The blind gateway holds prompts to the window: the incident's hole, in its own numbers.
    assert metric(httpx.get(f"{blind}/metrics").text, "bulkhead_model_prompt_limit_tokens", model=MODEL) == 2047


def test_the_decode_pool_bounds_prompt_and_output(tokenizer_dir: Path) -> None:
    with ExitStack() as stack:
        deployment = Deployment(stack, tokenizer_dir, prefill_kv_tokens=1024, decode_kv_tokens=512)
        gateway = start_gateway(stack, tokenizer_dir, {"url": deployment.router, "stages": deployment.declared()})
        wait_for(lambda: capacity(gateway)["models"][0]["limit"] is not None, "the stages' first read")
        body = chat_body("Summarise this contract clause by clause. " * 20, max_tokens=400)
        response = httpx.post(f"{gateway}{CHAT}", json=body, headers=auth())
        assert response.status_code == 400
        message = response.json()["error"]["message"]
        assert "the limit is 512 tokens" in message and "decode stage 'decode-0'" in message
        assert forwarded(deployment.router) == []
        body["max_tokens"] = 64
        fits = httpx.post(f"{gateway}{CHAT}", json=body, headers=auth())
        assert fits.status_code == 200, fits.text


@pytest.mark.parametrize("on_stage_unread", ["last_known", "refuse"])
def test_a_stage_that_goes_down_makes_the_gateway_degraded_and_never_lifts_the_limit(
    tokenizer_dir: Path, on_stage_unread: str
) -> None:
    with ExitStack() as stack:
        app = create_sim_app(SimConfig(tokenizer_dir=tokenizer_dir, prefill_kv_tokens=PREFILL_KV))
        router = stack.enter_context(run_server(app))
        decode = stack.enter_context(run_server(app.state.stages["decode"]))
        with ExitStack() as prefill_stack:
            prefill = prefill_stack.enter_context(run_server(app.state.stages["prefill"]))
            stages = [{"role": "prefill", "url": prefill}, {"role": "decode", "url": decode}]
            gateway = start_gateway(
                stack, tokenizer_dir, {"url": router, "stages": stages}, upstream={"on_stage_unread": on_stage_unread}
            )
            wait_for(lambda: capacity(gateway)["models"][0]["longest_prompt"] == PREFILL_KV, "the first read")
        wait_for(lambda: "stage:pd/prefill-0" in httpx.get(f"{gateway}/readyz").json()["degraded"], "readiness")
        readiness = httpx.get(f"{gateway}/readyz")
        assert readiness.status_code == 200, "degraded, still serving"
        [problem] = [p for p in readiness.json()["problems"] if p.startswith("stage pd/prefill-0")]
        [stage] = [s for s in capacity(gateway)["backends"][0]["stages"] if s["role"] == "prefill"]
        assert not stage["readable"] and stage["problem"].startswith("not read")
        assert metric(httpx.get(f"{gateway}/metrics").text, "bulkhead_stage_readable", stage="prefill-0") == 0
        short = httpx.post(f"{gateway}{CHAT}", json=chat_body(max_tokens=8), headers=auth())
        over = httpx.post(f"{gateway}{CHAT}", json=over_prefill(), headers=auth())
        if on_stage_unread == "last_known":
            # The limit it last set still holds: never the window.
            assert f"last known KV capacity ({PREFILL_KV} tokens)" in problem
            assert short.status_code == 200 and over.status_code == 400
        else:
            assert "refuse requests (503 capacity_unknown)" in problem
            for refused in (short, over):
                assert refused.status_code == 503 and refused.json()["error"]["code"] == "capacity_unknown"
        assert len(forwarded(router)) == (1 if on_stage_unread == "last_known" else 0)


def test_a_stage_never_read_refuses_rather_than_fall_back_to_the_window(tokenizer_dir: Path) -> None:
    with ExitStack() as stack:
        deployment = Deployment(stack, tokenizer_dir, prefill_kv_tokens=PREFILL_KV)
        closed = "http://127.0.0.1:9"  # the discard port: nothing listens there
        stages = [{"role": "prefill", "url": closed}, {"role": "decode", "url": deployment.stages["decode"]}]
        gateway = start_gateway(stack, tokenizer_dir, {"url": deployment.router, "stages": stages})
        response = httpx.post(f"{gateway}{CHAT}", json=chat_body(max_tokens=8), headers=auth())
        assert response.status_code == 503
        error = response.json()["error"]
        assert error["code"] == "capacity_unknown" and "stage 'prefill-0' of backend 'pd'" in error["message"]
        assert forwarded(deployment.router) == []


def test_a_stage_shrunk_at_runtime_lowers_the_limit_at_the_next_read(tokenizer_dir: Path) -> None:
    with ExitStack() as stack:
        deployment = Deployment(stack, tokenizer_dir, prefill_kv_tokens=1024)
        gateway = start_gateway(stack, tokenizer_dir, {"url": deployment.router, "stages": deployment.declared()})
        wait_for(lambda: capacity(gateway)["models"][0]["longest_prompt"] == 1024, "the first read")
        assert httpx.post(f"{gateway}{CHAT}", json=over_prefill(), headers=auth()).status_code == 200
        shrunk = httpx.put(f"{deployment.stages['prefill']}/sim/capacity", json={"kv_tokens": PREFILL_KV})
        assert shrunk.status_code == 200
        wait_for(lambda: capacity(gateway)["models"][0]["longest_prompt"] == PREFILL_KV, "the shrunk pool's read")
        assert httpx.post(f"{gateway}{CHAT}", json=over_prefill(), headers=auth()).status_code == 400


def test_an_sglang_backend_is_read_salted_and_its_errors_relayed(tokenizer_dir: Path) -> None:
    with ExitStack() as stack:
        # 16 blocks: 256 tokens of KV under a 2048-token window, and the gateway told not to cap at the KV, so that
        # SGLang's own refusal of an input over its pool is what the client hears.
        app = create_sim_app(SimConfig(tokenizer_dir=tokenizer_dir, engine="sglang", num_gpu_blocks=16))
        sim = stack.enter_context(run_server(app))
        gateway = start_gateway(stack, tokenizer_dir, {"url": sim, "kind": "sglang"})
        wait_for(lambda: capacity(gateway)["backends"][0]["kv_capacity_tokens"] == 256, "the /server_info read")
        [backend] = capacity(gateway)["backends"]
        assert backend["kind"] == "sglang" and backend["max_model_len"] == 2048
        assert capacity(gateway)["models"][0]["limit"]["reason"] == "kv_capacity"
        served = httpx.post(f"{gateway}{CHAT}", json=chat_body(max_tokens=8), headers=auth())
        assert served.status_code == 200, served.text
        [sent] = forwarded(sim)
        assert isinstance(sent["body"]["cache_salt"], str) and sent["body"]["cache_salt"]
        wait_for(lambda: "bulkhead_replica_requests_running{" in httpx.get(f"{gateway}/metrics").text, "a load read")

    with ExitStack() as stack:
        app = create_sim_app(SimConfig(tokenizer_dir=tokenizer_dir, engine="sglang", num_gpu_blocks=16))
        sim = stack.enter_context(run_server(app))
        model = {"name": MODEL, "backends": ["pd"], "tokenizer": str(tokenizer_dir), "limit_by_kv_capacity": False}
        gateway = start_gateway(stack, tokenizer_dir, {"url": sim, "kind": "sglang"}, models=[model])
        wait_for(lambda: capacity(gateway)["models"][0]["limit"] is not None, "the first read")
        refused = httpx.post(f"{gateway}{CHAT}", json=over_prefill(), headers=auth())
        assert refused.status_code == 400
        error = refused.json()["error"]
        assert error["type"] == "invalid_request_error" and error["code"] == "backend_rejected"
        assert "exceeds the maximum allowed length" in error["message"]


def test_an_sglang_model_without_a_tokenizer_is_refused_at_start(tokenizer_dir: Path) -> None:
    with pytest.raises(ValueError, match="cannot count a chat prompt: give the model its tokenizer"):
        gateway_settings(
            {"pd": "http://127.0.0.1:9"},
            tokenizer_dir,
            backends=[{"name": "pd", "url": "http://127.0.0.1:9", "kind": "sglang"}],
            models=[{"name": MODEL, "backends": ["pd"]}],
        )


def test_an_sglang_engine_declared_as_vllm_is_named_in_the_log(
    tokenizer_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with ExitStack() as stack:
        sim = stack.enter_context(run_server(create_sim_app(SimConfig(tokenizer_dir=tokenizer_dir, engine="sglang"))))
        gateway = start_gateway(stack, tokenizer_dir, {"url": sim})
        wait_for(lambda: "set its kind: sglang" in caplog.text, "the warning")
        assert capacity(gateway)["backends"][0]["kv_capacity_tokens"] is None, "no vLLM cache config to read"
