"""The console's timeline of an exposure (gateway/api/console/timeline.py): a lane per tenant, the most served first;
each answer in the slice where it ended, by what became of it; a lone leak among many answers still seen; marks
where they happened, past the window too; a window from the ledger's horizon drawn from where answers begin."""

from __future__ import annotations

import itertools

import pytest

from gateway.api.console.timeline import BAR, LEFT, MAX_LANES, MIN_BAR, RIGHT, WIDTH, draw, kind_of
from gateway.incidents.exposure import Exposure, Window
from gateway.incidents.ledger import DELIVERED, FAILED, JUDGED, PARTIAL, WITHHELD, Served

T0 = 1_800_000_000.0
IDS = itertools.count()


def answer(tenant: str, end: float, verdict: str = DELIVERED, kinds: str = "") -> Served:
    return Served(f"r{next(IDS)}", tenant, "m", "gpu-7", end - 0.5, end, verdict, kinds)


def exposure(served: list[Served], since: float = T0, until: float = T0 + 100) -> Exposure:
    return Exposure(Window("gpu-7", since, until, "last clean probe", "left rotation"), None, served, False)


def test_what_became_of_an_answer_is_its_kind() -> None:
    assert kind_of(answer("a", T0)) == "delivered"
    assert kind_of(answer("a", T0, PARTIAL)) == "delivered"
    assert kind_of(answer("a", T0, PARTIAL, "leak")) == "leaked"
    assert kind_of(answer("a", T0, DELIVERED, "usage_mismatch,fingerprint_leak")) == "leaked"
    assert kind_of(answer("a", T0, DELIVERED, "usage_mismatch")) == "delivered", "no other tenant's data found in it"
    assert kind_of(answer("a", T0, WITHHELD, "leak")) == "withheld"
    assert kind_of(answer("a", T0, FAILED)) == kind_of(answer("a", T0, JUDGED)) == "other"


def test_each_tenant_has_a_lane_and_each_answer_a_bar_where_it_ended() -> None:
    served = [answer("acme", T0 + 10 * k) for k in range(1, 10)] + [answer("beta", T0 + 95, WITHHELD, "leak")]
    timeline = draw(exposure(served), [])
    assert [(lane.tenant, lane.answers) for lane in timeline.lanes] == [("acme", 9), ("beta", 1)]
    [beta] = timeline.lanes[1].bars
    plot = WIDTH - LEFT - RIGHT
    assert beta.kind == "withheld" and LEFT + plot * 0.94 < beta.x < LEFT + plot * 0.96
    assert beta.title.startswith("beta, ") and beta.title.endswith(": 1 withheld")
    assert all(bar.height == BAR for bar in timeline.lanes[0].bars), "one answer a slice: each as tall as the lane"
    assert timeline.since == T0 and timeline.until == T0 + 100 and timeline.window_end_x == WIDTH - RIGHT


def test_a_lone_leak_among_hundreds_of_answers_is_still_seen_on_top() -> None:
    served = [answer("acme", T0 + 50) for _ in range(500)] + [answer("acme", T0 + 50, DELIVERED, "leak")]
    [lane] = draw(exposure(served), []).lanes
    delivered, leaked = lane.bars
    assert (delivered.kind, leaked.kind) == ("delivered", "leaked")
    assert leaked.height == MIN_BAR and leaked.y + leaked.height == delivered.y, "stacked on the delivered"


def test_marks_are_drawn_where_they_happened_and_the_drawing_goes_on_to_the_last() -> None:
    served = [answer("acme", T0 + 50)]
    marks = [(T0 + 40, "opened", "opened"), (T0 + 100, "contained", "left"), (T0 + 150, "notice", "notice")]
    timeline = draw(exposure(served), marks)
    assert timeline.until == T0 + 150
    xs = {mark.kind: mark.x for mark in timeline.marks}
    plot = WIDTH - LEFT - RIGHT
    expected = {"opened": LEFT + plot * 40 / 150, "contained": LEFT + plot * 100 / 150, "notice": WIDTH - RIGHT}
    assert xs == pytest.approx(expected, abs=0.1)
    assert timeline.window_end_x == xs["contained"], "shaded past the window's end"


def test_a_window_from_the_ledgers_horizon_is_drawn_from_its_first_answer() -> None:
    days = 14 * 86_400
    served = [answer("acme", T0 + days - 60), answer("acme", T0 + days - 10)]
    timeline = draw(exposure(served, T0, T0 + days), [])
    assert T0 + days - 70 < timeline.since < T0 + days - 60.5
    assert timeline.ticks[0].label.count(":") == 2, "to the second, over a minute"
    assert draw(exposure([], T0, T0 + 100), []).since == T0


def test_past_the_lanes_drawn_the_rest_are_counted() -> None:
    served = [answer(f"t{n:02}", T0 + 50) for n in range(MAX_LANES + 3)]
    timeline = draw(exposure(served), [])
    assert len(timeline.lanes) == MAX_LANES and timeline.hidden == 3
    long_name = draw(exposure([answer("x" * 64, T0 + 1)]), []).lanes[0]
    assert len(long_name.label) < 64 and long_name.label.endswith("…") and long_name.tenant == "x" * 64
