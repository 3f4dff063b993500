"""An incident's exposure as a timeline: a lane for each tenant the replica answered in the window, that tenant's
answers over time as bars (one a time slice, by when each answer ended), each bar split by what became of the answers
(delivered, withheld, leaked: delivered whole or in part with another tenant's data in it, or another end), and a
vertical mark for the incident's opening, its leaving rotation, its closing and each notice.

Only the geometry is made here, as plain values; templates/timeline.svg draws it as inline SVG (escaped, with no
script and no style attribute, under the console's Content-Security-Policy).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Final

from gateway.incidents.exposure import Exposure, carried_leak
from gateway.incidents.ledger import DELIVERED, PARTIAL, WITHHELD, Served

WIDTH = 960
LEFT = 180  # a tenant's name, cut to LABEL_CHARS
RIGHT = 16
TOP = 10
AXIS = 26
LANE = 30
BAR = 22
LABEL_CHARS = 24
SLICES = 72  # bars a lane: about 11 px each, wide enough to hover, narrow enough to tell minutes apart
MAX_LANES = 12  # the rest are in the table under the timeline
MIN_BAR = 2.0  # px: one leaked answer in a slice of hundreds delivered must still be seen
TICKS = 6

LEAKED: Final = "leaked"
OTHER: Final = "other"  # failed (nothing went out) or judged (a judge's answer, sent to no tenant)
KINDS = (DELIVERED, OTHER, WITHHELD, LEAKED)  # stacked from the bottom: what matters most on top


@dataclass(frozen=True)
class Bar:
    x: float
    y: float
    width: float
    height: float
    kind: str
    title: str


@dataclass(frozen=True)
class Lane:
    tenant: str
    label: str
    y: float  # of the label's baseline
    answers: int
    bars: list[Bar]


@dataclass(frozen=True)
class Mark:
    x: float
    kind: str  # opened, contained, closed, notice
    title: str


@dataclass(frozen=True)
class Tick:
    x: float
    label: str
    anchor: str  # the label's text-anchor: the first and last kept inside the drawing


@dataclass(frozen=True)
class Timeline:
    width: int
    height: int
    plot_top: float
    plot_bottom: float
    since: float  # where the drawing starts: the window's start, or near its first answer (`draw`)
    until: float  # where it ends: the window's end, or its last mark
    window_end_x: float  # past it, the replica served no more in the window (shaded)
    right_x: float
    lanes: list[Lane]
    marks: list[Mark]
    ticks: list[Tick]
    hidden: int  # tenants not drawn (past MAX_LANES)


def kind_of(served: Served) -> str:
    if served.verdict == WITHHELD:
        return WITHHELD
    if served.verdict in (DELIVERED, PARTIAL):
        return LEAKED if carried_leak(served) else DELIVERED
    return OTHER


def _clock(at: float, span: float) -> str:
    """A time to the precision the span tells apart: tenths of a second over seconds, the day over days."""
    when = datetime.fromtimestamp(at, UTC)
    if span < 20:
        return when.strftime("%H:%M:%S.%f")[:-5]
    return when.strftime("%m-%d %H:%M" if span > 86_400 else "%H:%M:%S" if span < 3600 else "%H:%M")


def _start(exposure: Exposure, marks: Sequence[tuple[float, str, str]]) -> float:
    """The window's start; but when nothing happened in most of it (a window from the ledger's horizon, days before
    its first answer), a little before the first thing that did, so that the answers are not squeezed to the edge."""
    since, until = exposure.window.since, exposure.window.until
    first = min([s.start for s in exposure.served] + [at for at, _, _ in marks if since <= at <= until], default=since)
    first = max(first, since)
    if first - since <= until - first:
        return since
    return max(since, first - 0.05 * max(until - first, 1.0))


def _bars(tenant: str, answers: list[Served], since: float, span: float, y: float) -> list[Bar]:
    slices: list[Counter[str]] = [Counter() for _ in range(SLICES)]
    for served in answers:
        at = min(max(served.end, since), since + span)
        slices[min(SLICES - 1, int((at - since) / span * SLICES))][kind_of(served)] += 1
    tallest = max((sum(c.values()) for c in slices), default=0)
    width = (WIDTH - LEFT - RIGHT) / SLICES
    bars = []
    for n, counts in enumerate(slices):
        base = y + BAR
        start = since + span * n / SLICES
        when = f"{_clock(start, span)}–{_clock(start + span / SLICES, span)} UTC"
        for kind in KINDS:
            if not counts[kind]:
                continue
            height = max(MIN_BAR, BAR * counts[kind] / tallest)
            base -= height
            title = f"{tenant}, {when}: {counts[kind]} {kind}"
            x = round(LEFT + n * width + 1, 1)
            bars.append(Bar(x, round(base, 1), round(width - 2, 1), round(height, 1), kind, title))
    return bars


def draw(exposure: Exposure, marks: Sequence[tuple[float, str, str]]) -> Timeline:
    """The timeline of what the exposure holds; `marks` are (time, kind, title), drawn from the window's start on. The
    drawing goes on past the window's end to the last mark (notices are made once the probe confirms, after the
    replica left rotation), that part shaded."""
    since, window_end = _start(exposure, marks), exposure.window.until
    until = max([window_end, *(at for at, _, _ in marks)])
    span = max(until - since, 1.0)
    recipients = exposure.by_recipient()
    lanes = []
    for n, (tenant, answers) in enumerate(recipients[:MAX_LANES]):
        y = TOP + AXIS + n * LANE
        label = tenant if len(tenant) <= LABEL_CHARS else tenant[: LABEL_CHARS - 1] + "…"
        lanes.append(Lane(tenant, label, y + BAR - 6, len(answers), _bars(tenant, answers, since, span, y)))
    plot_bottom = TOP + AXIS + max(len(lanes), 1) * LANE

    def x_of(at: float) -> float:
        return round(LEFT + (WIDTH - LEFT - RIGHT) * (at - since) / span, 1)

    drawn = [Mark(x_of(at), kind, title) for at, kind, title in marks if since <= at]
    anchors = ["start", *["middle"] * (TICKS - 1), "end"]
    at = [since + span * n / TICKS for n in range(TICKS + 1)]
    ticks = [Tick(x_of(t), _clock(t, span), anchor) for t, anchor in zip(at, anchors, strict=True)]
    return Timeline(
        WIDTH, int(plot_bottom + 8), TOP + AXIS, plot_bottom, since, until, x_of(window_end), WIDTH - RIGHT, lanes,
        drawn, ticks, max(0, len(recipients) - MAX_LANES),
    )  # fmt: skip
