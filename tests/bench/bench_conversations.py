"""What the gateway's conversation state costs (issue 31): bytes per stored turn, and the latency a 50-turn
Responses conversation adds when its history is the gateway's (`previous_response_id`) against a client sending
the whole history each turn (`store: false`), side by side in one run.

    python -m tests.bench.bench_conversations [--turns 50] [--rounds 3] [--output-tokens 16]

A simulator (answering at once) behind one gateway with a Redis of the benchmark's own. Each round runs one
conversation each way, turn by turn alternately (turn k stored, turn k whole, turn k+1 stored, ...), so both see
the same machine at the same moment; the same user text each turn. The stored way's turns are then read back
from Redis: the strings each turn is kept as (its response and its items: their length), what Redis says they take
in memory, and the tenant's links, index and sizes, per turn.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import redis
import yaml

from gateway.server.serving import free_port
from gateway.settings import REDIS_KEY_PREFIX
from gateway.tenancy.tenants import hash_key
from tests.bench.processes import BENCH_KEY, MODEL, Workspace, child
from tests.redis_server import own_redis

WINDOW = 65_536  # room for every turn of the longest conversation: admission is not what is measured
USER_TEXT = "Tell me one more thing about the harbour, briefly."


def turn(client: httpx.Client, body: dict[str, Any]) -> tuple[float, dict[str, Any]]:
    started = time.perf_counter()
    response = client.post("/v1/responses", json=body)
    elapsed = time.perf_counter() - started
    if response.status_code != 200:
        raise RuntimeError(f"/v1/responses answered {response.status_code}: {response.text[:500]}")
    return elapsed, response.json()


def conversation(client: httpx.Client, turns: int, output_tokens: int) -> tuple[list[float], list[float], list[str]]:
    """One conversation each way, alternately; the seconds of each turn each way, and the stored way's ids."""
    stored, whole, ids = [], [], []
    history: list[dict[str, Any]] = []
    previous: str | None = None
    for _ in range(turns):
        ask = {"model": MODEL, "input": USER_TEXT, "max_output_tokens": output_tokens}
        seconds, answer = turn(client, {**ask, **({"previous_response_id": previous} if previous else {})})
        stored.append(seconds)
        previous = answer["id"]
        ids.append(previous)
        history.append({"role": "user", "content": USER_TEXT})
        seconds, answer = turn(client, {**ask, "input": history, "store": False})
        whole.append(seconds)
        history += answer["output"]
    return stored, whole, ids


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--turns", type=int, default=50)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--output-tokens", type=int, default=16)
    args = parser.parse_args()
    with own_redis() as own, tempfile.TemporaryDirectory() as root:
        workspace = Workspace.create(Path(root), "WARNING")
        sim_port, port = free_port(), free_port()
        sim_command = [
            *(sys.executable, "-m", "gateway", "sim", "--port", str(sim_port)),
            *("--tokenizer", str(workspace.tokenizer_dir), "--max-model-len", str(WINDOW)),
            *("--output-tokens", str(args.output_tokens), "--ttft-ms", "0", "--tokens-per-s", "0"),
        ]
        with child(sim_command, sim_port, workspace.root / "sim.log", "/health") as sim:
            config = workspace.root / "gateway.yaml"
            settings = {
                "listen": {"host": "127.0.0.1", "port": port},
                "log_level": "WARNING",
                "redis_url": own.url,
                "limits": {"max_output_tokens": args.output_tokens},
                "backends": [{"name": "sim", "url": sim.url}],
                "models": [
                    {
                        "name": MODEL,
                        "backends": ["sim"],
                        "tokenizer": str(workspace.tokenizer_dir),
                        "context_window": WINDOW,
                    }
                ],
                "tenants": [{"id": "bench", "key_hashes": [hash_key(BENCH_KEY)], "models": ["*"]}],
            }
            config.write_text(yaml.safe_dump(settings), encoding="utf-8")
            command = [sys.executable, "-m", "gateway", "serve", "--config", str(config)]
            with (
                child(command, port, workspace.root / "gateway.log", "/readyz") as gateway,
                httpx.Client(
                    base_url=gateway.url, headers={"authorization": f"Bearer {BENCH_KEY}"}, timeout=60
                ) as client,
            ):
                turn(client, {"model": MODEL, "input": "warm up", "store": False, "max_output_tokens": 1})
                stored, whole, ids = [], [], []
                for _ in range(args.rounds):
                    s, w, i = conversation(client, args.turns, args.output_tokens)
                    stored += s
                    whole += w
                    ids += i
        keys = redis.Redis.from_url(own.url)
        kept = set(ids)
        records = [
            name
            for name in keys.scan_iter(match=f"{REDIS_KEY_PREFIX}conversation:*")
            if name.decode().rsplit(":", 1)[-1] in kept
        ]
        lengths = [keys.strlen(name) for name in records]
        memory = [keys.memory_usage(name) or 0 for name in records]
        index = sum(keys.memory_usage(name) or 0 for name in keys.scan_iter(match=f"{REDIS_KEY_PREFIX}response*:*"))
        turns = len(kept)
    print(f"\nResponses conversations: {args.rounds} × {args.turns} turns each way, {args.output_tokens} output tokens")
    print("| way | per turn p50 (ms) | mean (ms) | last 10 turns mean (ms) | a conversation (s) |")
    print("| --- | --- | --- | --- | --- |")
    for name, seconds in (("stored (previous_response_id)", stored), ("whole history (store: false)", whole)):
        late = [s for k, s in enumerate(seconds) if k % args.turns >= args.turns - 10]
        print(
            f"| {name} | {statistics.median(seconds) * 1e3:.2f} | {statistics.mean(seconds) * 1e3:.2f} "
            f"| {statistics.mean(late) * 1e3:.2f} | {sum(seconds) / args.rounds:.2f} |"
        )
    added = (sum(stored) - sum(whole)) / args.rounds
    print(f"\nstored ÷ whole, per conversation: {sum(stored) / sum(whole):.3f} ({added * 1e3:+.1f} ms a conversation)")
    print(
        f"bytes per stored turn: {sum(lengths) / turns:.0f} kept (its response and its items), "
        f"{sum(memory) / turns:.0f} in Redis memory, plus {index / turns:.0f} for the tenant's links and index"
    )


if __name__ == "__main__":
    main()
