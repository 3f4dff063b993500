"""Profile a gateway process under load with pyinstrument, and sum its samples by the layer they fall in.

pyinstrument wraps the gateway (`python -m pyinstrument -m gateway serve ...`) and writes its session when
the gateway exits on SIGINT. The tree it renders answers "which call path"; the per-layer totals computed
here answer the benchmark's question, "which layer of the stack costs what", by charging each sample's
self time to the package whose code was running (a C function is charged to its Python caller).
"""

from __future__ import annotations

import asyncio
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pyinstrument.frame import Frame
from pyinstrument.renderers.console import ConsoleRenderer
from pyinstrument.session import Session

from tests.bench.load import Request, Target, new_session, run_batch
from tests.bench.processes import Server, Workspace

# (layer, path fragment), first match wins; fragments are path pieces of the module files.
LAYERS = [
    ("gateway: our code", "/gateway/"),
    ("isolation: our code (guard, pruning, markers, fingerprints)", "/isolation/"),
    ("uvicorn + httptools (server, HTTP parsing)", "/uvicorn/"),
    ("uvicorn + httptools (server, HTTP parsing)", "/httptools/"),
    ("starlette (routing, request, responses)", "/starlette/"),
    ("anyio (task groups)", "/anyio/"),
    ("aiohttp (upstream client, the proxied hop)", "/aiohttp/"),
    ("aiohttp (upstream client, the proxied hop)", "/yarl/"),
    ("aiohttp (upstream client, the proxied hop)", "/multidict/"),
    ("httpx + httpcore + h11 (health and capacity polls)", "/httpx/"),
    ("httpx + httpcore + h11 (health and capacity polls)", "/httpcore/"),
    ("httpx + httpcore + h11 (health and capacity polls)", "/h11/"),
    ("pydantic (validation)", "/pydantic"),
    ("prometheus_client (metrics)", "/prometheus_client/"),
    ("logging", "/logging/"),
    ("asyncio + uvloop (event loop, I/O, idle)", "/asyncio/"),
    ("asyncio + uvloop (event loop, I/O, idle)", "/uvloop/"),
]
OTHER = "other (stdlib, small libraries)"

# Named steps of the request's path, timed inclusively (callees included): (label, function, path fragment).
# They name the gateway's functions as they are now; a step whose function is renamed or moved measures 0 and
# is left out of the summary, so update the list when the request path changes.
STEPS = [
    (
        "the app call (Starlette + our handler; a stream's body is sent from its own task)",
        "__call__",
        "starlette/applications.py",
    ),
    ("our handler, openai.serve", "serve", "gateway/api/openai.py"),
    ("admission: auth, read body, JSON, pydantic, limits, pick replica", "_admit", "gateway/pipeline/inference.py"),
    ("pydantic validation (model_validate; settings at start-up too)", "model_validate", "pydantic/main.py"),
    ("upstream request until its headers (Upstream.open)", "open", "gateway/upstream/proxy.py"),
    ("aiohttp ClientSession._request", "_request", "aiohttp/client.py"),
    ("reading the upstream body (UpstreamResponse.read)", "read", "gateway/upstream/proxy.py"),
    ("closing the upstream response (UpstreamResponse.aclose)", "aclose", "gateway/upstream/proxy.py"),
    ("access record and metrics (accesslog.finish)", "finish", "gateway/accesslog.py"),
    ("stream: sending the response, watching for disconnect (RelayResponse)", "__call__", "gateway/api/openai.py"),
    ("stream: relaying upstream events (InferenceCall.relay)", "relay", "gateway/pipeline/inference.py"),
    ("reading upstream body chunks (UpstreamResponse.chunks)", "chunks", "gateway/upstream/proxy.py"),
]


@dataclass(frozen=True)
class LayerTime:
    layer: str
    seconds: float
    percent: float


def _code_frame(frame: Frame) -> Frame:
    """The nearest frame, this one or above, that runs Python code from a file.

    Synthetic frames ([self], [await]) and C functions (`<built-in>`) have no file of their own: their time is
    charged to the Python code that called them, e.g. the event loop's wait for I/O to asyncio's runner.
    """
    node = frame
    while node.parent is not None and not (node.file_path or "").endswith(".py"):
        node = node.parent
    return node


def _self_times(root: Frame) -> dict[Frame, float]:
    """Each frame's time not spent in its children (pyinstrument's tree keeps only inclusive times)."""
    totals: dict[Frame, float] = {}
    stack = [root]
    while stack:
        frame = stack.pop()
        own = frame.time - sum(child.time for child in frame.children)
        if own > 0:
            totals[frame] = own
        stack.extend(frame.children)
    return totals


