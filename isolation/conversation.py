"""A chat request as vLLM hands it to the chat template: its messages, its tools and the template's variables.

vLLM (0.32) does not render a client's messages as sent. It rebuilds each one (vllm/renderers/chat_utils.py,
`parse_chat_messages`): only the keys templates read are kept, content becomes one string or a list of text parts
depending on the template (hf.py, `_detect_content_format`), tool-call arguments are parsed into an object (or `{}`
when they are not one), a system text's Claude Code billing line is cut, developer messages become system ones for
a template that never names the role, tools go through its pydantic model (a missing description or parameters
becomes null), and its own template variables are laid over the client's (`merge_kwargs`, which drops null and
"auto"). A count is exact only if each of these steps is taken here as vLLM takes it; each function below names
the vLLM code it follows.
"""

from __future__ import annotations

import json
from collections import deque
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Literal

from jinja2 import nodes

ContentFormat = Literal["string", "openai"]
Reasoning = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]

BILLING_HEADER = "x-anthropic-billing-header"
# transformers' apply_chat_template takes these as its own arguments (tokenize=False makes the tokenizer's ones
# moot), so a template never sees them even when a client's chat_template_kwargs name them.
_CONSUMED = frozenset(
    {"chat_template", "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict",
     "return_assistant_tokens_mask", "tokenizer_kwargs", "continue_final_message"}
)  # fmt: skip
_UNSET = (None, "auto")  # what vLLM's merge_kwargs treats as not given


def strip_billing_header(text: str) -> str:
    """A system text part without Claude Code's per-request billing line (chat_utils
    `_strip_claude_code_billing_header`): the rest after its first line, "" when nothing is left."""
    if not text.startswith(BILLING_HEADER):
        return text
    return text.partition("\n")[2]


def _texts(role: str, content: object) -> list[str]:
    if content is None:
        return []
    parts = [content] if isinstance(content, str) else content if isinstance(content, list) else []
    texts = []
    for part in parts:
        text = part if isinstance(part, str) else part.get("text") if isinstance(part, Mapping) else None
        if not isinstance(text, str):
            continue
        if role == "system" and text.startswith(BILLING_HEADER):
            text = strip_billing_header(text)
            if not text:
                continue
        texts.append(text)
    return texts


def _message(message: Mapping[str, Any], content_format: ContentFormat) -> dict[str, Any]:
    """One message as chat_utils `_parse_chat_message_content` makes it, after the chat route renamed a
    `reasoning_content` to `reasoning` (protocol.py `_normalize_messages_before`)."""
    role = str(message["role"])
    texts = _texts(role, message.get("content"))
    content: str | list[dict[str, str]]
    if content_format == "openai":
        content = [{"type": "text", "text": text} for text in texts]
    else:
        content = "\n".join(text for text in texts if text)  # an empty part is dropped before the join
    result: dict[str, Any] = {"role": role, "content": content}
    reasoning = message.get("reasoning")
    if reasoning is None:
        reasoning = message.get("reasoning_content")
    if role == "assistant":
        if message.get("tool_calls") is not None:
            result["tool_calls"] = _tool_calls(message["tool_calls"])
        if reasoning is not None:
            result["reasoning"] = result["reasoning_content"] = reasoning
    elif role == "tool":
        if "tool_call_id" in message:
            result["tool_call_id"] = message["tool_call_id"]
        if isinstance(content, list):  # every part is text: joined, empty ones too
            result["content"] = "\n".join(part["text"] for part in content)
    for key in ("name", "task"):
        if isinstance(message.get(key), str):
            result[key] = message[key]
    if role == "developer":
        result["tools"] = message.get("tools")
    return result


def _tool_calls(calls: object) -> object:
    """chat_utils `_postprocess_messages`: each call's arguments as an object; `{}` for arguments that are empty,
    not JSON, or JSON of another kind (an array, a string), so that a call cut short in the history still renders."""
    if not isinstance(calls, list):
        return calls
    parsed = []
    for call in calls:
        if not isinstance(call, Mapping) or not isinstance(call.get("function"), Mapping):
            parsed.append(call)
            continue
        function = dict(call["function"])
        arguments = function.get("arguments")
        value: object = {}
        if isinstance(arguments, str) and arguments:
            try:
                value = json.loads(arguments)
            except ValueError:
                value = {}
        elif arguments:
            value = arguments
        function["arguments"] = value if isinstance(value, dict) else {}
        parsed.append({**call, "function": function})
    return parsed


def conversation(
    messages: Sequence[Mapping[str, Any]], content_format: ContentFormat, knows_developer: bool
) -> list[dict[str, Any]]:
    """The messages the template renders."""
    converted = [_message(message, content_format) for message in messages]
    for message in converted:
        if message.get("tool_calls") == []:
            del message["tool_calls"]  # an empty list would put the template on its tool-call path
    if knows_developer or not any(message["role"] == "developer" for message in converted):
        return converted
    return _consolidated([_as_system(message) for message in converted])


def _as_system(message: dict[str, Any]) -> dict[str, Any]:
    # hf.py `_convert_developer_to_system`
    if message["role"] != "developer":
        return message
    return {key: value for key, value in message.items() if key != "tools"} | {"role": "system"}


