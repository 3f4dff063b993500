"""Where markers go (isolation/inject.py): each placement, templates that write the system text late, and the
property the prefix cache needs: a conversation's next request, planted, starts with this one's."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from isolation.inject import MarkerPlacement, inject_chat, system_leads
from isolation.sim.tinymodel import cached_tokenizer
from isolation.tokens import ModelTokenizer

M = "cnry marker words"
PLACEMENTS: tuple[MarkerPlacement, ...] = ("start", "turns", "system", "user", "both")
# Mistral's templates write the system text in front of the last user turn, not first.
LATE_SYSTEM = (
    "{% set system = messages | selectattr('role', 'equalto', 'system') | map(attribute='content') | first %}"
    "{% set users = messages | selectattr('role', 'equalto', 'user') | list %}"
    "{% for m in messages if m['role'] != 'system' %}"
    "{% if m['role'] == 'user' %}[INST] {% if m is sameas users[-1] and system %}{{ system }}\n\n{% endif %}"
    "{{ m['content'] }}[/INST]{% else %}{{ m['content'] }}</s>{% endif %}{% endfor %}"
)


def planted(messages: list[dict[str, Any]], placement: MarkerPlacement, system_first: bool = True) -> list[Any]:
    payload: dict[str, Any] = {"messages": messages}
    inject_chat(payload, M, placement, system_first)
    return [m.get("content") for m in payload["messages"]]


SYS, U1, A1, U2 = (
    {"role": "system", "content": "Be terse."},
    {"role": "user", "content": "one"},
    {"role": "assistant", "content": "ok"},
    {"role": "user", "content": "two"},
)


@pytest.mark.parametrize(
    ("placement", "messages", "expected"),
    [
        ("start", [U1], [f"{M}\none"]),
        ("start", [SYS, U1, A1, U2], [f"{M}\nBe terse.", "one", "ok", "two"]),
        ("start", [U1, A1, U2], [f"{M}\none", "ok", "two"]),
        ("start", [A1], [M, "ok"]),
        ("turns", [SYS, U1, A1, U2], [f"{M}\nBe terse.", "one", "ok", f"{M}\ntwo"]),
        ("turns", [U1, A1, U2], [f"{M}\none", "ok", f"{M}\ntwo"]),
        ("system", [U1], [M, "one"]),
        ("system", [SYS, U1], [f"{M}\nBe terse.\n{M}", "one"]),
        ("user", [SYS, U1, A1, U2], ["Be terse.", f"{M}\none", "ok", f"{M}\ntwo"]),
        ("both", [U1, A1, U2], [M, f"{M}\none", "ok", f"{M}\ntwo"]),
        ("both", [SYS, U1], [f"{M}\nBe terse.\n{M}", f"{M}\none"]),
    ],
)
def test_each_placement_puts_the_marker_where_it_says(
    placement: MarkerPlacement, messages: list[dict[str, Any]], expected: list[Any]
) -> None:
    before = [dict(m) for m in messages]
    assert planted(messages, placement) == expected
    assert messages == before  # the caller's messages are left as they were


def test_a_template_that_writes_the_system_text_late_gets_the_marker_in_the_first_user_turn() -> None:
    assert planted([SYS, U1, A1, U2], "start", system_first=False) == ["Be terse.", f"{M}\none", "ok", "two"]
    assert planted([SYS, U1, A1, U2], "turns", system_first=False) == ["Be terse.", f"{M}\none", "ok", f"{M}\ntwo"]
    assert planted([SYS], "start", system_first=False) == [f"{M}\nBe terse."]  # no user turn: the system text


def test_content_parts_get_a_text_part_in_front() -> None:
    parts = [{"type": "text", "text": "look"}, {"type": "image_url", "image_url": {"url": "data:,"}}]
    assert planted([{"role": "user", "content": parts}], "start") == [[{"type": "text", "text": M}, *parts]]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return cached_tokenizer(tmp_path_factory.mktemp("tokenizers"))


def test_system_leads_reads_the_template(tiny: Path, tmp_path: Path) -> None:
    assert system_leads(ModelTokenizer.from_dir(tiny)) is True
    late = tmp_path / "late"
    shutil.copytree(tiny, late)
    config = json.loads((late / "tokenizer_config.json").read_text())
    (late / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": LATE_SYSTEM}))
    assert system_leads(ModelTokenizer.from_dir(late)) is False
    del config["chat_template"]
    (late / "tokenizer_config.json").write_text(json.dumps(config))
    assert system_leads(ModelTokenizer.from_dir(late)) is True  # no template: it cannot tell


TURN = st.sampled_from(["user", "assistant", "tool"])


@settings(max_examples=200, deadline=None)
@given(st.booleans(), st.lists(TURN, min_size=1, max_size=8), st.sampled_from(PLACEMENTS), st.booleans(), st.data())
def test_a_conversations_next_request_starts_with_this_ones_as_planted(
    system: bool, roles: list[str], placement: MarkerPlacement, system_first: bool, data: st.DataObject
) -> None:
    messages = ([SYS] if system else []) + [{"role": r, "content": f"{r} {n}"} for n, r in enumerate(roles)]
    cut = data.draw(st.integers(1, len(messages)))
    # A conversation's first request holds a user turn (one without any is planted in an added system message).
    assume(any(m["role"] == "user" for m in messages[:cut]))
    now, later = planted(messages[:cut], placement, system_first), planted(messages, placement, system_first)
    assert later[: len(now)] == now
