"""vLLM's Anthropic Messages API (POST /v1/messages and /v1/messages/count_tokens): the request read as vLLM 0.32
reads it and turned into the chat completion it serves it as (vllm/entrypoints/anthropic/serving.py,
to_chat_completion_request; the answer's shapes are in message_replies.py).

vLLM answers a Messages request with its chat route: `system` becomes a leading system message (its text blocks
joined with nothing between them, Claude Code's billing header dropped), each message's blocks become chat
content (text, images), reasoning (thinking), tool calls (tool_use, input as JSON) or, for a user's tool_result,
a tool message before the user's; tools become chat tools, max_tokens becomes max_completion_tokens, and a stream
asks for usage in every chunk. So one conversation has the same prompt tokens on both routes, and count_tokens
renders it the same way without generating: its count is exactly the prompt /v1/messages would prefill (a prompt
over the window is refused, as the renderer refuses it; the KV cache is not consulted).

Refusals: the body's checks are vLLM's request validation and keep the OpenAI shape; every refusal after them
(the model, max_tokens over the window, the template, the prompt's length, the engine's) is translated to
Anthropic's shape (errors.py, SimError.anthropic_body), as vLLM's Anthropic router does.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from isolation.sim.errors import bad_request, context_length_exceeded, output_over_window
from isolation.sim.protocol import (
    ChatPrompt,
    JsonObject,
    Sampling,
    flag,
    parse_cache_salt,
)
from isolation.tokens import ChatTemplateError, ModelTokenizer

_ROLES = frozenset(("user", "assistant", "system"))
_BILLING_HEADER = "x-anthropic-billing-header"  # Claude Code's per-request attribution; vLLM drops it


@dataclass(frozen=True)
class MessagesRequest:
    sampling: Sampling
    prompt: ChatPrompt

    def check(self, max_model_len: int) -> None:
        """vLLM's refusal of a max_tokens over the whole window, sent as the chat request's max_completion_tokens."""
        max_tokens = self.sampling.max_tokens
        if max_tokens is not None and max_tokens > max_model_len:
            raise output_over_window("max_completion_tokens", max_tokens, max_model_len)


@dataclass(frozen=True)
class CountTokensRequest:
    model: str
    prompt: ChatPrompt


def merges_inline_system(tokenizer: ModelTokenizer) -> bool:
    """Whether system messages inside `messages` join the leading one: vLLM merges them when the chat template
    refuses a system message after a user's (it renders system, user, system, user to find out)."""
    probe = [{"role": "system", "content": "t"}, {"role": "user", "content": "t"}] * 2
    try:
        tokenizer.render_chat(probe, add_generation_prompt=False)
    except ChatTemplateError:
        return True
    return False


def parse_messages(body: JsonObject, merge_inline_system: bool) -> MessagesRequest:
    max_tokens = body.get("max_tokens")
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int):
        raise bad_request("Field 'max_tokens' is required and must be an integer.", "max_tokens")
    if max_tokens <= 0:
        raise bad_request("max_tokens must be positive", "max_tokens")
    model, prompt = _read(body, merge_inline_system)
    stream = flag(body, "stream", False)
    # vLLM's stream asks its chat route for usage in every chunk: the first one's starts the message.
    sampling = Sampling(
        model,
        n=1,
        max_tokens=max_tokens,
        stream=stream,
        include_usage=stream,
        continuous_usage=stream,
        cache_salt=parse_cache_salt(body),
    )
    return MessagesRequest(sampling=sampling, prompt=prompt)


def parse_count_tokens(body: JsonObject, merge_inline_system: bool) -> CountTokensRequest:
    model, prompt = _read(body, merge_inline_system)
    return CountTokensRequest(model=model, prompt=prompt)


def counted(prompt_ids: list[int], max_model_len: int) -> JsonObject:
    """count_tokens' answer, or the renderer's refusal of a prompt over the window."""
    if len(prompt_ids) > max_model_len:
        raise context_length_exceeded(max_model_len, len(prompt_ids))
    return {"input_tokens": len(prompt_ids), "context_management": {"original_input_tokens": len(prompt_ids)}}


def _read(body: JsonObject, merge_inline_system: bool) -> tuple[str, ChatPrompt]:
    """What both routes share: the model, and the conversation as the chat prompt vLLM renders."""
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("Field 'model' is required and must be a non-empty string.", "model")
    messages = body.get("messages")
    if not isinstance(messages, list) or not all(_is_message(message) for message in messages):
        raise bad_request(
            "Field 'messages' is required and must be a list of messages with a role (user, assistant or system) "
            "and a content (a string or a list of blocks with a type).",
            "messages",
        )
    system = body.get("system")
    if system is not None and not (isinstance(system, str) or _is_blocks(system)):
        raise bad_request("Field 'system' must be a string or a list of blocks with a type.", "system")
    tools = body.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(_is_tool(tool) for tool in tools)):
        raise bad_request("Field 'tools' must be a list of tools with a name and an input_schema object.", "tools")
    template_kwargs = body.get("chat_template_kwargs")
    if template_kwargs is not None and not isinstance(template_kwargs, dict):
        raise bad_request("Field 'chat_template_kwargs' must be an object.", "chat_template_kwargs")
    prompt = ChatPrompt(
        messages=chat_messages(system, messages, merge_inline_system),
        tools=[_chat_tool(tool) for tool in tools] if tools is not None else None,
        add_generation_prompt=True,
        template_kwargs=template_kwargs,
        add_special_tokens=False,
    )
    return model, prompt


