"""The floor: the least a Python hop can add. A bare forwarder on the gateway's own stack (uvicorn with httptools
and uvloop, one aiohttp ClientSession) that copies a request's body to the backend and the answer's bytes back,
chunk by chunk as they arrive, and does nothing else: no key, no parsing, no counting, no scanning, no metrics.

    python -m tests.bench.floor_proxy --port 9000 --backend http://127.0.0.1:8000

`bench_overhead --peer floor` runs it in the same rounds as the gateway, so "added" splits into what the extra hop
costs any Python proxy (the floor's added latency) and what the gateway's own work costs (the difference).
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

import aiohttp
import uvicorn

# Hop-by-hop or recomputed headers (the client's host, the lengths, the backend's date): the rest pass as they are.
DROPPED = frozenset(
    {b"host", b"content-length", b"transfer-encoding", b"connection", b"keep-alive", b"date", b"server"}
)


class FloorProxy:
    def __init__(self, backend: str) -> None:
        self.backend = backend.rstrip("/")
        self.session: aiohttp.ClientSession | None = None

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        body = b""
        while True:
            message = await receive()
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in scope["headers"] if k not in DROPPED}
        assert self.session is not None
        async with self.session.request(
            scope["method"], self.backend + scope["path"], data=body or None, headers=headers
        ) as upstream:
            out = [(k.lower().encode(), v.encode()) for k, v in upstream.headers.items()]
            await send({"type": "http.response.start", "status": upstream.status, "headers": out})
            async for chunk in upstream.content.iter_any():
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b""})

    async def _lifespan(self, receive: Any, send: Any) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=4.0)
                self.session = aiohttp.ClientSession(connector=connector, auto_decompress=False)
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                if self.session is not None:
                    await self.session.close()
                await send({"type": "lifespan.shutdown.complete"})
                return


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m tests.bench.floor_proxy", description=__doc__.split("\n")[0])
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--backend", required=True, help="the backend's base URL")
    args = parser.parse_args(argv)
    uvicorn.run(
        FloorProxy(args.backend),
        host="127.0.0.1",
        port=args.port,
        http="httptools",
        loop="uvloop",
        access_log=False,
        log_level="warning",
    )


if __name__ == "__main__":
    main()
