"""Instructions per request by stage of the gateway's path, counted by callgrind, against the floor's whole request.

    python -m tests.bench.bench_stages [--requests N] [--warmup N] [--no-floor] [--apis messages responses]
        [--json out.json]

callgrind sees C functions only, and Python 3.11 runs a Python call inside the caller's C frame, so a count by
Python function is not in its dump. This puts one there: the gateway runs under a probe (`--probe`, in the child) that
wraps each function of STAGES so that it runs inside a C function of its own, `bulkhead_stage_<outer>_<stage>`,
from a small library compiled here (gcc, Python's headers). callgrind counts each of those inclusively; a stage's
own count is what ran inside its C functions less what ran inside the stages nested in it (`outer` is the stage the
call was made from). A coroutine is wrapped step by step (each `send` into it), so what runs while it waits is not
its own; an async generator likewise. What no stage covers (uvicorn and httptools, Starlette's routing, the event
loop, aiohttp's own reading and writing, the probe's wrappers) is shown as "the rest". The probe turns the cyclic
collector off once the gateway is up: a collection charged to whichever stage allocated last would move stages by
more than the cuts being measured.

The counts are bench_instructions' (same requests, same pinned inputs): the table is remade after a change with the
same command. A stage whose function is renamed or moved is refused at start (the probe cannot find it): update
STAGES with the request's path.
"""

from __future__ import annotations

import argparse
import functools
import gc
import importlib
import importlib.machinery
import importlib.util
import inspect
import json
import os
import re
import runpy
import subprocess
import sys
import sysconfig
import tempfile
import types
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Generator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.bench.bench_instructions import (
    API_SCENARIOS,
    QUIET_UPSTREAM,
    SAME_MARKERS,
    SCENARIOS,
    START_TIMEOUT_S,
    Count,
    _annotated,
    callgrind_wrapper,
    dumped,
    measure,
)
from tests.bench.bench_overhead import OUTPUT_TOKENS, _revision
from tests.bench.load import LoadError
from tests.bench.processes import Workspace

