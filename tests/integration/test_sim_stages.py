"""The simulator as a disaggregated deployment (a router in front of a prefill pool and a decode pool, each pool an
endpoint of its own) and as SGLang, over real HTTP; and `bulkhead sim --disaggregated` as a user runs it.

The incident this replays: a router advertised a window its prefill pool's KV cache could not hold, and prompts
between the two were answered from stale pages of earlier requests.
"""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.server.serving import run_server
from isolation.engine_reports import parse_server_info
from isolation.sim import SimConfig, create_sim_app
from tests.integration.support import stop
from tests.integration.test_sim import MODEL, metric, token_count
from tests.integration.test_sim_kv import CANARY, LONG, OVERSIZED, SECRET, chat

WINDOW = 2048
BLOCK = 16


@dataclass(frozen=True)
class Deployment:
    router: str
    prefill: str
    decode: str


@contextmanager
def deployment(tokenizer_dir: Path, **settings: Any) -> Iterator[Deployment]:
    """A router and its two stages, each served on a port of its own, as `bulkhead sim --disaggregated` serves them."""
    app = create_sim_app(SimConfig(tokenizer_dir=tokenizer_dir, **settings))
    with ExitStack() as stack:
        router = stack.enter_context(run_server(app))
        stages = {role: stack.enter_context(run_server(stage)) for role, stage in app.state.stages.items()}
        yield Deployment(router, stages["prefill"], stages["decode"])


@pytest.fixture(scope="module")
def leaky(tokenizer_dir: Path) -> Iterator[Deployment]:
    """The incident: a 256-token prefill pool behind a 2,048-token window, stale-kv."""
    with deployment(tokenizer_dir, prefill_kv_tokens=256, output_tokens=64, fault="stale-kv") as served:
        yield served


@pytest.fixture(scope="module")
def healthy(tokenizer_dir: Path) -> Iterator[Deployment]:
    with deployment(tokenizer_dir, prefill_kv_tokens=256, decode_kv_tokens=1024) as served:
        yield served


@pytest.fixture(scope="module")
def sglang_pools(tokenizer_dir: Path) -> Iterator[Deployment]:
    with deployment(tokenizer_dir, engine="sglang", prefill_kv_tokens=256, decode_kv_tokens=1000) as served:
        yield served


@pytest.fixture(scope="module")
def sglang_url(tokenizer_dir: Path) -> Iterator[str]:
    """One SGLang engine: a 1,024-token KV pool (64 blocks) under a 2,048-token window."""
    with run_server(create_sim_app(SimConfig(tokenizer_dir=tokenizer_dir, engine="sglang", num_gpu_blocks=64))) as url:
        yield url


def cache_infos(url: str) -> list[dict[str, str]]:
    """The labels of each vllm:cache_config_info series the server exports (none for a router)."""
    families = text_string_to_metric_families(httpx.get(f"{url}/metrics").text)
    return [
        dict(sample.labels)
        for family in families
        if family.name == "vllm:cache_config_info"
        for sample in family.samples
    ]


def cache_info(url: str) -> dict[str, str]:
    [labels] = cache_infos(url)
    return labels


def read_metric(url: str, name: str, **labels: str) -> float:
    with httpx.Client(base_url=url) as client:
        return metric(client, name, **labels)


def completion(client: httpx.Client, prompt_tokens: int, **extra: Any) -> httpx.Response:
    return client.post("/v1/completions", json={"model": MODEL, "prompt": [5] * prompt_tokens, **extra})


def put_capacity(url: str, body: object) -> httpx.Response:
    return httpx.put(f"{url}/sim/capacity", json=body)


# The disaggregated deployment, vLLM's flavor.


def test_the_router_answers_a_prompt_between_the_prefill_pool_and_the_window_from_stale_pages(
    leaky: Deployment,
) -> None:
    with httpx.Client(base_url=leaky.router) as client:
        assert chat(client, SECRET, cache_salt="tenant-a").status_code == 200
        prompt_tokens = token_count(client, messages=OVERSIZED)
        assert 256 < prompt_tokens < WINDOW
        leaked = chat(client, OVERSIZED, cache_salt="tenant-b")
        assert leaked.status_code == 200
        body = leaked.json()
        assert CANARY in body["choices"][0]["message"]["content"]
        assert body["usage"]["prompt_tokens"] == 1
        assert metric(client, "sim:stale_kv_replies_total") == 1


