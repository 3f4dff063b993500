"""What a request body may hold, checked on its JSON before anything else reads it.

The work a body costs the event loop (its parse, pydantic's validation, the translation of a Responses or Messages
request, the pipeline's walks over the messages) grows with the values it holds, not with its bytes: 3 MB of
100,000 one-word items took 1.7 s of the loop, while 3 MB of prose takes a few milliseconds. So every body is
bounded in values (`limits.max_json_values`: every object, array, string, number, boolean and null) and in depth,
and each API's own lists (messages, input items, content parts, tools) by caps that name them (`Cap`).

Counting needs the parse, and orjson holds the GIL for all of it: a thread would block the loop as long. So
`quick_count` first bounds the values from the bytes alone (at C speed, ~1 ms a megabyte): a body it shows small is
parsed and checked on the loop (`refusal`), any other is checked by `examine` in a worker process (body.py), which
sends one within the bounds back cut into slices that the gateway parses a slice at a time (slices.py). The worker
process is this module (`python -m gateway.api.bounds`, `serve`), which imports little of the gateway (slices.py,
offload.py and what they import, none of it the gateway's state): it starts in ~50 ms and holds ~15 MB.
"""

from __future__ import annotations

import gc
import signal
import sys
from dataclasses import dataclass, field
from typing import Any, BinaryIO

import orjson

from gateway.api.slices import Cut, cut
from gateway.offload import measure

JsonObject = dict[str, Any]


@dataclass(frozen=True)
class Cap:
    """A list of an API's body that may hold at most `settings.limits.<limit>` items, at `path` (`*`: each item of the
    list there); `items` is what its error calls them."""

    path: tuple[str, ...]
    items: str
    limit: str


Shape = tuple[Cap, ...]  # an API's caps, a list's own before those under its items


@dataclass(frozen=True)
class Bounds:
    """The numbers: every body's (values, depth) and each cap's, by its limit's name."""

    values: int
    depth: int
    caps: dict[str, int] = field(default_factory=dict)


@dataclass(frozen=True)
class Refusal:
    """Why a body is refused before anything reads it; made in a worker process too, so plain data, not an error.
    `limit`: the setting it is over (None: the body is no JSON object at all); `whole`: a bound on the whole body
    (413), not on one of its fields (400)."""

    message: str
    limit: str | None = None
    param: str | None = None
    whole: bool = False


def quick_count(raw: bytes) -> int:
    """At least as many as the values a JSON text holds: every value but the first follows a comma or opens a
    container. Commas and brackets inside strings count too, so prose is overcounted, never a body undercounted."""
    return 1 + raw.count(b",") + raw.count(b"{") + raw.count(b"[")


def parsed(raw: bytes) -> JsonObject | Refusal:
    if not raw:
        return Refusal("Request body is empty; expected a JSON object.")
    try:
        value = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        return Refusal(f"Request body is not valid JSON (or not valid UTF-8): {exc}")
    if not isinstance(value, dict):
        return Refusal("Request body must be a JSON object.")
    return value


def refusal(value: JsonObject, bounds: Bounds, shape: Shape, most: int | None = None) -> Refusal | None:
    """Why a parsed body is refused, or None: its API's caps first (their errors name the field), then its values and
    depth. `most`: at least the values it holds (`quick_count`'s), when known: no list holds more items than the body
    holds values, so a small body, the usual one, is not searched for the lists the caps name."""
    for cap in shape if most is None or most > min(bounds.caps.values(), default=0) else ():
        most = bounds.caps[cap.limit]
        for items in _lists(value, cap.path):
            if len(items) > most:
                where = _where(value, cap.path, items)
                said = f"{where}: {len(items)} {cap.items}; at most {most} may be sent (limits.{cap.limit})."
                return Refusal(said, cap.limit, where)
    values, depth = measure(value, bounds.values, bounds.depth)
    if values > bounds.values:
        # At least: the walk stops at the first container past the limit.
        return Refusal(
            f"Request body holds at least {values} JSON values; at most {bounds.values} may be sent "
            "(limits.max_json_values).",
            "max_json_values",
            whole=True,
        )
    if depth > bounds.depth:
        return Refusal(f"Request body nests deeper than {bounds.depth} levels.", "max_json_depth")
    return None