# (stage, "module:qualified.name"), in the order of the request's path. A function may be wrapped once only.
STAGES: list[tuple[str, str]] = [
    ("parse and validate", "gateway.api.body:BodyReader.read"),
    ("parse and validate", "gateway.pipeline.inference:heavy"),
    ("parse and validate", "gateway.pipeline.inference:validate"),
    ("authenticate", "gateway.api.intake:Intake.tenant"),
    ("read the prompt", "gateway.pipeline.inference:Pipeline._read_prompt"),
    ("canary: plant the marker", "gateway.pipeline.inference:Pipeline._plant_marker"),
    ("fingerprints: prepare, register", "gateway.pipeline.inference:Pipeline._prepare_fingerprints"),
    ("fingerprints: prepare, register", "gateway.pipeline.inference:InferenceCall.fingerprint"),
    ("admit and count", "gateway.pipeline.inference:resolve_model"),
    ("admit and count", "gateway.pipeline.inference:check_request_limits"),
    ("admit and count", "gateway.pipeline.inference:admit"),
    ("admit and count", "gateway.upstream.capacity:CapacityMonitor.require"),
    ("admit and count", "gateway.pipeline.slot:Slot.__init__"),
    ("admit and count", "gateway.pipeline.slot:Slot.reserve"),
    ("admit and count", "gateway.pipeline.slot:Slot.release"),
    ("admit and count", "gateway.upstream.fairness:Gate.enter"),
    ("place", "gateway.upstream.placement:Placement.__init__"),
    ("forward: the engine's body", "gateway.pipeline.inference:upstream_body"),
    ("forward: the call's state", "gateway.pipeline.inference:InferenceCall.__init__"),
    ("forward: open, read, close", "gateway.pipeline.inference:InferenceCall.forward"),
    ("forward: open, read, close", "gateway.upstream.proxy:UpstreamResponse.read"),
    ("forward: open, read, close", "gateway.upstream.proxy:UpstreamResponse.chunks"),
    ("forward: open, read, close", "gateway.upstream.proxy:UpstreamResponse.aclose"),
    ("guard: build", "gateway.pipeline.inference:InferenceCall.output_guard"),
    # An answer that fits the inventory is parsed and checked against it in one pass (fitted); the rest is parsed,
    # then pruned.
    ("parse and prune the engine's answer", "gateway.pipeline.inference:fitted"),
    ("parse and prune the engine's answer", "gateway.pipeline.relay:fitted"),
    ("parse and prune the engine's answer", "gateway.pipeline.inference:parse_json_body"),
    ("parse and prune the engine's answer", "gateway.pipeline.inference:prune"),
    ("parse and prune the engine's answer", "gateway.pipeline.relay:prune"),
    ("guard: markers and fragments", "isolation.guard:OutputGuard.check_chunk"),
    ("guard: markers and fragments", "isolation.guard:OutputGuard.check_body"),
    ("guard: markers and fragments", "isolation.guard:OutputGuard.check_removed"),
    ("guard: markers and fragments", "isolation.guard:OutputGuard.closing"),
    ("guard: judges", "gateway.pipeline.judging:Judges.until_judged"),
    ("guard: judges", "gateway.pipeline.judging:Judges.from_start"),
    ("usage check and view", "gateway.pipeline.inference:InferenceCall.check_usage"),
    ("usage check and view", "gateway.pipeline.inference:InferenceCall.view_usage"),
    ("relay: split and parse events", "gateway.pipeline.relay:StreamFilter.events"),
    ("relay: split and parse events", "gateway.pipeline.relay:StreamFilter.feed"),
    ("relay: encode and send", "gateway.api.openai:openai_response"),
    ("relay: encode and send", "gateway.api.openai:RelayResponse.stream_response"),
    ("close and release", "gateway.pipeline.inference:InferenceCall.close"),
    ("log", "gateway.accesslog:write"),
    ("log", "gateway.api.openai:new_record"),
    ("metrics", "gateway.accesslog:finish"),
    ("metrics", "prometheus_client.metrics:MetricWrapperBase.labels"),
    ("metrics", "prometheus_client.metrics:Counter.inc"),
    ("metrics", "prometheus_client.metrics:Gauge.inc"),
    ("metrics", "prometheus_client.metrics:Gauge.dec"),
    ("metrics", "prometheus_client.metrics:Gauge.set"),
    ("metrics", "prometheus_client.metrics:Histogram.observe"),
    ("ledger", "gateway.pipeline.inference:InferenceCall._write_down"),
]
NAMES = list(dict.fromkeys(stage for stage, _ in STAGES))
REST = "the rest: uvicorn, httptools, Starlette, the event loop, aiohttp's I/O"
_SYMBOL = re.compile(r"bulkhead_stage_(\d+)_(\d+)$")


def _library_source(stages: int) -> str:
    pairs = [(outer, inner) for outer in range(stages + 1) for inner in range(1, stages + 1)]
    functions = [
        f"__attribute__((noinline)) static PyObject *bulkhead_stage_{outer}_{inner}(PyObject *f) "
        "{ return PyObject_CallNoArgs(f); }"
        for outer, inner in pairs
    ]
    table = ", ".join(f"bulkhead_stage_{outer}_{inner}" for outer, inner in pairs)
    # A C call of the module's own: callgrind sees it enter each stage's function (a call from ctypes' libffi it did
    # not, and charged the stage to libffi).
    return f"""#include <Python.h>
{chr(10).join(functions)}
static PyObject *(*table[])(PyObject *) = {{{table}}};
static PyObject *enter(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {{
    return table[PyLong_AsSsize_t(args[0])](args[1]);
}}
static PyMethodDef methods[] = {{{{"enter", (PyCFunction)(void (*)(void))enter, METH_FASTCALL, NULL}}, {{NULL}}}};
static struct PyModuleDef module = {{PyModuleDef_HEAD_INIT, "_bulkhead_stages", NULL, -1, methods}};
PyMODINIT_FUNC PyInit__bulkhead_stages(void) {{ return PyModule_Create(&module); }}
"""


