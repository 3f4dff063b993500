"""The simulator's capacity over real HTTP: max_num_seqs running at once and the rest queued first come first
served, a client leaving the queue, and batch_slowdown stretching pacing as a batch fills.

Timings are compared with wide margins or with each other (a 2-core CI machine is noisy); the pacing itself is
measured over many tokens, where one late read moves the mean by little.
"""

from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.cli.commands import build_parser, sim_config
from isolation.sim import SimConfig
from tests.conftest import SimFactory
from tests.integration.test_sim import HELLO, MODEL, metric, wait_for_metric

SECRET = [{"role": "user", "content": "Remember CNRY-ABCDEFGHIJKLMNOPQRST for me, it is the launch code."}]
OVERSIZED = [{"role": "user", "content": "word " * 400}]  # about 400 tokens: over a 256-token cache, under 2048


@dataclass
class Timed:
    """One streamed request, run on its own thread: when its token chunks arrived, and how it ended."""

    url: str
    body: dict[str, Any]
    timeout: float = 20
    arrivals: list[float] = field(default_factory=list)
    done: bool = False
    error: BaseException | None = None
    thread: threading.Thread | None = None

    def start(self, barrier: threading.Barrier | None = None) -> Timed:
        self.thread = threading.Thread(target=self._run, args=(barrier,))
        self.thread.start()
        return self

    def join(self) -> None:
        assert self.thread is not None
        self.thread.join(timeout=30)
        assert not self.thread.is_alive()

    @property
    def first(self) -> float:
        return self.arrivals[0]

    @property
    def end(self) -> float:
        return self.arrivals[-1]

    def gap(self, skip: int) -> float:
        """Mean time between tokens, leaving out `skip` tokens at each end (a batch filling and emptying)."""
        kept = self.arrivals[skip:-skip]
        return (kept[-1] - kept[0]) / (len(kept) - 1)

    def _run(self, barrier: threading.Barrier | None) -> None:
        try:
            with httpx.Client(base_url=self.url, timeout=self.timeout) as client:
                if barrier is not None:
                    barrier.wait(timeout=10)
                body = {"model": MODEL, "messages": HELLO, **self.body, "stream": True}
                with client.stream("POST", "/v1/chat/completions", json=body) as response:
                    assert response.status_code == 200
                    for line in response.iter_lines():
                        if line.startswith("data: {"):
                            self.arrivals.append(time.monotonic())
                        elif line == "data: [DONE]":
                            self.done = True
        except BaseException as exc:  # handed to the test's thread, which raises it
            self.error = exc


def occupancy(client: httpx.Client) -> tuple[float, float]:
    """(running, waiting) from one scrape, so the two are read at the same moment."""
    values = {}
    for family in text_string_to_metric_families(client.get("/metrics").text):
        if family.name in ("vllm:num_requests_running", "vllm:num_requests_waiting"):
            values[family.name] = family.samples[0].value
    return values["vllm:num_requests_running"], values["vllm:num_requests_waiting"]


def wait_for_occupancy(client: httpx.Client, admitted: int) -> tuple[float, float]:
    deadline = time.monotonic() + 5
    while sum(counts := occupancy(client)) != admitted:
        assert time.monotonic() < deadline, f"running, waiting stayed {counts}, expected {admitted} in all"
        time.sleep(0.01)
    return counts


@pytest.mark.alone
def test_requests_beyond_max_num_seqs_wait_first_come_first_served(make_sim: SimFactory) -> None:
    # A long TTFT keeps the first two running while all five are sent, one after another, so their order is known.
    url = make_sim(max_num_seqs=2, ttft_ms=1000, output_tokens=3)
    requests: list[Timed] = []
    with httpx.Client(base_url=url, timeout=10) as observer:
        for index in range(5):
            requests.append(Timed(url, {"cache_salt": f"s{index}"}).start())
            wait_for_occupancy(observer, index + 1)
        assert occupancy(observer) == (2, 3)
        for request in requests:
            request.join()
            if request.error is not None:
                raise request.error
        assert all(request.done and len(request.arrivals) == 1 + 3 for request in requests)
        # FIFO, two at a time: the k-th request (from 0) starts only once k - 1 of those before it have ended.
        for k in range(2, 5):
            ended_before = sorted(request.end for request in requests[:k])
            assert requests[k].first > ended_before[k - 2], f"request {k} started before a slot was free"
        assert requests[4].first > max(requests[2].first, requests[3].first)  # not last come first served
        wait_for_metric(observer, "vllm:num_requests_running", 0)
        assert metric(observer, "vllm:num_requests_waiting") == 0
        assert metric(observer, "vllm:request_success_total", finished_reason="stop") == 5


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "plain"])
def test_a_client_that_gives_up_while_waiting_leaves_the_queue_at_once(make_sim: SimFactory, stream: bool) -> None:
    url = make_sim(max_num_seqs=1, tokens_per_s=20, output_tokens=200)  # 10 s of answer holds the only slot
    with httpx.Client(base_url=url, timeout=10) as client, httpx.Client(base_url=url) as observer:
        body = {"model": MODEL, "messages": HELLO, "stream": True}
        with client.stream("POST", "/v1/chat/completions", json=body) as response:
            lines = response.iter_lines()
            while not next(lines).startswith("data: {"):
                pass
            prompt_tokens = metric(observer, "vllm:prompt_tokens_total")
            failures: list[BaseException] = []

            def impatient() -> None:
                with httpx.Client(base_url=url, timeout=1) as giving_up:
                    try:
                        giving_up.post("/v1/chat/completions", json={**body, "stream": stream})
                    except httpx.ReadTimeout:
                        return
                failures.append(AssertionError("the waiting request was answered"))

            waiter = threading.Thread(target=impatient)
            waiter.start()
            assert wait_for_occupancy(observer, 2) == (1, 1)
            waiter.join(timeout=10)
            assert not failures
            # Long before the running request ends (and with it the waiter's turn), the queue is empty again.
            wait_for_metric(observer, "vllm:num_requests_waiting", 0)
            assert metric(observer, "vllm:num_requests_running") == 1
            assert metric(observer, "vllm:request_success_total", finished_reason="abort") == 1
        wait_for_metric(observer, "vllm:request_success_total", 2, finished_reason="abort")
        assert metric(observer, "vllm:prompt_tokens_total") == prompt_tokens  # the one that left never ran
        assert occupancy(observer) == (0, 0)


