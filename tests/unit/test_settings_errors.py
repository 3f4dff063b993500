"""Settings errors in words, naming where each is: the file and line, or the variable."""

from __future__ import annotations

import pytest
from pydantic import BaseModel

from gateway.cli.reference import section_model
from gateway.settings import Settings, SettingsError, parse_settings
from gateway.settings_errors import MAX_LISTED, PATTERN_WORDS


def complaint(text: str | None, environ: dict[str, str] | None = None) -> str:
    with pytest.raises(SettingsError) as caught:
        parse_settings(text, "b.yaml", environ or {})
    return str(caught.value)


def _patterns(model: type[BaseModel]) -> set[str]:
    found: set[str] = set()
    for field in model.model_fields.values():
        found |= {m.pattern for m in field.metadata if isinstance(getattr(m, "pattern", None), str)}
        inner = section_model(field.annotation)
        if inner is not None:
            found |= _patterns(inner)
    return found


def test_every_pattern_of_the_settings_is_said_in_words() -> None:
    patterns = _patterns(Settings)
    assert len(patterns) >= 6
    assert patterns <= set(PATTERN_WORDS), f"give these patterns their words: {patterns - set(PATTERN_WORDS)}"


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("tenants:\n  - id: a\n    key_hashes: ['sha256:" + "0" * 64 + "']\n    limits: {request_per_minute: 1}\n",
         "b.yaml, line 4: tenants[0].limits.request_per_minute: unknown key; did you mean requests_per_minute?"),
        ("tenant: []\n", "b.yaml, line 1: tenant: unknown key; did you mean tenants?"),
        ("listen:\n  host: 127.0.0.1\n  Port: 80\n", "b.yaml, line 3: listen.Port: unknown key; did you mean port?"),
        ("listen: {colour: blue}\n", "b.yaml, line 1: listen.colour: unknown key"),
    ],
)  # fmt: skip
def test_an_unknown_key_gets_the_nearest_known_one_if_any(text: str, said: str) -> None:
    assert complaint(text) == said


def test_an_unknown_key_from_a_variable_names_the_variable() -> None:
    said = complaint(None, {"BULKHEAD_LISTEN__PROT": "80"})
    assert said == "BULKHEAD_LISTEN__PROT: listen.prot: unknown key; did you mean port?"


def test_a_url_without_its_scheme_says_what_it_must_start_with() -> None:
    said = complaint("backends:\n  - name: a\n    url: 10.0.0.5:8000\n")
    assert (
        said == "b.yaml, line 3: backends[0].url: must start with http:// or https:// and name a host, without spaces"
    )
    said = complaint("redis_url: 10.0.0.7:6379\n")
    assert said == "b.yaml, line 1: redis_url: must start with redis://, rediss:// or unix://"


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("models:\n  - name: m\n    backends: [a, b\n", "line 3, column 15: not valid YAML: a '[' never closed"),
        ("listen:\n\tport: 1\n", "line 2, column 1: not valid YAML: a tab: YAML indents with spaces"),
        ("listen:\n  host: a\n port: 1\n", "line 3, column 2: not valid YAML: indented differently"),
        ("log_level: level: INFO\n", "line 1, column 17: not valid YAML: a ': ' inside a value (quote the value)"),
    ],
)
def test_a_file_that_is_not_yaml_is_one_line_naming_the_file_and_the_line(text: str, said: str) -> None:
    line = complaint(text)
    assert line.startswith(f"b.yaml, {said}") and "\n" not in line and "<unicode string>" not in line


def test_a_variable_that_is_not_yaml_is_one_line() -> None:
    line = complaint(None, {"BULKHEAD_LISTEN": "{port: [}"})
    assert line.startswith("environment variable BULKHEAD_LISTEN: line 1, column ") and "\n" not in line


def test_a_value_of_either_kind_says_both() -> None:
    assert complaint("workers: many\n") == "b.yaml, line 1: workers: must be a whole number or 'auto'"


def test_a_check_across_sections_is_placed_at_its_line() -> None:
    said = complaint("backends: []\nmodels:\n  - name: m\n    backends: [ghost]\n")
    assert said == "b.yaml, line 4: models[0].backends: model 'm' names unknown backend 'ghost'"


def test_a_key_the_environment_set_names_the_variable_not_the_file() -> None:
    said = complaint("listen: {port: 8080}\n", {"BULKHEAD_LISTEN__PORT": "eighty"})
    assert said == "BULKHEAD_LISTEN__PORT: listen.port: must be a whole number"


def test_a_missing_key_is_placed_at_its_section_and_a_secret_is_never_repeated() -> None:
    assert complaint("backends:\n  - name: a\n") == "b.yaml, line 2: backends[0].url: required, and not given"
    said = complaint("admin_token: hunter2\n")
    assert said == "b.yaml, line 1: admin_token: must be at least 16 characters long" and "hunter2" not in said


def test_several_problems_are_listed_in_the_files_order_and_many_are_cut_short() -> None:
    said = complaint("surprise: 1\nlisten: {port: x}\n").splitlines()
    assert said == [
        "2 problems:",
        "  b.yaml, line 1: surprise: unknown key",
        "  b.yaml, line 2: listen.port: must be a whole number",
    ]
    many = complaint("".join(f"unknown_{n}: 1\n" for n in range(MAX_LISTED + 3))).splitlines()
    assert many[0] == f"{MAX_LISTED + 3} problems:" and many[-1] == "  and 3 more" and len(many) == MAX_LISTED + 2


@pytest.mark.parametrize("value", ["!s3cretTOKENvalue0123", "*s3cretTOKENvalue0123", "|s3cretTOKENvalue0123"])
def test_a_value_yaml_cannot_read_is_not_repeated_from_the_file_or_the_environment(value: str) -> None:
    # PyYAML quotes the tag, alias or token it choked on: a token that starts with one would be echoed whole.
    said = complaint(f"admin_token: {value}\n")
    assert said.startswith("b.yaml, line 1") and "s3cret" not in said
    said = complaint(None, {"BULKHEAD_ADMIN_TOKEN": value})
    assert said.startswith("environment variable BULKHEAD_ADMIN_TOKEN: line 1") and "s3cret" not in said
