"""A large body's objects freed in a thread a piece at a time once the gateway is done with them
(gateway/leftovers.py), and the collector's full passes held off meanwhile (gateway/collector.py)."""

from __future__ import annotations

import gc
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import pytest

from gateway import collector, leftovers
from gateway.collector import HELD, hold
from gateway.leftovers import let_go


def test_full_passes_wait_until_the_last_hold_has_ended() -> None:
    before = gc.get_threshold()
    first, second = hold(), hold()
    assert gc.get_threshold() == (*before[:2], HELD)
    first()
    first()  # once only
    assert gc.get_threshold() == (*before[:2], HELD)
    second()
    assert gc.get_threshold() == before


def test_holds_in_a_row_let_a_full_pass_run_every_hold_s(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(collector, "HOLD_S", 0.05)
    before = gc.get_threshold()
    ends: list[Callable[[], None]] = [hold()]
    try:
        time.sleep(0.03)
        ends.append(hold())  # held off 30 ms in a row: on
        assert gc.get_threshold() == (*before[:2], HELD)
        time.sleep(0.03)
        ends.append(hold())  # 60 ms: the next full pass may run, though holds are out
        assert gc.get_threshold() == before
        ends.append(hold())
        assert gc.get_threshold() == before  # until it has
        gc.collect()
        ends.append(hold())
        assert gc.get_threshold() == (*before[:2], HELD)
    finally:
        for end in ends:
            end()
    assert gc.get_threshold() == before


class Part:
    """Stands for a model of a content part: an object whose fields are its __dict__, and whose freeing shows."""

    freed_in: set[str] = set()  # the threads parts were freed in

    def __init__(self, text: str) -> None:
        self.text = text

    def __del__(self) -> None:
        Part.freed_in.add(threading.current_thread().name)


def eventually(check: Callable[[], bool]) -> bool:
    deadline = time.monotonic() + 5
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def test_an_object_let_go_is_taken_apart_once_its_owner_drops_it_and_what_others_hold_is_left_whole() -> None:
    before = gc.get_threshold()
    shared = [Part("kept")]
    parts = [Part(str(n)) for n in range(1000)]
    freed = weakref.ref(parts[500])
    body: dict[str, Any] = {"messages": [{"content": parts}], "shared": shared}
    del parts
    let_go(body)
    time.sleep(5 * leftovers.POLL_S)
    # Its owner holds it still: whole.
    assert list(body) == ["messages", "shared"] and len(body["messages"][0]["content"]) == 1000
    assert freed() is not None
    assert gc.get_threshold() == (*before[:2], HELD)
    Part.freed_in.clear()
    del body
    assert eventually(lambda: freed() is None)
    assert Part.freed_in == {"bulkhead-leftovers"}  # not here, where the last reference was dropped
    assert len(shared) == 1 and shared[0].text == "kept"
    assert eventually(lambda: gc.get_threshold() == before)


def test_an_object_kept_past_hold_s_is_left_to_its_owner(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(collector, "HOLD_S", 0.05)
    before = gc.get_threshold()
    body: dict[str, Any] = {"messages": [[Part("x")] * 3]}
    let_go(body)
    assert eventually(lambda: gc.get_threshold() == before)
    assert len(body["messages"][0]) == 3
