"""`bulkhead audit --stage ROLE=URL`: the engines behind a disaggregated router, whose KV caches the router does
not show. Each stage's capacity is read from the engine (vLLM's /metrics, SGLang's /get_server_info), stated
against the window in the report, and the over-length probe aims at the gap between them.

First the parsing and the report with fake stages (MockTransport), then the audit against the simulator's
disaggregated mode: a router advertising a 2,048-token window over a prefill pool of 1,984 tokens, a gap the
router's own answers cannot reveal.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import orjson
import pytest
from rich.console import Console

from gateway.server.serving import run_server
from isolation.audit import AuditConfig, discovery, overlength, run_audit
from isolation.audit.budget import Budget
from isolation.audit.canaries import CanaryBook
from isolation.audit.command import add_arguments, config_from
from isolation.audit.config import Stage, make_identities, parse_stages
from isolation.audit.context import ProbeContext, Quiet
from isolation.audit.discovery import UNKNOWN_CAPACITY, EndpointFacts, discover
from isolation.audit.endpoint import Endpoint
from isolation.audit.errors import StageUnreadable
from isolation.audit.prompts import PromptBuilder
from isolation.audit.render import print_report
from isolation.audit.report import Report
from isolation.audit.stages import StageCapacity, parse_worker_list, read_stage
from isolation.engine_reports import parse_server_info, vllm_cache_tokens
from isolation.sim import SimConfig, create_sim_app

MODEL = "tiny-llama"
WINDOW = 1_048_576
PREFILL = Stage("prefill", "prefill-0", "http://prefill:8000")
DECODE = Stage("decode", "decode-0", "http://decode:8000")


def cache_info(blocks: int, block_size: int = 16, engine: str = "0") -> str:
    return (
        "# TYPE vllm:cache_config_info gauge\n"
        f'vllm:cache_config_info{{block_size="{block_size}",engine="{engine}",num_gpu_blocks="{blocks}"}} 1.0\n'
    )


Routes = dict[str, Callable[[httpx.Request], httpx.Response]]


def stage_endpoint(routes: Routes, seen: list[httpx.Request] | None = None) -> Endpoint:
    """A stage answering `routes` by path, 404 elsewhere; every request it gets lands in `seen`."""

    def handle(request: httpx.Request) -> httpx.Response:
        if seen is not None:
            seen.append(request)
        route = routes.get(request.url.path)
        return route(request) if route else httpx.Response(404, json={"detail": "Not Found"})

    client = httpx.AsyncClient(transport=httpx.MockTransport(handle))
    return Endpoint(client, "http://stage:8000", MODEL, Budget(100, 60, 1000))


def metrics(text: str) -> Callable[[httpx.Request], httpx.Response]:
    return lambda request: httpx.Response(200, text=text)


def info(body: object) -> Callable[[httpx.Request], httpx.Response]:
    return lambda request: httpx.Response(200, json=body)


# --- the command line ------------------------------------------------------------------------------------------


def test_stages_are_named_by_role_in_the_order_given() -> None:
    stages = parse_stages(
        ["prefill=http://p0:8000/v1", "decode=http://d0:8001/", "Prefill=https://p1:8000", "decode=http://d1"]
    )

    assert stages == (
        Stage("prefill", "prefill-0", "http://p0:8000"),
        Stage("decode", "decode-0", "http://d0:8001"),
        Stage("prefill", "prefill-1", "https://p1:8000"),
        Stage("decode", "decode-1", "http://d1"),
    )


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("http://p0:8000", "ROLE=URL with ROLE prefill or decode"),
        ("router=http://p0:8000", "ROLE=URL with ROLE prefill or decode"),
        ("prefill=p0:8000", "must be http:// or https://"),
        ("decode=", "must be http:// or https://"),
    ],
)
def test_a_malformed_stage_is_refused_by_the_command_line(spec: str, message: str) -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--endpoint", "http://router:8000", "--model", MODEL, "--stage", spec])

    with pytest.raises(ValueError, match=message):
        config_from(args)


def test_the_command_line_takes_stages() -> None:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(
        [
            "--endpoint",
            "http://router:8000",
            "--model",
            MODEL,
            "--stage",
            "prefill=http://p:1",
            "--stage",
            "decode=http://d:2",
        ]
    )

    assert config_from(args).stages == (
        Stage("prefill", "prefill-0", "http://p:1"),
        Stage("decode", "decode-0", "http://d:2"),
    )


# --- reading a stage ---------------------------------------------------------------------------------------------


def test_vllm_cache_info_gives_the_smallest_engine() -> None:
    exposition = cache_info(42_580, 16, "0") + cache_info(40_000, 16, "1") + "vllm:num_requests_running 0.0\n"

    assert vllm_cache_tokens(exposition) == 640_000
    assert vllm_cache_tokens("vllm:num_requests_running 0.0\n") is None


def test_sglang_server_info_gives_the_smallest_rank() -> None:
    body = {
        "context_length": WINDOW,
        "max_total_num_tokens": 700_000,
        "internal_states": [{"max_total_num_tokens": 681_280}, {"max_total_num_tokens": 690_000}, "junk"],
    }

    assert parse_server_info(body) == (681_280, WINDOW)
    assert parse_server_info({"internal_states": [{"max_total_num_tokens": 5}]}) == (5, None)
    assert parse_server_info({"max_total_num_tokens": True}) == (None, None)
    assert parse_server_info(["not", "a", "dict"]) == (None, None)


async def test_a_vllm_stage_is_read_from_its_metrics() -> None:
    endpoint = stage_endpoint({"/metrics": metrics(cache_info(42_580))})

    held = await read_stage(endpoint, PREFILL, make_identities(())[0])

    assert (held.kv_capacity, held.context_length) == (681_280, None)
    assert held.source == "GET http://prefill:8000/metrics vllm:cache_config_info (num_gpu_blocks × block_size)"


async def test_an_sglang_stage_is_read_from_its_server_info_or_the_later_route() -> None:
    body = {"context_length": WINDOW, "max_total_num_tokens": 681_280}
    older = stage_endpoint({"/metrics": metrics("sglang:num_running_reqs 0\n"), "/get_server_info": info(body)})
    seen: list[httpx.Request] = []
    later = stage_endpoint({"/server_info": info(body)}, seen)  # no /metrics (no --enable-metrics) either
    identity = make_identities(())[0]

    first = await read_stage(older, DECODE, identity)
    second = await read_stage(later, DECODE, identity)

    assert (first.kv_capacity, first.context_length) == (681_280, WINDOW)
    assert first.source == "GET http://decode:8000/get_server_info max_total_num_tokens"
    assert (second.kv_capacity, second.source) == (681_280, "GET http://decode:8000/server_info max_total_num_tokens")
    assert [request.url.path for request in seen] == ["/metrics", "/get_server_info", "/server_info"]


async def test_a_stage_gets_the_key_only_when_it_refuses_without_one() -> None:
    seen: list[httpx.Request] = []

    def guarded(request: httpx.Request) -> httpx.Response:
        if request.headers.get("authorization") != "Bearer sk-stage":
            return httpx.Response(401, json={"error": "Unauthorized"})
        return httpx.Response(200, json={"max_total_num_tokens": 1000})

    endpoint = stage_endpoint({"/metrics": guarded, "/get_server_info": guarded}, seen)

    held = await read_stage(endpoint, PREFILL, make_identities(("sk-stage",))[0])

    assert held.kv_capacity == 1000
    assert [(r.url.path, "authorization" in r.headers) for r in seen] == [
        ("/metrics", False),
        ("/metrics", True),
        ("/get_server_info", False),
        ("/get_server_info", True),
    ]


async def test_a_stage_that_says_nothing_stops_the_audit_by_name() -> None:
    endpoint = stage_endpoint({"/metrics": metrics("vllm:num_requests_running 0.0\n")})

    with pytest.raises(StageUnreadable) as caught:
        await read_stage(endpoint, PREFILL, make_identities(())[0])

    message = str(caught.value)
    assert message.startswith("prefill stage prefill-0 (http://prefill:8000) does not say how much KV cache it holds")
    assert (
        "GET /metrics: no vllm:cache_config_info; GET /get_server_info: HTTP 404; GET /server_info: HTTP 404" in message
    )
    assert "cannot vouch" in message


async def test_an_unreachable_stage_stops_the_audit_by_name() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    client = httpx.AsyncClient(transport=httpx.MockTransport(refuse))
    endpoint = Endpoint(client, "http://decode:8000", MODEL, Budget(100, 60, 1000))

    with pytest.raises(
        StageUnreadable, match=r"^decode stage decode-0 \(http://decode:8000\) is unreachable: GET /metrics"
    ):
        await read_stage(endpoint, DECODE, make_identities(())[0])


# --- the facts, the probe's sizes, the report --------------------------------------------------------------------


def facts(*stages: tuple[Stage, int], kv: int | None = None) -> EndpointFacts:
    held = tuple(
        StageCapacity(stage, tokens, f"GET {stage.url}/metrics vllm:cache_config_info") for stage, tokens in stages
    )
    return EndpointFacts(WINDOW, "/v1/models max_model_len", kv, "/metrics" if kv else None, stages=held)


def context(of: EndpointFacts) -> ProbeContext:
    endpoint = stage_endpoint({})
    identities = make_identities(())
    rng = random.Random(1)
    return ProbeContext(
        endpoint,
        of,
        identities,
        PromptBuilder(endpoint, identities[0], False, rng),
        CanaryBook(identities),
        rng,
        1,
        64,
        Quiet(),
    )


def test_the_effective_limit_is_the_smallest_prefill_stage_and_decode_bounds_prompt_and_answer() -> None:
    prefill_1 = Stage("prefill", "prefill-1", "http://prefill-1:8000")
    known = facts((PREFILL, 700_000), (prefill_1, 681_280), (DECODE, 900_000))

    assert known.effective_limit == 681_280
    assert known.prompt_bound is not None and known.prompt_bound.what == "prefill stage prefill-1's KV cache"
    assert known.decode_bound is not None and known.decode_bound.kv_capacity == 900_000
    assert facts((PREFILL, 681_280), kv=500_000).effective_limit == 500_000  # the endpoint's own cache is smaller
    assert facts((DECODE, 500_000)).effective_limit == WINDOW  # decode bounds prompt and answer, not the prompt
    assert facts((PREFILL, 2 * WINDOW)).effective_limit == WINDOW


def test_each_stage_is_stated_against_the_window() -> None:
    known = facts((PREFILL, 681_280), (DECODE, 900_000), (Stage("decode", "decode-1", "http://d1"), 2_000_000))

    assert [known.stage_statement(held) for held in known.stages] == [
        "the window is 1048576 tokens, prefill stage prefill-0 holds 681280: prompts between them are unsafe",
        "the window is 1048576 tokens, decode stage decode-0 holds 900000: a prompt and its answer together over "
        "900000 tokens are unsafe",
        "the window is 1048576 tokens, decode stage decode-1 holds 2000000: the whole window fits",
    ]


def test_the_over_length_probe_aims_at_each_stage_gap() -> None:
    sizes = overlength._sizes(context(facts((PREFILL, 681_280), (DECODE, 900_000))))

    assert sizes == [
        ("limit-1", WINDOW - 1),
        ("limit", WINDOW),
        ("limit+1", WINDOW + 1),
        ("2×limit", 2 * WINDOW),
        ("prefill-0 capacity+1", 681_281),
        ("decode-0 capacity+1", 900_001),
    ]
    assert overlength._sizes(context(facts())) == sizes[:4]


UNSAFE = "prompts between them are unsafe"


def test_the_report_states_each_stage_in_json_and_text() -> None:
    report = Report("http://router:8000", MODEL, "no API key", 7, "2025-01-01T00:00:00+00:00")
    report.facts = facts((PREFILL, 681_280), (DECODE, 900_000))

    data = orjson.loads(orjson.dumps(report.to_json()))["endpoint_facts"]
    console = Console(width=200, record=True, highlight=False)
    print_report(report, console)
    text = console.export_text()

    assert (data["effective_limit"], data["decode_limit"]) == (681_280, 900_000)
    assert data["stages"][0] == {
        "name": "prefill-0",
        "role": "prefill",
        "url": "http://prefill:8000",
        "kv_capacity": 681_280,
        "kv_capacity_source": "GET http://prefill:8000/metrics vllm:cache_config_info",
        "context_length": None,
        "statement": f"the window is 1048576 tokens, prefill stage prefill-0 holds 681280: {UNSAFE}",
    }
    assert "KV cache   : not exposed by the endpoint" in text
    assert "stage      : the window is 1048576 tokens, prefill stage prefill-0 holds 681280: prompts between" in text


def test_without_stages_the_unknown_capacity_is_a_note() -> None:
    assert "--stage ROLE=URL" in UNKNOWN_CAPACITY


# --- discovery through a router ----------------------------------------------------------------------------------


def router_client(workers: object = None, stage_metrics: dict[str, str] | None = None) -> httpx.AsyncClient:
    """A router at http://router advertising a 2048-token window with no KV cache of its own, answering chats;
    `workers` its GET /workers body (404 when None); the stages' /metrics by host (404 elsewhere)."""
    stage_metrics = stage_metrics or {}

    def handle(request: httpx.Request) -> httpx.Response:
        host, path = request.url.host, request.url.path
        if host != "router":
            text = stage_metrics.get(host)
            return httpx.Response(200, text=text) if path == "/metrics" and text else httpx.Response(404)
        if path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": MODEL, "max_model_len": 2048}]})
        if path == "/metrics":
            return httpx.Response(200, text="vllm:num_requests_running 0.0\n")
        if path == "/workers" and workers is not None:
            return httpx.Response(200, json=workers)
        if path == "/v1/chat/completions":
            return httpx.Response(
                200, json={"choices": [{"message": {"content": "ok"}}], "usage": {"prompt_tokens": 5}}
            )
        return httpx.Response(404)

    return httpx.AsyncClient(transport=httpx.MockTransport(handle))


