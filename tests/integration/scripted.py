"""A gateway in front of a scripted engine (adversary.py's Adversary or DecodingModel), for a module's tests."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from gateway.server.app import create_app
from gateway.server.serving import run_server
from tests.integration.adversary import Adversary
from tests.integration.support import MODEL, gateway_settings


@contextmanager
def gateway_over(engine: Adversary, tokenizer_dir: Path) -> Iterator[str]:
    """The engine served, and a gateway in front of it with every defence on (its usage checked: a scripted engine's
    is honest), but for the KV-capacity limit: a scripted engine reports no KV cache. Yields the gateway's URL."""
    model = {"name": MODEL, "backends": ["engine"], "tokenizer": str(tokenizer_dir), "context_window": 2048}
    with run_server(engine.app()) as backend:
        settings = gateway_settings(
            {"engine": backend}, tokenizer_dir, models=[{**model, "limit_by_kv_capacity": False}]
        )
        with run_server(create_app(settings), settings.edge) as url:
            yield url
