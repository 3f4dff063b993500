"""Settings errors in words: where each one is (the file and its line, or the variable) and what is wrong, in the
terms of docs/configuration.md rather than pydantic's or PyYAML's.

A file is read with its nodes' positions kept (`read_yaml`), so that an error's key path leads back to a line. One
problem is one line; several are a short list, in the file's order.
"""

from __future__ import annotations

import difflib
import re
import types
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError
from pydantic_core import ErrorDetails

Loc = tuple[int | str, ...]
MAX_LISTED = 10

# What each pattern of the settings asks for (tests/unit/test_settings_errors.py: every pattern in them has its words).
PATTERN_WORDS = {
    r"^https?://[^\s/]+(/[^\s]*)?$": "must start with http:// or https:// and name a host, without spaces",
    r"^https?://": "must start with http:// or https://",
    r"^(redis|rediss|unix)://": "must start with redis://, rediss:// or unix://",
    r"^postgres(ql)?://": "must start with postgres:// or postgresql://",
    r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$": "must be 1-64 letters, digits or . _ -, starting with a letter or digit",
    r"^[a-z_][a-z0-9_]{0,62}$": "must be 1-63 lower-case letters, digits or _, not starting with a digit",
    r"^(DEBUG|INFO|WARNING|ERROR)$": "must be DEBUG, INFO, WARNING or ERROR",
    r"^[a-z0-9]([a-z0-9-]{0,30}[a-z0-9])?$": "must be 1-32 lower-case letters, digits or -, with no - first or last",
}
# PyYAML's commonest complaints, in words: (its problem, what to say, whether the place is where the context began).
_YAML_WORDS = [
    (re.compile(r"^expected ',' or '\]', but got"), "a '[' never closed, or a ',' missing in it", True),
    (re.compile(r"^expected ',' or '\}', but got"), "a '{' never closed, or a ',' missing in it", True),
    (
        re.compile(r"^expected the node content, but found '<stream end>'"),
        "the file ends where a value should follow (a '[' or '{' never closed?)",
        False,
    ),
    (re.compile(r"^expected <block end>, but found"), "indented differently from the lines it belongs with", False),
    (re.compile(r"^mapping values are not allowed here"), "a ': ' inside a value (quote the value)", False),
    (re.compile(r"^found character '\\t' that cannot start any token"), "a tab: YAML indents with spaces", False),
    (re.compile(r"^could not find expected ':'"), "a key without ':' after it", True),
]
# The key path a model validator's message starts with (`models[0].backends: ...`); `[]` ends what can be followed.
_LEADING_PATH = re.compile(r"^([a-z_]+(?:\[\d*\])?(?:\.[a-z_]+(?:\[\d*\])?)*): (.+)$", re.DOTALL)


def read_yaml(text: str) -> tuple[Any, yaml.Node | None]:
    """The document and its node tree (where each key and item stands); yaml.YAMLError when it is not YAML."""
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        return (None if node is None else loader.construct_document(node)), node
    finally:
        loader.dispose()


# PyYAML quotes what it found (a tag, an alias, a character, a token): a value's own text, which may be a secret
# (`admin_token: !abc...`); kept only when it is a single character or one of PyYAML's `<token>` names.
_QUOTED = re.compile(r"'(?!<)[^']{2,}'")


def _unquoted(words: str) -> str:
    return _QUOTED.sub("(the value's text, not repeated here)", words)


def yaml_problem(exc: yaml.YAMLError) -> str:
    """`line L, column C: not valid YAML: what`, one line (PyYAML's own message spans several), repeating no more
    of the text than a character (a setting's value may be a secret)."""
    if not isinstance(exc, yaml.MarkedYAMLError) or exc.problem_mark is None:
        # Not str(exc): a marked error's text carries a snippet of the line it is on.
        said = (exc.problem or exc.context or "") if isinstance(exc, yaml.MarkedYAMLError) else str(exc)
        return "not valid YAML: " + _unquoted(" ".join(said.split()))
    problem, mark = exc.problem or "", exc.problem_mark
    words = _unquoted(" ".join(problem.split()))
    for pattern, said, at_context in _YAML_WORDS:
        if pattern.match(problem):
            words = said
            if at_context and exc.context_mark is not None:
                mark = exc.context_mark
            break
    return f"line {mark.line + 1}, column {mark.column + 1}: not valid YAML: {words}"


def line_of(node: yaml.Node | None, loc: Loc) -> int | None:
    """The line of the deepest key or item of `loc` the document holds (a missing key: its section's line)."""
    if node is None:
        return None
    line = node.start_mark.line + 1
    for part in loc:
        if isinstance(node, yaml.MappingNode) and isinstance(part, str):
            # The last of a repeated key is the one read.
            pair = next(((key, value) for key, value in reversed(node.value) if key.value == part), None)
            if pair is None:
                break
            line, node = pair[0].start_mark.line + 1, pair[1]
        elif isinstance(node, yaml.SequenceNode) and isinstance(part, int) and part < len(node.value):
            node = node.value[part]
            line = node.start_mark.line + 1
        else:
            break
    return line