async def discover_through(client: httpx.AsyncClient, stages: tuple[Stage, ...] = ()) -> EndpointFacts:
    endpoint = Endpoint(client, "http://router", MODEL, Budget(100, 60, 1000))
    return await discover(endpoint, make_identities(()), None, stages)


async def test_named_stages_set_the_effective_limit() -> None:
    client = router_client(stage_metrics={"p0": cache_info(100), "d0": cache_info(64)})

    found = await discover_through(client, parse_stages(["prefill=http://p0", "decode=http://d0"]))

    assert (found.limit, found.kv_capacity, found.effective_limit) == (2048, None, 1600)
    assert [(held.stage.name, held.kv_capacity) for held in found.stages] == [("prefill-0", 1600), ("decode-0", 1024)]
    assert UNKNOWN_CAPACITY not in found.notes


async def test_a_named_stage_that_cannot_be_read_stops_discovery() -> None:
    with pytest.raises(StageUnreadable, match=r"^prefill stage prefill-0 \(http://p0\) does not say"):
        await discover_through(router_client(), parse_stages(["prefill=http://p0"]))


async def test_without_stages_a_router_s_kv_capacity_is_unknown() -> None:
    found = await discover_through(router_client())

    assert (found.effective_limit, found.stages, found.prompt_bound) == (2048, (), None)
    assert UNKNOWN_CAPACITY in found.notes