def _ranked(totals: dict[str, float]) -> list[tuple[str, float]]:
    return sorted(totals.items(), key=lambda item: item[1], reverse=True)


def layer_of(frame: Frame) -> str:
    path = _code_frame(frame).file_path or ""
    return next((layer for layer, fragment in LAYERS if fragment in path), OTHER)


def layer_times(root: Frame) -> list[LayerTime]:
    totals: defaultdict[str, float] = defaultdict(float)
    for frame, seconds in _self_times(root).items():
        totals[layer_of(frame)] += seconds
    whole = root.time or 1.0
    return [LayerTime(layer, seconds, 100 * seconds / whole) for layer, seconds in _ranked(totals)]


def _function_name(frame: Frame) -> str:
    if frame.is_synthetic:
        frame = frame.parent or frame
    path = frame.file_path or ""
    where = f"{Path(path).parent.name}/{Path(path).name}:{frame.line_no}" if path.endswith(".py") else path
    return f"{frame.function} ({where})"


def hottest_functions(root: Frame, count: int = 15) -> list[tuple[str, float]]:
    """Functions by self time, as percentages of all samples: the leaves where the CPU actually was."""
    totals: defaultdict[str, float] = defaultdict(float)
    for frame, seconds in _self_times(root).items():
        totals[_function_name(frame)] += seconds
    whole = root.time or 1.0
    return [(name, 100 * seconds / whole) for name, seconds in _ranked(totals)[:count]]


def step_times(root: Frame) -> list[tuple[str, float]]:
    """Inclusive percentage of all samples spent in each of STEPS (a recursive call is counted once)."""
    totals: defaultdict[str, float] = defaultdict(float)
    stack: list[tuple[Frame, frozenset[str]]] = [(root, frozenset())]
    while stack:
        frame, inside = stack.pop()
        path = frame.file_path or ""
        for label, function, fragment in STEPS:
            if label not in inside and frame.function == function and fragment in path:
                totals[label] += frame.time
                inside = inside | {label}
        stack.extend((child, inside) for child in frame.children)
    whole = root.time or 1.0
    return [(label, 100 * totals[label] / whole) for label, _, _ in STEPS]


async def _load(gw: Server, request: Request, concurrency: int, count: int) -> None:
    async with new_session(concurrency) as session:
        await run_batch(Target("profiled gateway", gw.url, session), request, concurrency, count)


def profile_gateway(
    workspace: Workspace, sim: Server, report: Path, request: Request, concurrency: int, count: int
) -> dict[str, Any]:
    """Run a fresh gateway under pyinstrument and load it; write the text report there; return a summary."""
    # Kept beside the report: `pyinstrument --load FILE --show-all` re-renders it with library frames shown.
    session_file = report.with_suffix(".pyisession")
    wrapper = [sys.executable, "-m", "pyinstrument", "--renderer", "pyisession", "-o", str(session_file)]
    with workspace.gateway(sim.url, wrapper) as gw:
        asyncio.run(_load(gw, request, concurrency, count))
    # Leaving the block sent SIGINT: uvicorn shut down, pyinstrument wrote the session file.
    session = Session.load(session_file)
    report.write_text(ConsoleRenderer(unicode=True, color=False).render(session), encoding="utf-8")
    root = session.root_frame()
    if root is None:
        raise RuntimeError("pyinstrument recorded no samples")
    return {
        "load": f"{count} {'stream' if request.stream else 'non-stream'} requests at concurrency {concurrency}",
        "layers": [{"layer": t.layer, "percent": round(t.percent, 1)} for t in layer_times(root)],
        "steps": [{"step": label, "percent": round(p, 1)} for label, p in step_times(root) if p > 0],
        "hottest_functions": [{"function": name, "percent": round(p, 1)} for name, p in hottest_functions(root)],
    }


def render_summary(summary: dict[str, Any]) -> str:
    lines = [f"Where the profiled gateway's time went ({summary['load']}), by layer (self time):"]
    lines += [f"  {layer['percent']:5.1f}%  {layer['layer']}" for layer in summary["layers"]]
    lines.append("Steps of the request path (inclusive; steps nest, so they do not add up):")
    lines += [f"  {step['percent']:5.1f}%  {step['step']}" for step in summary["steps"]]
    lines.append("Hottest functions (self time):")
    lines += [f"  {item['percent']:5.1f}%  {item['function']}" for item in summary["hottest_functions"]]
    return "\n".join(lines)
