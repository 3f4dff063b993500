"""Fixtures shared by the whole suite."""

from __future__ import annotations

import fcntl
import os
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
from xdist.scheduler import LoadScopeScheduling

from gateway.server.serving import run_server
from isolation.sim import SimConfig, create_sim_app
from isolation.sim.tinymodel import build_tokenizer

SimFactory = Callable[..., str]


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """README's command runs the suite on two pytest-xdist workers: a module runs whole on one worker, so its module
    fixtures start once, and the end-to-end package is one unit, so one vLLM serves it, as is the Redis Cluster
    package, so one cluster serves it. (xdist's own `loadgroup` cannot say this on pytest 9: it renames node ids,
    which pytest 9 no longer lets a plugin do.)"""

    class ByModule(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            module = nodeid.split("::", 1)[0]
            package = next((p for p in ("tests/e2e", "tests/cluster") if module.startswith(f"{p}/")), None)
            return package or module

    return ByModule(config, log)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_protocol(item: pytest.Item) -> Iterator[None]:
    """A test marked `alone` times something against the clock: while it runs (setup to teardown), no other worker
    runs a test, and it waits for the one in flight; every other test holds a shared turn."""
    run = os.environ.get("PYTEST_XDIST_TESTRUNUID")
    if run is None:
        return (yield)
    with open(Path(os.environ.get("TMPDIR", "/tmp")) / f"bulkhead-pytest-{run}.lock", "a") as turn:
        fcntl.flock(turn, fcntl.LOCK_EX if item.get_closest_marker("alone") else fcntl.LOCK_SH)
        return (yield)


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