async def test_the_stages_an_sglang_router_lists_are_read() -> None:
    workers = {
        "workers": [
            {"url": "http://p0:30000", "worker_type": "prefill", "is_healthy": True},
            {"url": "http://d0:30001", "worker_type": {"Decode": None}},
            {"url": "grpc://p1:20000", "worker_type": "prefill"},  # not over HTTP: not read
            {"url": "http://r0:8000", "worker_type": "regular"},
            "junk",
        ],
        "stats": {"prefill_count": 2, "decode_count": 1, "regular_count": 1},
    }
    client = router_client(workers, {"p0": cache_info(100), "d0": cache_info(64)})

    found = await discover_through(client)

    assert [(held.stage.name, held.stage.url, held.kv_capacity) for held in found.stages] == [
        ("prefill-0", "http://p0:30000", 1600),
        ("decode-0", "http://d0:30001", 1024),
    ]
    assert found.effective_limit == 1600
    assert (
        "stages listed by the router (GET /workers): prefill-0 http://p0:30000, decode-0 http://d0:30001" in found.notes
    )


async def test_a_listed_stage_out_of_reach_is_a_note_not_an_error() -> None:
    workers = {"workers": [{"url": "http://p0:30000", "worker_type": "prefill"}]}

    found = await discover_through(router_client(workers))

    assert found.stages == () and UNKNOWN_CAPACITY in found.notes
    assert any(note.startswith("prefill stage prefill-0 (http://p0:30000) does not say") for note in found.notes)
    assert parse_worker_list({"urls": ["http://p0:30000"]}) == ()  # the older /list_workers shape has no roles