def test_a_healthy_router_refuses_it_with_vllms_400_naming_the_prefill_pool(healthy: Deployment) -> None:
    with httpx.Client(base_url=healthy.router) as client:
        prompt_tokens = token_count(client, messages=OVERSIZED)
        refused = chat(client, OVERSIZED)
        assert refused.status_code == 400
        assert refused.json()["error"]["message"] == (
            "This model's maximum context length is 256 tokens. However, your prompt contains at least "
            f"{prompt_tokens} input tokens, which exceeds this limit even without any output tokens. Please reduce "
            f"the length of the input prompt. (parameter=input_tokens, value={prompt_tokens})"
        )
        assert completion(client, 256, max_tokens=16).status_code == 200
        assert completion(client, 257, max_tokens=16).status_code == 400


def test_a_prompt_and_its_output_budget_must_fit_the_decode_pool(healthy: Deployment) -> None:
    with httpx.Client(base_url=healthy.router) as client:
        assert completion(client, 200, max_tokens=824).status_code == 200  # 1,024 exactly
        refused = completion(client, 200, max_tokens=825)
        assert refused.status_code == 400
        assert refused.json()["error"] == {
            "message": "'max_tokens' or 'max_completion_tokens' is too large: 825. This model's maximum context "
            "length is 1024 tokens and your request has 200 input tokens (825 > 1024 - 200). "
            "(parameter=max_tokens, value=825)",
            "type": "BadRequestError",
            "param": "max_tokens",
            "code": 400,
        }


def test_each_stage_says_its_own_pool_and_the_router_only_the_window(healthy: Deployment) -> None:
    assert cache_info(healthy.prefill) == {
        "block_size": "16",
        "cache_dtype": "auto",
        "enable_prefix_caching": "True",
        "gpu_memory_utilization": "0.9",
        "kv_cache_size_tokens": "256",
        "num_cpu_blocks": "None",
        "num_gpu_blocks": "16",
        "prefix_caching_hash_algo": "sha256",
        "engine": "0",
    }
    decode = {**cache_info(healthy.prefill), "kv_cache_size_tokens": "1024", "num_gpu_blocks": "64"}
    assert cache_info(healthy.decode) == decode
    assert cache_infos(healthy.router) == []
    for url in (healthy.router, healthy.prefill, healthy.decode):
        with httpx.Client(base_url=url) as client:
            assert client.get("/health").status_code == 200
            assert client.get("/v1/models").json()["data"][0]["max_model_len"] == WINDOW
            assert metric(client, "vllm:num_requests_running") == 0
            assert metric(client, "vllm:num_requests_waiting") == 0
    with httpx.Client(base_url=healthy.router) as router:
        with pytest.raises(AssertionError, match="not exposed"):
            metric(router, "vllm:kv_cache_usage_perc")
    assert read_metric(healthy.prefill, "vllm:kv_cache_usage_perc") == 0