def test_a_stale_kv_placeholder_takes_a_sequence_slot_and_reads_blocks_freed_while_it_waited(
    make_sim: SimFactory,
) -> None:
    url = make_sim(max_num_seqs=1, num_gpu_blocks=16, fault="stale-kv", tokens_per_s=100, output_tokens=1000)
    placeholder = {"model": MODEL, "messages": OVERSIZED, "max_tokens": 60}
    ordinary = {"model": MODEL, "messages": HELLO, "max_tokens": 2}
    answers: dict[str, httpx.Response] = {}

    def send(name: str, body: dict[str, Any]) -> None:
        with httpx.Client(base_url=url, timeout=10) as client:
            answers[name] = client.post("/v1/chat/completions", json=body)

    with httpx.Client(base_url=url, timeout=10) as client, httpx.Client(base_url=url, timeout=10) as observer:
        body = {"model": MODEL, "messages": SECRET, "stream": True}
        with client.stream("POST", "/v1/chat/completions", json=body) as response:
            lines = response.iter_lines()
            while not next(lines).startswith("data: {"):
                pass
            waiters = []
            for index, (name, waiting) in enumerate((("placeholder", placeholder), ("ordinary", ordinary))):
                waiters.append(threading.Thread(target=send, args=(name, waiting)))
                waiters[-1].start()
                assert wait_for_occupancy(observer, 2 + index) == (1, 1 + index)
        # Leaving the block aborted the first request, freeing its slot and blocks; the placeholder's run, which
        # holds no blocks, must hand its slot on when it ends.
        for waiter in waiters:
            waiter.join(timeout=10)
        assert answers["ordinary"].status_code == 200
        leaked = answers["placeholder"]
        assert leaked.status_code == 200
        assert leaked.json()["usage"]["prompt_tokens"] == 1
        assert "CNRY-ABCDEFGHIJKLMNOPQRST" in leaked.json()["choices"][0]["message"]["content"]
        assert metric(observer, "sim:stale_kv_replies_total") == 1
        assert occupancy(observer) == (0, 0)


@pytest.mark.alone
def test_a_full_batch_stretches_the_token_interval(make_sim: SimFactory) -> None:
    rate, tokens, skip = 50, 50, 5
    url = make_sim(max_num_seqs=4, tokens_per_s=rate, output_tokens=tokens, batch_slowdown=1.0)
    solo = Timed(url, {"cache_salt": "solo"}).start()
    solo.join()
    barrier = threading.Barrier(4)
    batch = [Timed(url, {"cache_salt": f"b{index}"}).start(barrier) for index in range(4)]
    for request in [solo, *batch]:
        request.join()
        if request.error is not None:
            raise request.error
        assert request.done and len(request.arrivals) == 1 + tokens
    solo_gap = solo.gap(skip)
    batch_gap = sum(request.gap(skip) for request in batch) / len(batch)
    # 1 / rate alone; 1.75 / rate with all four running (1 + 1.0 × 3 / 4).
    assert 0.6 / rate < solo_gap < 1.4 / rate
    assert batch_gap > 1.5 / rate
    assert batch_gap / solo_gap > 1.35


@pytest.mark.alone
def test_batch_slowdown_zero_keeps_a_full_batch_at_its_configured_speed(make_sim: SimFactory) -> None:
    rate, tokens = 50, 30
    url = make_sim(max_num_seqs=4, tokens_per_s=rate, output_tokens=tokens)
    barrier = threading.Barrier(4)
    batch = [Timed(url, {"cache_salt": f"b{index}"}).start(barrier) for index in range(4)]
    for request in batch:
        request.join()
        if request.error is not None:
            raise request.error
    assert sum(request.gap(3) for request in batch) / len(batch) < 1.3 / rate


def test_capacity_settings_are_checked(tmp_path: Path) -> None:
    for bad in ({"max_num_seqs": 0}, {"batch_slowdown": -0.5}, {"batch_slowdown": math.nan}):
        with pytest.raises(ValueError, match=next(iter(bad))):
            SimConfig(tokenizer_dir=tmp_path, **bad)


def test_cli_flags_reach_the_simulators_settings(tokenizer_dir: Path) -> None:
    parser = build_parser()
    defaults = sim_config(parser.parse_args(["sim", "--tokenizer", str(tokenizer_dir)]))
    assert (defaults.max_num_seqs, defaults.batch_slowdown) == (256, 0.0)
    options = ["--max-num-seqs", "8", "--batch-slowdown", "0.5"]
    config = sim_config(parser.parse_args(["sim", "--tokenizer", str(tokenizer_dir), *options]))
    assert (config.max_num_seqs, config.batch_slowdown) == (8, 0.5)
    for bad in (["--max-num-seqs", "0"], ["--batch-slowdown", "-1"], ["--batch-slowdown", "x"]):
        with pytest.raises(SystemExit):
            parser.parse_args(["sim", *bad])