def checked(raw: bytes, bounds: Bounds, shape: Shape, most: int | None = None) -> JsonObject | Refusal:
    """The body as a JSON object within the bounds, or why it is refused (`most`: as `refusal` takes it)."""
    value = parsed(raw)
    if isinstance(value, Refusal):
        return value
    return refusal(value, bounds, shape, most) or value


def examine(raw: bytes, bounds: Bounds, shape: Shape) -> bytes:
    """A worker process's whole job: its answer on one body, a line, then for a body within the bounds its plan and
    slices (slices.py), which the gateway's loop parses a slice at a time."""
    found = checked(raw, bounds, shape)
    if isinstance(found, Refusal):
        return orjson.dumps({"refusal": found}) + b"\n"
    pieces = cut(found)
    plan = orjson.dumps({"plan": pieces.plan, "sizes": pieces.sizes})
    return orjson.dumps({"plan": len(plan), "data": len(pieces.data)}) + b"\n" + plan + pieces.data


def ask(raw: bytes, bounds: Bounds, shape: Shape) -> bytes:
    """What the gateway writes to a worker process for one body: a line saying how to check it, then the body."""
    return orjson.dumps({"bounds": bounds, "shape": shape, "size": len(raw)}) + b"\n" + raw


@dataclass(frozen=True)
class Within:
    """A worker process's answer line on a body within the bounds: its plan and its slices follow, `plan` bytes and
    `data` bytes (read them with `pieces`)."""

    plan: int
    data: int


def answer(line: bytes) -> Refusal | Within:
    """A worker process's answer line, read."""
    said = orjson.loads(line)
    return Refusal(**said["refusal"]) if "refusal" in said else Within(said["plan"], said["data"])


def pieces(plan: bytes, data: bytes) -> Cut:
    """The body a worker process found within the bounds, as the bytes after its answer line give it."""
    said = orjson.loads(plan)
    return Cut(said["plan"], said["sizes"], data)


def serve(source: BinaryIO, sink: BinaryIO) -> None:
    """A worker process's loop: a body at a time from `source` (as `ask` writes it), its answer on `sink` (as
    `examine` writes it), until `source` ends. The collector is off: a parsed body holds no cycles, and collecting
    while a large one is built made its parse several times slower."""
    gc.disable()
    while header := source.readline():
        asked = orjson.loads(header)
        raw = source.read(asked["size"])
        bounds = Bounds(**asked["bounds"])
        shape = tuple(Cap(tuple(cap["path"]), cap["items"], cap["limit"]) for cap in asked["shape"])
        sink.write(examine(raw, bounds, shape))
        sink.flush()


def _lists(value: Any, path: tuple[str, ...]) -> list[list[Any]]:
    """Each list at `path` in `value`, a step of the path at a time. What is not of the shape the path expects is
    passed over: validation says what is wrong with it."""
    nodes = [value]
    for step in path:
        if step == "*":
            nodes = [item for node in nodes if type(node) is list for item in node]
        else:
            nodes = [node[step] for node in nodes if type(node) is dict and step in node]
    return [node for node in nodes if type(node) is list]


def _where(value: Any, path: tuple[str, ...], found: list[Any]) -> str:
    """Where `found`, a list at `path`, is in `value` (`messages[3].content`, as errors name fields): only for an
    error, so the walk that checks every list builds no names."""
    nodes: list[tuple[Any, str]] = [(value, "")]
    for step in path:
        if step == "*":
            nodes = [
                (item, f"{at}[{index}]") for node, at in nodes if type(node) is list for index, item in enumerate(node)
            ]
        else:
            nodes = [
                (node[step], f"{at}.{step}" if at else step)
                for node, at in nodes
                if type(node) is dict and step in node
            ]
    return next(at for node, at in nodes if node is found)


if __name__ == "__main__":
    # Ctrl-C reaches every process of a terminal's group: the gateway ends its workers itself, by closing their input
    # (and a gateway that dies closes it too).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    serve(sys.stdin.buffer, sys.stdout.buffer)