def test_sim_capacity_resizes_a_pool_for_the_next_admission_and_the_next_read(tokenizer_dir: Path) -> None:
    with deployment(tokenizer_dir, prefill_kv_tokens=512, decode_kv_tokens=1024) as served:
        with httpx.Client(base_url=served.router) as client:
            assert completion(client, 200, max_tokens=16).status_code == 200
            shrunk = put_capacity(served.prefill, {"kv_tokens": 100})
            assert shrunk.json() == {"stage": "prefill", "kv_tokens": 96, "num_gpu_blocks": 6, "block_size": 16}
            assert cache_info(served.prefill)["num_gpu_blocks"] == "6"
            refused = completion(client, 200, max_tokens=16)
            assert "maximum context length is 96 tokens" in refused.json()["error"]["message"]
            assert completion(client, 96, max_tokens=16).status_code == 200
            assert put_capacity(served.prefill, {"kv_tokens": 4096}).json()["num_gpu_blocks"] == 256
            assert completion(client, 1000, max_tokens=16).status_code == 200  # the cache grew to hold it
            assert put_capacity(served.decode, {"kv_tokens": 1000}).json()["kv_tokens"] == 992
            assert cache_info(served.decode)["kv_cache_size_tokens"] == "992"
            assert "length is 992 tokens" in completion(client, 1000, max_tokens=16).json()["error"]["message"]
        for bad in ({"kv_tokens": 15}, {"kv_tokens": "512"}, {"kv_tokens": True}, {"kv_tokens": 512.0}, {}, [512]):
            refused = put_capacity(served.prefill, bad)
            assert refused.status_code == 400, bad
        assert httpx.put(f"{served.prefill}/sim/capacity", content=b"{").status_code == 400
        assert cache_info(served.prefill)["num_gpu_blocks"] == "256"


def test_sim_config_keeps_pools_in_whole_blocks_and_the_fault_it_is_given(tokenizer_dir: Path) -> None:
    """Only the CLI makes stale-kv the default of a disaggregated deployment (the incident's replay)."""
    config = SimConfig(tokenizer_dir=tokenizer_dir, prefill_kv_tokens=250, decode_kv_tokens=300)
    assert (config.prefill_kv_tokens, config.decode_kv_tokens, config.fault) == (240, 288, "none")
    assert config.disaggregated and not config.fault_unreachable
    with pytest.raises(ValueError, match="prefill_kv_tokens must be at least block_size"):
        SimConfig(tokenizer_dir=tokenizer_dir, prefill_kv_tokens=8)
    assert create_sim_app(SimConfig(tokenizer_dir=tokenizer_dir)).state.stages == {}


# SGLang's flavor.


def test_sglang_routes_describe_the_server_in_sglangs_shapes(sglang_url: str) -> None:
    with httpx.Client(base_url=sglang_url) as client:
        [card] = client.get("/v1/models").json()["data"]
        assert {key: card[key] for key in ("id", "object", "owned_by", "root", "max_model_len")} == {
            "id": MODEL,
            "object": "model",
            "owned_by": "sglang",
            "root": MODEL,
            "max_model_len": WINDOW,
        }
        assert client.get("/health").status_code == 200
        info = client.get("/get_server_info").json()
        assert info == client.get("/server_info").json()
        assert (info["context_length"], info["max_total_num_tokens"], info["max_req_input_len"]) == (WINDOW, 1024, 1023)
        assert info["disaggregation_mode"] == "null"
        assert parse_server_info(info) == (1024, WINDOW)
        assert info["internal_states"][0]["memory_usage"]["token_capacity"] == 1024
        assert client.get("/get_model_info").json()["is_generation"] is True
        tokenized = client.post("/v1/tokenize", json={"model": MODEL, "prompt": "Hello there"}).json()
        assert set(tokenized) == {"tokens", "count", "max_model_len"}
        assert tokenized["count"] == len(tokenized["tokens"]) > 0
        assert client.post("/tokenize", json={"prompt": ["a", "b c"]}).json()["count"] == [
            len(ids) for ids in client.post("/tokenize", json={"prompt": ["a", "b c"]}).json()["tokens"]
        ]
        ids = client.post("/tokenize", json={"prompt": "Hello there", "add_special_tokens": False}).json()["tokens"]
        assert client.post("/detokenize", json={"tokens": ids}).json() == {"text": "Hello there"}