# --- against the simulator's disaggregated mode --------------------------------------------------------------------

GAP = {"prefill_kv_tokens": 1984, "fault": "stale-kv"}  # the window admits 64 tokens the prefill pool cannot hold
STATEMENT = "the window is 2048 tokens, prefill stage prefill-0 holds 1984: prompts between them are unsafe"


class Deployment:
    def __init__(self, router: str, stages: dict[str, str], app: Any) -> None:
        self.router, self.stages, self.app = router, stages, app

    def stage_args(self) -> tuple[Stage, ...]:
        return parse_stages([f"{role}={url}" for role, url in self.stages.items()])


DeploymentFactory = Callable[..., Deployment]


@pytest.fixture(scope="module")
def deploy(tokenizer_dir: Path) -> Iterator[DeploymentFactory]:
    """A disaggregated simulator (router and both stages on ports of their own) per configuration, started once
    for the module."""
    started: dict[str, Deployment] = {}
    with ExitStack() as stack:

        def start(**overrides: Any) -> Deployment:
            key = repr(sorted(overrides.items()))
            if key not in started:
                app = create_sim_app(SimConfig(tokenizer_dir=tokenizer_dir, **overrides))
                router = stack.enter_context(run_server(app))
                stages = {role: stack.enter_context(run_server(stage)) for role, stage in app.state.stages.items()}
                started[key] = Deployment(router, stages, app)
            return started[key]

        yield start


