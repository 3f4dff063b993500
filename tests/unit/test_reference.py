"""docs/configuration.md is what the settings models say: a key added, renamed or re-described without it fails."""

from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import BaseModel, Field

from gateway.cli import reference
from gateway.settings import ListenSettings, Settings

PAGE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_the_committed_page_is_the_generated_one() -> None:
    assert PAGE.read_text(encoding="utf-8") == reference.reference(), (
        "docs/configuration.md is stale: run `python -m gateway.cli.reference > docs/configuration.md`"
    )


def test_every_key_of_the_settings_is_on_the_page() -> None:
    page = reference.reference()
    for section in ("## `listen`", "## `models[].fairness`", "## `tenants[].limits`", "## `isolation.canary.keys[]`"):
        assert section in page
    for row in ("| `max_num_seqs` |", "| `weight` |", "| `priority` |", "| `redis_key_prefix` |", "| `policy` |"):
        assert row in page
    rows = [line for line in page.splitlines() if line.startswith("| `")]
    assert len(rows) == sum(1 for _ in _leaves(Settings))


def test_a_key_without_a_description_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    bare = ListenSettings.model_fields["host"]
    monkeypatch.setitem(ListenSettings.model_fields, "host", Field(default=bare.default))
    with pytest.raises(ValueError, match="'host' has no description"):
        reference.reference()


def test_defaults_and_bounds_read_as_written() -> None:
    page = reference.reference()
    assert "| `port` | integer | `8080` |" in page and "(≥ 0, ≤ 65535)" in page
    assert '| `models` | list of text | `["*"]` |' in page
    assert "| `on_output_overflow` | `reject` \\| `clamp` | `reject` |" in page
    assert "| `api_key` | text or null | unset |" in page


def _leaves(model: type[BaseModel]) -> list[str]:
    found: list[str] = []
    for name, field in model.model_fields.items():
        inner = reference.section_model(field.annotation)
        found.extend(_leaves(inner) if inner is not None else [name])
    return found