def test_sglang_metrics_have_sglangs_names_and_labels(sglang_url: str) -> None:
    with httpx.Client(base_url=sglang_url) as client:
        assert chat(client, LONG).status_code == 200
        text = client.get("/metrics").text
        assert "vllm:" not in text
        labels = {"model_name": MODEL, "engine_type": "unified", "tp_rank": "0", "pp_rank": "0", "moe_ep_rank": "0"}
        assert metric(client, "sglang:num_running_reqs", **labels) == 0
        assert metric(client, "sglang:num_queue_reqs", **labels) == 0
        assert metric(client, "sglang:token_usage", **labels) == 0
        assert metric(client, "sglang:max_total_num_tokens", **labels) == 1024
        assert metric(client, "sglang:context_len", **labels) == WINDOW
        assert metric(client, "sglang:prompt_tokens_total", model_name=MODEL, engine_type="unified") > 0
        assert metric(client, "sglang:num_requests_total", model_name=MODEL, engine_type="unified") >= 1


def test_sglang_refusals_have_sglangs_flat_shape_and_texts(sglang_url: str) -> None:
    with httpx.Client(base_url=sglang_url) as client:
        over_window = completion(client, WINDOW)
        assert over_window.status_code == 400
        assert over_window.json() == {
            "object": "error",
            "message": f"The input ({WINDOW} tokens) is longer than the model's context length ({WINDOW} tokens).",
            "type": "BadRequestError",
            "param": None,
            "code": 400,
        }
        total = completion(client, 1000, max_tokens=1048).json()["message"]
        assert total == (
            "Requested token count exceeds the model's maximum context length of 2048 tokens. You requested a total "
            "of 2048 tokens: 1000 tokens from the input messages and 1048 tokens for the completion. Please reduce "
            "the number of tokens in the input messages or the completion to fit within the limit."
        )
        over_pool = completion(client, 1023, max_tokens=16).json()["message"]
        assert over_pool == (
            "Input length (1023 tokens) exceeds the maximum allowed length (1023 tokens). "
            "Use a shorter input or enable --allow-auto-truncate."
        )
        assert completion(client, 1022, max_tokens=16).status_code == 200
        assert completion(client, WINDOW, stream=True).json()["message"].startswith("The input (2048 tokens)")
        aborted = completion(client, 1023, max_tokens=16, stream=True)  # the scheduler's abort, once streaming
        assert aborted.status_code == 200
        assert aborted.text == (
            'data: {"error":{"object":"error","message":"Input length (1023 tokens) exceeds the maximum allowed length '
            '(1023 tokens). Use a shorter input or enable --allow-auto-truncate.","type":"BAD_REQUEST","param":null,'
            '"code":400}}\n\ndata: [DONE]\n\n'
        )
        assert chat(client, LONG, model="any-name-at-all").status_code == 200  # SGLang checks no model name


def test_sglang_keys_the_prefix_cache_by_extra_key_and_cache_salt(tokenizer_dir: Path) -> None:
    with (
        run_server(create_sim_app(SimConfig(tokenizer_dir=tokenizer_dir, engine="sglang"))) as url,
        httpx.Client(base_url=url) as client,
    ):

        def hits() -> float:
            return metric(client, "sglang:cached_tokens_total", cache_source="device")

        chat(client, LONG, cache_salt="tenant-a")
        chat(client, LONG, cache_salt="tenant-b")
        assert hits() == 0
        chat(client, LONG, cache_salt="tenant-a")
        reused = hits()
        assert reused > 0
        chat(client, LONG, cache_salt="tenant-b", extra_key="lora-1")  # the pair, not the salt alone
        chat(client, LONG, cache_salt="tenant", extra_key="-b")  # nor the two concatenated
        assert hits() == reused
        chat(client, LONG, extra_key="lora-1", cache_salt="tenant-b")
        assert hits() == 2 * reused


@pytest.mark.parametrize(
    "method, path",
    [
        ("GET", "/version"),
        ("POST", "/v1/responses"),
        ("POST", "/v1/messages"),
        ("POST", "/v1/embeddings"),
        ("GET", "/nowhere"),
    ],
)
def test_routes_the_sglang_flavor_does_not_serve_answer_fastapis_404(sglang_url: str, method: str, path: str) -> None:
    response = httpx.request(method, f"{sglang_url}{path}", json={"model": MODEL})
    assert response.status_code == 404
    assert response.json() == {"detail": "Not Found"}