def build_library(directory: Path) -> Path:
    source, library = directory / "stages.c", directory / "_bulkhead_stages.so"
    source.write_text(_library_source(len(NAMES)), encoding="utf-8")
    include = sysconfig.get_paths()["include"]
    # -O0: each function its own code, none folded into another, so callgrind names each one.
    subprocess.run(["gcc", "-O0", "-shared", "-fPIC", f"-I{include}", "-o", str(library), str(source)], check=True)
    return library


class Probe:
    """The child's side: runs each wrapped function inside its stage's C function, knowing which stage it is in."""

    def __init__(self, library: Path) -> None:
        loader = importlib.machinery.ExtensionFileLoader("_bulkhead_stages", str(library))
        spec = importlib.util.spec_from_file_location("_bulkhead_stages", library, loader=loader)
        assert spec is not None
        module = importlib.util.module_from_spec(spec)
        loader.exec_module(module)
        self._call: Callable[[int, Callable[[], Any]], Any] = module.enter
        self._stages = len(NAMES)
        # Steps run to their end before another task's step starts: one stack serves every task of the loop.
        self._stack: list[int] = [0]

    def enter(self, stage: int, thunk: Callable[[], Any]) -> Any:
        outer = self._stack[-1]
        if outer == stage:
            return thunk()
        self._stack.append(stage)
        try:
            return self._call(outer * self._stages + stage - 1, thunk)
        finally:
            self._stack.pop()

    @types.coroutine
    def stepped(self, stage: int, awaitable: Any) -> Generator[Any, Any, Any]:
        value: Any = None
        thrown: BaseException | None = None
        while True:
            try:
                if thrown is None:
                    yielded = self.enter(stage, functools.partial(awaitable.send, value))
                else:
                    yielded = self.enter(stage, functools.partial(awaitable.throw, thrown))
            except StopIteration as stop:
                return stop.value
            try:
                value, thrown = (yield yielded), None
            except BaseException as exc:  # noqa: B036 - handed to the awaitable, as `await` would
                value, thrown = None, exc

    def wrap(self, stage: int, function: Callable[..., Any]) -> Callable[..., Any]:
        probe = self
        if inspect.isasyncgenfunction(function):

            @functools.wraps(function)
            async def generator(*args: Any, **kwargs: Any) -> AsyncIterator[Any]:
                inner = function(*args, **kwargs)
                try:
                    while True:
                        try:
                            item = await probe.stepped(stage, inner.__anext__())
                        except StopAsyncIteration:
                            return
                        yield item
                finally:
                    await probe.stepped(stage, inner.aclose())

            return generator
        if inspect.iscoroutinefunction(function):

            @functools.wraps(function)
            async def coroutine(*args: Any, **kwargs: Any) -> Any:
                return await probe.stepped(stage, function(*args, **kwargs))

            return coroutine

        @functools.wraps(function)
        def plain(*args: Any, **kwargs: Any) -> Any:
            return probe.enter(stage, functools.partial(function, *args, **kwargs))

        return plain

    def install(self) -> None:
        for stage, where in STAGES:
            module_name, _, qualified = where.partition(":")
            owner: Any = importlib.import_module(module_name)
            *path, name = qualified.split(".")
            for part in path:
                owner = getattr(owner, part)
            function = inspect.getattr_static(owner, name)
            if not callable(function):
                raise SystemExit(f"bench_stages: {where} is not a function")
            setattr(owner, name, self.wrap(NAMES.index(stage) + 1, function))


