"""The collector's full passes wait while a large body's request is in the gateway (gateway/api/collector.py)."""

from __future__ import annotations

import asyncio
import gc

import pytest

from gateway.api import collector
from gateway.api.collector import HELD, hold_while


class Request:
    """Stands for a request: what a hold lasts as long as."""


async def settled() -> None:
    # An owner gone ends its hold on the loop, a turn later.
    for _ in range(3):
        await asyncio.sleep(0)


async def test_full_passes_wait_until_the_last_large_bodys_request_has_gone() -> None:
    before = gc.get_threshold()
    first, second = Request(), Request()
    hold_while(first)
    assert gc.get_threshold() == (*before[:2], HELD)
    hold_while(second)
    del first
    await settled()
    assert gc.get_threshold() == (*before[:2], HELD)
    del second
    await settled()
    assert gc.get_threshold() == before


async def test_a_hold_lasts_hold_s_at_most_and_holds_in_a_row_let_a_full_pass_run_each_hold_s(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(collector, "HOLD_S", 0.05)
    before = gc.get_threshold()
    kept = [Request()]
    hold_while(kept[0])
    await asyncio.sleep(0.08)  # its request lives on, but its hold has ended
    assert gc.get_threshold() == before
    try:
        hold_while(kept[0])
        await asyncio.sleep(0.03)
        kept.append(Request())
        hold_while(kept[1])  # held off 30 ms in a row: on
        assert gc.get_threshold() == (*before[:2], HELD)
        await asyncio.sleep(0.03)
        kept.append(Request())
        hold_while(kept[2])  # 60 ms: the next full pass may run, though holds are out
        assert gc.get_threshold() == before
        kept.append(Request())
        hold_while(kept[3])
        assert gc.get_threshold() == before  # until it has
        gc.collect()
        kept.append(Request())
        hold_while(kept[4])
        assert gc.get_threshold() == (*before[:2], HELD)
    finally:
        kept.clear()
        await settled()
    assert gc.get_threshold() == before