def test_sglang_api_key_guards_all_but_health_and_metrics(tokenizer_dir: Path) -> None:
    config = SimConfig(tokenizer_dir=tokenizer_dir, engine="sglang", api_key="secret", prefill_kv_tokens=256)
    app = create_sim_app(config)
    with run_server(app) as url, run_server(app.state.stages["prefill"]) as stage:
        for base in (url, stage):
            assert httpx.get(f"{base}/get_server_info").json() == {"error": "Unauthorized"}
            assert httpx.get(f"{base}/health").status_code == 200
            assert httpx.get(f"{base}/metrics").status_code == 200
            authorized = httpx.get(f"{base}/get_server_info", headers={"Authorization": "Bearer secret"})
            assert authorized.status_code == 200


def test_sglang_stages_say_their_pools_and_the_router_no_kv_size(sglang_pools: Deployment) -> None:
    router = httpx.get(f"{sglang_pools.router}/get_server_info").json()
    assert parse_server_info(router) == (None, None)
    assert "max_total_num_tokens" not in str(router)
    for url, role, pool in ((sglang_pools.prefill, "prefill", 256), (sglang_pools.decode, "decode", 992)):
        info = httpx.get(f"{url}/get_server_info").json()
        assert (info["max_total_num_tokens"], info["context_length"], info["disaggregation_mode"]) == (pool, 2048, role)
        assert httpx.get(f"{url}/server_info").json() == info
        assert read_metric(url, "sglang:max_total_num_tokens", engine_type=role) == pool
        assert httpx.get(f"{url}/v1/models").json()["data"][0]["max_model_len"] == WINDOW
    with httpx.Client(base_url=sglang_pools.router) as client:
        assert metric(client, "sglang:num_running_reqs", engine_type="router") == 0
        with pytest.raises(AssertionError, match="not exposed"):
            metric(client, "sglang:max_total_num_tokens")
        assert "maximum allowed length (255 tokens)" in completion(client, 300, max_tokens=16).json()["message"]
        assert put_capacity(sglang_pools.prefill, {"kv_tokens": 512}).json()["kv_tokens"] == 512
        assert httpx.get(f"{sglang_pools.prefill}/get_server_info").json()["max_total_num_tokens"] == 512
        assert completion(client, 300, max_tokens=16).status_code == 200
        over_decode = completion(client, 300, max_tokens=700).json()["message"]
        assert over_decode.startswith("Requested token count exceeds the model's maximum context length of 992 tokens.")
        assert put_capacity(sglang_pools.prefill, {"kv_tokens": 256}).status_code == 200


# `bulkhead sim --disaggregated`, as a user runs it.


def test_bulkhead_sim_disaggregated_serves_a_router_and_two_stages(tokenizer_dir: Path) -> None:
    command = [
        sys.executable,
        "-m",
        "gateway",
        "sim",
        "--disaggregated",
        "--port",
        "0",
        "--tokenizer",
        str(tokenizer_dir),
    ]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as process:
        assert process.stdout is not None and process.stderr is not None
        try:
            lines = [process.stdout.readline().rstrip("\n") for _ in range(4)]
            router, window, prefill, decode = lines
            assert router.startswith("bulkhead sim: serving 'tiny-llama' on http://127.0.0.1:"), lines
            assert window.startswith(
                "bulkhead sim: disaggregated: the router advertises the 2,048-token window only (no KV cache);"
            ), lines
            assert window.endswith(
                "fault stale-kv: prompts between the prefill pool's 1,328 tokens and the window reach it"
            )
            assert prefill.startswith("bulkhead sim: prefill stage (1,328-token KV cache) on http://127.0.0.1:"), lines
            assert decode.startswith("bulkhead sim: decode stage (4,096-token KV cache) on http://127.0.0.1:"), lines
            assert cache_info(prefill.rsplit(" ", 1)[1])["num_gpu_blocks"] == "83"  # 1,328 = 83 blocks of 16
            assert cache_infos(router.rsplit(" ", 1)[1]) == []
        finally:
            stop(process, signal.SIGINT)
        assert process.returncode == 0
        assert process.stderr.read() == ""