async def audit(endpoint: str, **overrides: Any) -> Report:
    config = AuditConfig(endpoint=endpoint, model=MODEL, **{"rate": 200.0, "seed": 7, "rounds": 2, **overrides})
    async with httpx.AsyncClient() as client:
        return await run_audit(config, client)


def by_probe(report: Report) -> dict[str, list[dict[str, Any]]]:
    findings: dict[str, list[dict[str, Any]]] = {}
    for finding in report.to_json()["findings"]:
        findings.setdefault(finding["probe"], []).append(finding)
    return findings


async def test_without_stages_the_router_hides_the_gap(deploy: DeploymentFactory) -> None:
    report = await audit(deploy(**GAP).router)

    assert report.facts is not None
    assert (report.facts.limit, report.facts.kv_capacity, report.facts.stages) == (2048, None, ())
    assert UNKNOWN_CAPACITY in report.facts.notes  # the audit says what it could not see
    assert not report.findings, report.to_json()["findings"]  # ... and so cannot see the leak


def test_with_its_stages_the_audit_finds_the_leak_in_the_gap(deploy: DeploymentFactory, tmp_path: Path) -> None:
    sim = deploy(**GAP)
    path = tmp_path / "report.json"
    stages = [arg for role, url in sim.stages.items() for arg in ("--stage", f"{role}={url}")]
    command = [sys.executable, "-m", "gateway", "audit", "--model", MODEL, "--endpoint", sim.router, *stages]
    done = subprocess.run(
        [*command, "--json", str(path), "--rate", "200", "--seed", "7", "--rounds", "2"],
        capture_output=True,
        text=True,
        timeout=90,
    )

    assert done.returncode == 1, done.stdout + done.stderr
    report = json.loads(path.read_text())
    facts = report["endpoint_facts"]
    assert (facts["limit"], facts["kv_capacity"], facts["effective_limit"]) == (2048, None, 1984)
    assert [(s["name"], s["kv_capacity"], s["statement"]) for s in facts["stages"]] == [
        ("prefill-0", 1984, STATEMENT),
        ("decode-0", 4096, "the window is 2048 tokens, decode stage decode-0 holds 4096: the whole window fits"),
    ]
    overlong = [finding for finding in report["findings"] if finding["probe"] == "over-length"]
    assert overlong and all(finding["severity"] == "critical" for finding in overlong)
    gap = [f for f in overlong if "larger than prefill stage prefill-0's KV cache (1984 tokens)" in f["title"]]
    assert gap and all(1984 < f["sent"]["prompt_tokens"] <= 2048 for f in gap)
    assert gap[0]["received"]["usage"]["prompt_tokens"] == 1  # answered from stale pages
    assert STATEMENT in done.stdout and "FINDINGS" in done.stdout


