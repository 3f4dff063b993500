"""A webhook receiver on 127.0.0.1 for the tests: it records every POST, answering 204, or 503 while it is `down`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.server.serving import run_server


@dataclass(frozen=True)
class Notice:
    headers: dict[str, str]
    body: bytes
    status: int  # what the receiver answered


@dataclass
class Receiver:
    url: str = ""
    down: bool = False
    received: list[Notice] = field(default_factory=list)

    @property
    def taken(self) -> list[Notice]:
        """What it answered 2xx to."""
        return [n for n in self.received if n.status < 300]

    async def wait_for(self, count: int = 1, timeout_s: float = 10.0) -> list[Notice]:
        """Once it has taken `count` notices, all it has taken."""
        deadline = time.monotonic() + timeout_s
        while len(self.taken) < count:
            assert time.monotonic() < deadline, f"{len(self.taken)} notices taken in {timeout_s} s, not {count}"
            await asyncio.sleep(0.02)
        return self.taken


@contextmanager
def webhook_receiver() -> Iterator[Receiver]:
    receiver = Receiver()

    async def receive(request: Request) -> Response:
        status = 503 if receiver.down else 204
        receiver.received.append(Notice(dict(request.headers), await request.body(), status))
        return Response(status_code=status)

    with run_server(Starlette(routes=[Route("/hook", receive, methods=["POST"])])) as url:
        receiver.url = f"{url}/hook"
        yield receiver