@dataclass(frozen=True)
class Sources:
    """Where the settings came from: the file (its name, its nodes) and the variables that set key paths."""

    file: str
    document: yaml.Node | None
    variables: Mapping[Loc, str]

    def place(self, loc: Loc) -> tuple[str, int | None]:
        """The variable that set the key, else the file and the key's line in it."""
        variable = next((name for path, name in self.variables.items() if loc[: len(path)] == path), None)
        if variable is not None:
            return variable, None
        line = line_of(self.document, loc) if loc else None
        return (self.file, None) if line is None else (f"{self.file}, line {line}", line)


def report(exc: ValidationError, root: type[BaseModel], sources: Sources) -> str:
    """Every problem, one line each; several are listed under a count, in the order of the file."""
    found: dict[tuple[Loc, str], list[str]] = {}
    for error in exc.errors():
        loc, path, reason = _followed(root, tuple(error["loc"]), error)
        found.setdefault((loc, path), []).append(reason)
    problems: list[tuple[int | None, str]] = []
    for (loc, path), reasons in found.items():
        where, line = sources.place(loc)
        problems.append((line, f"{where}: {path}: {_either(reasons)}" if path else f"{where}: {_either(reasons)}"))
    if len(problems) == 1:
        return problems[0][1]
    problems.sort(key=lambda problem: (problem[0] is None, problem[0] or 0))
    listed = [f"  {text}" for _, text in problems[:MAX_LISTED]]
    more = [f"  and {len(problems) - MAX_LISTED} more"] if len(problems) > MAX_LISTED else []
    return "\n".join([f"{len(problems)} problems:", *listed, *more])


def _followed(root: type[BaseModel], loc: Loc, error: ErrorDetails) -> tuple[Loc, str, str]:
    """The key path the error is at (union members' tags dropped), as a path and as text, and what is wrong there in
    words."""
    if not loc and error["type"] == "value_error":
        found = _LEADING_PATH.match(str(error["ctx"]["error"]))
        if found is not None:
            return _parsed(found.group(1)), found.group(1), found.group(2)
    kept: list[int | str] = []
    annotation: Any = root
    for part in loc:
        members = _members(annotation)
        if isinstance(part, int):
            items = [get_args(m)[0] for m in members if get_origin(m) is list]
            annotation = items[0] if items else Any
            kept.append(part)
            continue
        model = next((m for m in members if isinstance(m, type) and issubclass(m, BaseModel)), None)
        if model is None:
            continue  # a member of a union (`constrained-int`, `literal['auto']`), not a key
        kept.append(part)
        if part in model.model_fields:
            annotation = model.model_fields[part].annotation
        elif error["type"] == "extra_forbidden":
            return tuple(kept), _path(tuple(kept)), _unknown_key(part, model)
    return tuple(kept), _path(tuple(kept)), _words(error)


def _members(annotation: Any) -> list[Any]:
    """The types an annotation allows: a union's members, an Annotated's type."""
    if get_origin(annotation) in (Union, types.UnionType):
        return [member for arg in get_args(annotation) for member in _members(arg)]
    if hasattr(annotation, "__metadata__"):
        return _members(get_args(annotation)[0])
    return [annotation]


def _unknown_key(key: str, model: type[BaseModel]) -> str:
    nearest = difflib.get_close_matches(key, list(model.model_fields), n=1, cutoff=0.6)
    return f"unknown key; did you mean {nearest[0]}?" if nearest else "unknown key"


def _number(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _words(error: ErrorDetails) -> str:
    context = error.get("ctx", {})
    match error["type"]:
        case "missing":
            return "required, and not given"
        case "int_parsing" | "int_type" | "int_from_float":
            return "must be a whole number"
        case "float_parsing" | "float_type":
            return "must be a number"
        case "bool_parsing" | "bool_type":
            return "must be true or false"
        case "string_type":
            return "must be text"
        case "list_type":
            return "must be a list"
        case "model_type" | "model_attributes_type" | "dict_type":
            return "must be a section (a mapping of keys to values)"
        case "greater_than_equal":
            return f"must be at least {_number(context['ge'])}"
        case "greater_than":
            return f"must be more than {_number(context['gt'])}"
        case "less_than_equal":
            return f"must be at most {_number(context['le'])}"
        case "less_than":
            return f"must be less than {_number(context['lt'])}"
        case "literal_error":
            return f"must be {context['expected']}"
        case "string_pattern_mismatch":
            return PATTERN_WORDS.get(context["pattern"], f"must match the pattern {context['pattern']}")
        case "string_too_short":
            return f"must be at least {context['min_length']} characters long"
        case "too_short":
            return f"must hold at least {context['min_length']} item(s)"
        case "value_error":
            return str(context["error"])
    return error["msg"]


def _either(reasons: list[str]) -> str:
    """One key's reasons: a union's members each say what it would take."""
    if len(reasons) > 1 and all(reason.startswith("must be ") for reason in reasons):
        return "must be " + " or ".join(reason.removeprefix("must be ") for reason in reasons)
    return "; ".join(reasons)


def _parsed(path: str) -> Loc:
    """`models[0].backends` as a key path; it stops at `[]` (any item)."""
    loc: list[int | str] = []
    for name, index, anything in re.findall(r"([a-z_]+)|\[(\d+)\]|(\[\])", path):
        if anything:
            break
        loc.append(int(index) if index else name)
    return tuple(loc)


def _path(loc: Loc) -> str:
    text = ""
    for part in loc:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else str(part))
    return text