async def test_an_sglang_deployment_s_stages_are_read_from_server_info(deploy: DeploymentFactory) -> None:
    sim = deploy(**GAP, engine="sglang")

    report = await audit(sim.router, stages=sim.stage_args())

    assert report.facts is not None and report.facts.effective_limit == 1984
    assert [held.source for held in report.facts.stages] == [
        f"GET {sim.stages['prefill']}/get_server_info max_total_num_tokens",
        f"GET {sim.stages['decode']}/get_server_info max_total_num_tokens",
    ]
    assert any(f["severity"] == "critical" for f in by_probe(report)["over-length"])


async def test_a_decode_stage_smaller_than_the_window_is_probed_with_its_answer(deploy: DeploymentFactory) -> None:
    sim = deploy(decode_kv_tokens=1024, fault="stale-kv")

    report = await audit(sim.router, stages=sim.stage_args())

    assert report.facts is not None and report.facts.effective_limit == 2048  # the prefill pool holds the window
    decode = report.to_json()["endpoint_facts"]["stages"][1]
    assert decode["statement"] == (
        "the window is 2048 tokens, decode stage decode-0 holds 1024: a prompt and its answer together over 1024 "
        "tokens are unsafe"
    )
    titles = [f["title"] for f in by_probe(report)["over-length"] if f["severity"] == "critical"]
    assert any("more than decode stage decode-0's KV cache holds (1024 tokens)" in title for title in titles), titles


async def test_a_healthy_deployment_with_its_stages_is_clean(deploy: DeploymentFactory) -> None:
    sim = deploy(prefill_kv_tokens=1984, decode_kv_tokens=1024)

    report = await audit(sim.router, stages=sim.stage_args())

    assert report.exit_code == 0, report.to_json()["findings"]
    assert report.facts is not None and report.facts.effective_limit == 1984


async def test_a_stage_that_is_not_an_engine_cannot_run(deploy: DeploymentFactory) -> None:
    sim = deploy(**GAP)

    report = await audit(sim.router, stages=parse_stages([f"prefill={sim.router}"]))

    assert (report.verdict, report.exit_code) == ("could not run", 2)
    assert report.error is not None
    assert report.error.startswith(f"prefill stage prefill-0 ({sim.router}) does not say how much KV cache it holds")


async def test_no_key_goes_to_a_stage_the_router_lists() -> None:
    seen: list[httpx.Request] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        if request.url.host == "router" and request.url.path == "/workers":
            return httpx.Response(200, json={"workers": [{"url": "http://p0:30000", "worker_type": "prefill"}]})
        return httpx.Response(401, json={"error": "Unauthorized"})

    endpoint = Endpoint(
        httpx.AsyncClient(transport=httpx.MockTransport(handle)), "http://router", MODEL, Budget(9, 60, 1000)
    )
    notes: list[str] = []

    assert await discovery._listed(endpoint, make_identities(("sk-router",))[0], notes) == []
    assert [r.url.host for r in seen if "authorization" in r.headers] == ["router"]
    assert notes and "GET /metrics: HTTP 401" in notes[0]
