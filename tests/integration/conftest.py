"""A real gateway in front of real simulators, both served over HTTP on 127.0.0.1."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.app import create_app
from gateway.serving import run_server
from tests.integration.support import gateway_settings

GatewayFactory = Callable[..., str]


@pytest.fixture
def make_gateway(tokenizer_dir: Path) -> Iterator[GatewayFactory]:
    """`make_gateway({"a": sim_url}, limits={...})` starts a gateway over those backends; returns its URL."""
    with ExitStack() as stack:

        def start(backends: dict[str, str], **overrides: Any) -> str:
            settings = gateway_settings(backends, tokenizer_dir, **overrides)
            return stack.enter_context(run_server(create_app(settings)))

        yield start


@pytest.fixture
def gateway_url(make_gateway: GatewayFactory, sim_url: str) -> str:
    return make_gateway({"sim": sim_url})


@pytest.fixture
async def client() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=10) as c:
        yield c