def _consolidated(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """hf.py `_consolidate_system_messages`: once developer messages became system ones, every system message is
    merged into one at the start (blank lines between), unless the only one already is."""
    contents: list[str] = []
    others: list[dict[str, Any]] = []
    merge = False
    for index, message in enumerate(messages):
        if message["role"] != "system":
            others.append(message)
            continue
        merge = merge or index > 0 or bool(contents)
        content = message.get("content", "")
        if isinstance(content, list):
            content = "\n".join(part["text"] for part in content)
        if content:
            contents.append(content)
    if not merge:
        return messages
    return [{"role": "system", "content": "\n\n".join(contents)}, *others]


def tool_dicts(tools: Sequence[Mapping[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Tools as `tool.model_dump()` of vLLM's ChatCompletionToolsParam gives them: description and parameters
    always present (null when not given), strict only when given, in the model's key order."""
    if tools is None:
        return None
    dumped = []
    for tool in tools:
        function = tool.get("function") or {}
        definition = {key: function.get(key) for key in ("name", "description", "parameters")}
        if function.get("strict") is not None:
            definition["strict"] = function["strict"]
        dumped.append({"type": tool.get("type", "function"), "function": definition})
    return dumped


def _merge(defaults: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    # vLLM's renderers/params.py merge_kwargs
    return {**defaults, **{key: value for key, value in overrides.items() if value not in _UNSET}}


def template_variables(
    kwargs: Mapping[str, Any] | None, *, add_generation_prompt: bool, reasoning_effort: str | None
) -> dict[str, Any]:
    """What the template sees besides the messages, the tools and the special tokens: the client's
    chat_template_kwargs under vLLM's own (ChatCompletionRequest.build_chat_params, then ChatParams.with_defaults),
    less what transformers' apply_chat_template keeps for itself, with `documents` and `add_generation_prompt`
    always defined, as transformers passes them."""
    ours: dict[str, Any] = {
        "add_generation_prompt": add_generation_prompt,
        "continue_final_message": False,
        "documents": None,
        "reasoning_effort": reasoning_effort,
    }
    given = dict(kwargs or {})
    if reasoning_effort is not None and "enable_thinking" not in given:
        ours["enable_thinking"] = reasoning_effort != "none"
    merged = _merge({}, _merge(given, ours))
    variables = {key: value for key, value in merged.items() if key not in _CONSUMED}
    variables.setdefault("documents", None)
    variables.setdefault("add_generation_prompt", False)
    return variables


def knows_developer(source: str) -> bool:
    """hf.py `_detect_developer_role_support`: the template names the developer role in quotes."""
    return '"developer"' in source or "'developer'" in source


# hf.py `_detect_content_format` and its helpers, which read the template's syntax tree: a template that loops over
# a message's content (directly, through a variable assigned from it, or through a macro it is passed to) gets
# content as a list of parts ("openai"); any other gets one string.


class _Unreadable(Exception):
    """A loop or assignment of a shape vLLM's detection asserts against (a tuple target): it then says "string"."""


def content_format(tree: nodes.Template) -> ContentFormat:
    try:
        next(_content_loops(tree))
    except (StopIteration, _Unreadable):
        return "string"
    return "openai"


def _name(target: nodes.Node) -> str:
    if not isinstance(target, nodes.Name):
        raise _Unreadable
    return target.name


def _is_var(node: nodes.Node, name: str) -> bool:
    return isinstance(node, nodes.Name) and node.ctx == "load" and node.name == name


def _is_attr(node: nodes.Node, name: str, key: str) -> bool:
    if isinstance(node, nodes.Getitem):
        return _is_var(node.node, name) and isinstance(node.arg, nodes.Const) and node.arg.value == key
    if isinstance(node, nodes.Getattr):
        return _is_var(node.node, name) and node.attr == key
    return False


def _is_var_or_elems(node: nodes.Node, name: str, key: str | None = None) -> bool:
    if isinstance(node, nodes.Filter):
        return node.node is not None and _is_var_or_elems(node.node, name, key)
    if isinstance(node, nodes.Test):
        return _is_var_or_elems(node.node, name, key)
    if isinstance(node, nodes.Getitem) and isinstance(node.arg, nodes.Slice):
        return _is_var_or_elems(node.node, name, key)
    return _is_attr(node, name, key) if key else _is_var(node, name)


def _assigned_from(tree: nodes.Template, name: str) -> Iterator[str]:
    yield name
    pending = deque([name])
    while pending:
        source = pending.popleft()
        for assign in tree.find_all(nodes.Assign):
            if _is_var_or_elems(assign.node, source):
                target = _name(assign.target)
                yield target
                if target != source:
                    pending.append(target)


def _message_names(tree: nodes.Template) -> Iterator[str]:
    sources = list(_assigned_from(tree, "messages"))
    for loop in tree.find_all(nodes.For):
        if any(_is_var_or_elems(loop.iter, name) for name in sources):
            yield _name(loop.target)


def _content_loops(tree: nodes.Template) -> Iterator[str]:
    names = list(_message_names(tree))
    by_loop: dict[int, set[str]] = {}
    in_macros: set[int] = set()
    for macro in tree.find_all(nodes.Macro):
        params = {arg.name for arg in macro.args}
        content_params: set[str] = set()
        for call in tree.find_all(nodes.Call):
            if not (isinstance(call.node, nodes.Name) and call.node.name == macro.name):
                continue
            for index, arg in enumerate(call.args):
                if index < len(macro.args) and any(_is_var_or_elems(arg, name, "content") for name in names):
                    content_params.add(macro.args[index].name)
            for keyword in call.kwargs:
                if keyword.key in params and any(_is_var_or_elems(keyword.value, n, "content") for n in names):
                    content_params.add(keyword.key)
        for loop in macro.find_all(nodes.For):
            in_macros.add(id(loop))
            if content_params:
                by_loop[id(loop)] = content_params
    for loop in tree.find_all(nodes.For):
        if any(_is_var_or_elems(loop.iter, name, "content") for name in names):
            yield _name(loop.target)
        elif isinstance(loop.iter, nodes.Name) and loop.iter.name in by_loop.get(id(loop), ()):
            yield _name(loop.target)
        elif id(loop) not in in_macros and isinstance(loop.iter, nodes.Name) and loop.iter.name == "content":
            yield _name(loop.target)