def probe_main(argv: list[str]) -> None:
    """In the child: `--probe LIBRARY -- -m MODULE ARGS...` wraps STAGES, then runs MODULE as `python -m` would."""
    library, module, rest = Path(argv[0]), argv[3], argv[4:]
    Probe(library).install()
    sys.argv = [module, *rest]
    # The gateway's start-up and the requests counted alike (see the module's doc).
    gc.disable()
    runpy.run_module(module, run_name="__main__", alter_sys=True)


@dataclass(frozen=True)
class Stages:
    """One scenario's count: the probed gateway's stages, the same gateway's count unprobed, the floor's."""

    requests: int
    inclusive: dict[tuple[int, int], int]  # (outer, stage): instructions inside that C function
    enters: dict[tuple[int, int], int]  # (outer, stage): how often it was entered
    probed: Count
    plain: Count
    floor: Count | None

    @property
    def per_enter(self) -> float:
        """The probe's own cost per wrapped call (its frames, the C call): the probed count less the plain one,
        shared evenly over the calls. It is charged to the stage the call was made from (outer), so it is taken from
        that stage's count."""
        return (
            (self.probed.without_collector - self.plain.without_collector) * self.requests / sum(self.enters.values())
        )

    def own(self) -> dict[str, float]:
        """Each stage's own instructions per request, the probe's cost taken out."""
        own: defaultdict[str, float] = defaultdict(float)
        for (outer, inner), instructions in self.inclusive.items():
            own[NAMES[inner - 1]] += instructions
            if outer:
                own[NAMES[outer - 1]] -= instructions + self.enters.get((outer, inner), 0) * self.per_enter
        return {name: own[name] / self.requests for name in NAMES}

    def rest(self) -> float:
        return self.plain.without_collector - sum(self.own().values())


def _dump_stages(path: Path) -> tuple[dict[tuple[int, int], int], dict[tuple[int, int], int]]:
    """(inclusive instructions, calls) of each stage's C function in a callgrind dump."""
    inclusive: dict[tuple[int, int], int] = {}
    for instructions, where, _ in _annotated(path, inclusive=True):
        match = _SYMBOL.search(where)
        if match is not None:
            inclusive[int(match.group(1)), int(match.group(2))] = instructions
    # The dump's own lines: "cfn=(id) name" names a callee the first time (then "cfn=(id)"), "calls=N ..." follows.
    names: dict[str, str] = {}
    enters: defaultdict[tuple[int, int], int] = defaultdict(int)
    callee: tuple[int, int] | None = None
    with path.open(errors="replace") as dump:
        for line in dump:
            if line.startswith(("fn=", "cfn=")):
                ref, _, name = line.partition("=")[2].rstrip("\n").partition(" ")
                if name:
                    names[ref] = name
                match = _SYMBOL.search(names.get(ref, "")) if line.startswith("cfn=") else None
                callee = (int(match.group(1)), int(match.group(2))) if match is not None else None
            elif line.startswith("calls=") and callee is not None:
                enters[callee] += int(line[6:].split()[0])
    return inclusive, dict(enters)


def run(workspace: Workspace, library: Path, args: argparse.Namespace) -> dict[str, Stages]:
    scenarios = SCENARIOS + [scenario for api in args.apis for scenario in API_SCENARIOS[api]]
    with workspace.simulator(OUTPUT_TOKENS) as sim:

        def counted(name: str, probe: list[str], floor: bool = False) -> tuple[Path, dict[str, Count]]:
            out = workspace.root / f"callgrind-{name}.out"
            wrapper = [*callgrind_wrapper(out), *probe]
            print(f"measuring {name} ({args.requests} requests a scenario)", file=sys.stderr)
            if floor:
                server = workspace.floor(sim.url, wrapper, START_TIMEOUT_S)
            else:
                server = workspace.gateway(
                    sim.url, wrapper, isolation=SAME_MARKERS, start_timeout_s=START_TIMEOUT_S, upstream=QUIET_UPSTREAM
                )
            with server as running:
                return out, measure(running, out, args.requests, args.warmup, SCENARIOS if floor else scenarios)

        out, probed = counted("probed", ["-m", "tests.bench.bench_stages", "--probe", str(library), "--"])
        _, plain = counted("gateway", [])
        floors = counted("floor", [], floor=True)[1] if args.floor else {}
        results = {}
        for scenario in scenarios:
            inclusive, enters = _dump_stages(dumped(out, scenario.name.replace(" ", "-")))
            name = scenario.name
            results[name] = Stages(args.requests, inclusive, enters, probed[name], plain[name], floors.get(name))
    return results