def chat_messages(system: object, messages: list[JsonObject], merge_inline_system: bool) -> list[Mapping[str, Any]]:
    """The conversation as vLLM's chat messages (_convert_system_message, _convert_messages)."""
    system_parts = [system] if isinstance(system, str) and system else _texts(system or [])
    if merge_inline_system:
        system_parts += [
            text for message in messages if message["role"] == "system" and (text := _system_text(message))
        ]
    converted: list[JsonObject] = [{"role": "system", "content": "".join(system_parts)}] if system_parts else []
    for message in messages:
        role, content = message["role"], message["content"]
        if role == "system":
            text = None if merge_inline_system else _system_text(message)
            if text:
                converted.append({"role": "system", "content": text})
            continue
        chat: JsonObject = {"role": role}
        if isinstance(content, str):
            chat["content"] = content
        else:
            _convert_blocks(content, chat, converted)
        # A user message of nothing but tool results has become tool messages.
        if not (role == "user" and "content" not in chat):
            converted.append(chat)
    prompt_messages: list[Mapping[str, Any]] = list(converted)
    return prompt_messages


def _convert_blocks(blocks: list[JsonObject], chat: JsonObject, converted: list[JsonObject]) -> None:
    """A message's blocks as its chat fields; a user's tool results go before it, as tool messages."""
    parts: list[JsonObject] = []
    calls: list[JsonObject] = []
    reasoning: list[str] = []
    for block in blocks:
        kind = block["type"]
        if kind == "text" and block.get("text"):
            parts.append({"type": "text", "text": block["text"]})
        elif kind == "image" and block.get("source"):
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block["source"])}})
        elif kind == "thinking" and block.get("thinking") is not None:
            reasoning.append(str(block["thinking"]))
        elif kind == "tool_use":
            arguments = json.dumps(block.get("input") or {})
            function = {"name": block.get("name") or "", "arguments": arguments}
            calls.append(
                {"id": block.get("id") or f"call_{int(time.time())}", "type": "function", "function": function}
            )
        elif kind == "tool_result" and chat["role"] == "user":
            converted.extend(_tool_result_messages(block))
        elif kind == "tool_result":  # an assistant's, as text (a list of blocks as Python writes it, as vLLM does)
            parts.append({"type": "text", "text": f"Tool result: {block['content'] if block.get('content') else ''}"})
    if reasoning:
        chat["reasoning"] = "".join(reasoning)
    if calls:
        chat["tool_calls"] = calls
    if len(parts) == 1 and parts[0]["type"] == "text":
        chat["content"] = parts[0]["text"]
    elif parts:
        chat["content"] = parts


def _tool_result_messages(block: JsonObject) -> list[JsonObject]:
    """A user's tool_result: a tool message of its text, then its images as a user message and its tool
    references as another tool message (_convert_user_tool_result)."""
    content = block.get("content")
    call_id = block.get("tool_use_id") or ""
    items = [item for item in content if isinstance(item, dict)] if isinstance(content, list) else []
    if isinstance(content, str):
        text = content
    else:
        text = "\n".join(str(item.get("text", "")) for item in items if item.get("type") == "text")
    images = [_image_url(i.get("source", {})) for i in items if i.get("type") == "image"]
    references = [
        {"type": "tool_reference", "name": name}
        for i in items
        if i.get("type") == "tool_reference" and (name := i.get("tool_name") or i.get("name"))
    ]
    messages: list[JsonObject] = [{"role": "tool", "tool_call_id": call_id, "content": text or ""}]
    if images:
        messages.append(
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}} for url in images]}
        )
    if references:
        messages.append({"role": "tool", "tool_call_id": call_id, "content": references})
    return messages


def _system_text(message: JsonObject) -> str | None:
    content = message["content"]
    if isinstance(content, str):
        return None if content.startswith(_BILLING_HEADER) else content
    return "".join(_texts(content)) or None


def _texts(blocks: object) -> list[str]:
    """The text blocks' texts, without Claude Code's billing header."""
    if not isinstance(blocks, list):
        return []
    return [
        block["text"]
        for block in blocks
        if block.get("type") == "text" and isinstance(block.get("text"), str) and block["text"]
        if not block["text"].startswith(_BILLING_HEADER)
    ]


def _image_url(source: object) -> str:
    if not isinstance(source, dict):
        return ""
    if source.get("type") == "url":
        return str(source.get("url", ""))
    return f"data:{source.get('media_type', 'image/jpeg')};base64,{source.get('data', '')}"


def _chat_tool(tool: JsonObject) -> JsonObject:
    """An Anthropic tool as the chat template sees a chat tool; a schema without a type is an object's."""
    schema = tool["input_schema"] if "type" in tool["input_schema"] else {**tool["input_schema"], "type": "object"}
    return {
        "type": "function",
        "function": {"name": tool["name"], "description": tool.get("description"), "parameters": schema},
    }


def _is_message(message: object) -> bool:
    if not isinstance(message, dict) or message.get("role") not in _ROLES:
        return False
    content = message.get("content")
    return isinstance(content, str) or _is_blocks(content)


def _is_blocks(blocks: object) -> bool:
    return isinstance(blocks, list) and all(isinstance(b, dict) and isinstance(b.get("type"), str) for b in blocks)


def _is_tool(tool: object) -> bool:
    return isinstance(tool, dict) and isinstance(tool.get("name"), str) and isinstance(tool.get("input_schema"), dict)
