"""Fixtures shared by the whole suite."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

from gateway.server.serving import run_server
from isolation.sim import SimConfig, create_sim_app
from isolation.sim.tinymodel import build_tokenizer

SimFactory = Callable[..., str]


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model's tokenizer, trained once per run (about a second)."""
    return build_tokenizer(tmp_path_factory.mktemp("tiny-model"))


@pytest.fixture
def make_sim(tokenizer_dir: Path) -> Iterator[SimFactory]:
    """Start simulators on demand: `make_sim(ttft_ms=50)` returns the base URL of a new, running one."""
    with ExitStack() as stack:

        def start(**overrides: Any) -> str:
            config = SimConfig(**{"tokenizer_dir": tokenizer_dir, **overrides})
            return stack.enter_context(run_server(create_sim_app(config)))

        yield start


@pytest.fixture
def sim_url(make_sim: SimFactory) -> str:
    """A fresh simulator with the default settings (no pacing, 2048-token window)."""
    return make_sim()