def _k(value: float) -> str:
    return f"{value / 1e3:,.0f}"


def render(results: dict[str, Stages]) -> str:
    names = list(results)
    own = {name: result.own() for name, result in results.items()}
    lines = [
        "| stage, k instructions / request | " + " | ".join(names) + " |",
        "| --- | " + " | ".join("---:" for _ in names) + " |",
    ]
    lines += [f"| {stage} | " + " | ".join(_k(own[n][stage]) for n in names) + " |" for stage in NAMES]
    lines.append(f"| {REST} | " + " | ".join(_k(results[n].rest()) for n in names) + " |")
    total = " | ".join(f"**{_k(results[n].plain.without_collector)}**" for n in names)
    lines.append(f"| **the gateway** | {total} |")
    floors = {n: r.floor for n, r in results.items() if r.floor is not None}
    if floors:
        lines.append(
            "| the floor: HTTP in, forward, relay | "
            + " | ".join(_k(floors[n].without_collector) if n in floors else "" for n in names)
            + " |"
        )
        ratios = [
            f"{results[n].plain.without_collector / floors[n].without_collector:.2f}" if n in floors else ""
            for n in names
        ]
        lines.append("| gateway / floor | " + " | ".join(ratios) + " |")
    per_enter = ", ".join(f"{n}: {r.per_enter:,.0f}" for n, r in results.items())
    lines.append(f"\nThe probe's cost per wrapped call, taken out of the stage that made it: {per_enter} instructions.")
    return "\n".join(lines)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--requests", type=int, default=300, help="sequential requests counted per scenario")
    parser.add_argument("--warmup", type=int, default=200, help="requests per scenario before counting")
    parser.add_argument("--no-floor", dest="floor", action="store_false", help="leave the bare forwarder out")
    parser.add_argument("--apis", nargs="*", choices=sorted(API_SCENARIOS), default=[], help="also these APIs")
    parser.add_argument("--log-level", default="WARNING", help="the servers' log level (default WARNING)")
    parser.add_argument("--json", type=Path, help="also write the results here as JSON")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ["PYTHONHASHSEED"] = "0"  # as bench_instructions: the same dict layouts in every process
    with tempfile.TemporaryDirectory(prefix="bulkhead-stages-") as tmp:
        library = build_library(Path(tmp))
        try:
            results = run(Workspace.create(Path(tmp), args.log_level), library, args)
        except LoadError as exc:
            print(f"bench_stages: a request failed, so nothing was counted: {exc}", file=sys.stderr)
            return 1
    print(f"revision {_revision()}")
    print(render(results))
    if args.json is not None:
        report = {
            "revision": _revision(),
            "requests_per_scenario": args.requests,
            "scenarios": {
                name: {
                    "instructions_per_request": round(result.plain.without_collector),
                    "stages": {stage: round(n) for stage, n in result.own().items()},
                    "rest": round(result.rest()),
                    "probe_per_call": round(result.per_enter),
                    **({"floor": round(result.floor.without_collector)} if result.floor is not None else {}),
                }
                for name, result in results.items()
            },
        }
        args.json.write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    return 0


if __name__ == "__main__":
    if sys.argv[1:2] == ["--probe"]:
        probe_main(sys.argv[2:])
    else:
        raise SystemExit(main())
