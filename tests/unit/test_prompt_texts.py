"""No field reaches the engine's prompt without being fingerprinted.

The chat request is the one shape every API's prompt becomes (Messages and Responses are rendered to it and validated
against it), so its schema says what can reach a chat template: every string the schema lets into `messages`,
`tools` or `chat_template_kwargs` must be among the texts the gateway fingerprints. The requests are generated from
the schema itself, so a field added to it later is covered without this test knowing its name; a new top-level field
fails here until it is placed on one side or the other.
"""

from __future__ import annotations

from collections.abc import Iterator
from itertools import count
from typing import Any

import pytest

from gateway.pipeline.counting import Prompt
from gateway.schemas import ChatCompletionRequest

# What vLLM hands a chat template (vllm/entrypoints/chat_utils.py: the conversation, the tools and the kwargs; the
# generation prompt is a flag). The rest steers sampling or output and never becomes prompt text.
RENDERED = frozenset({"messages", "tools", "chat_template_kwargs"})
NOT_RENDERED = frozenset(
    {
        "model", "stream", "stream_options", "max_tokens", "n", "temperature", "top_p", "presence_penalty",
        "frequency_penalty", "seed", "stop", "user", "logit_bias", "response_format", "cache_salt", "use_beam_search",
        "top_k", "min_p", "repetition_penalty", "length_penalty", "stop_token_ids", "include_stop_str_in_output",
        "ignore_eos", "min_tokens", "skip_special_tokens", "spaces_between_special_tokens", "allowed_token_ids",
        "bad_words", "logprob_token_ids", "structured_outputs", "thinking_token_budget", "repetition_detection",
        "stream_interval", "max_completion_tokens", "add_generation_prompt", "add_special_tokens", "tool_choice",
        "parallel_tool_calls",
        "logprobs", "top_logprobs", "include_reasoning", "reasoning_effort", "echo", "continue_final_message",
        # Accepted and never forwarded, or refused unless null (docs/api.md, "Fields of each API"):
        "store", "metadata", "service_tier", "prompt_cache_key", "prompt_cache_retention", "prompt_cache_options",
        "safety_identifier", "verbosity", "modalities", "prediction", "audio", "web_search_options", "moderation",
        "functions", "function_call",
    }
)  # fmt: skip

SCHEMA = ChatCompletionRequest.model_json_schema(by_alias=True)
VARIANTS = 4  # a union's alternatives are taken in turn, one per variant (the widest union here has three)


class Filler:
    """A value for a JSON schema, every string in it unique (a sentence of its own, so it holds grams)."""

    def __init__(self, variant: int) -> None:
        self.variant = variant
        self.serial = count()
        self.sentences: list[str] = []

    def fill(self, node: dict[str, Any]) -> Any:
        if "$ref" in node:
            return self.fill(SCHEMA["$defs"][node["$ref"].rsplit("/", 1)[1]])
        if "const" in node:
            return node["const"]
        if "enum" in node:
            return node["enum"][self.variant % len(node["enum"])]
        alternatives = node.get("anyOf") or node.get("oneOf")
        if alternatives:
            concrete = [a for a in alternatives if a.get("type") != "null"] or alternatives
            return self.fill(concrete[self.variant % len(concrete)])
        kind = node.get("type")
        if kind == "string":
            sentence = " ".join(f"field{next(self.serial)}word{i}" for i in range(16))
            self.sentences.append(sentence)
            return sentence
        if kind == "array":
            return [self.fill(node.get("items", {"type": "string"}))]
        if kind == "object" or "properties" in node:
            value = {name: self.fill(sub) for name, sub in node.get("properties", {}).items()}
            extra = node.get("additionalProperties")
            if isinstance(extra, dict):
                value[f"key{next(self.serial)}"] = self.fill(extra)
            elif extra is None and not node.get("properties"):
                value[f"key{next(self.serial)}"] = self.fill({"type": "string"})
            return value
        return {"integer": 1, "number": 1.0, "boolean": False}.get(kind)


def _strings(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from _strings(item)


def test_every_top_level_field_is_known_to_reach_the_template_or_not() -> None:
    fields = set(SCHEMA["properties"])
    assert not RENDERED & NOT_RENDERED
    known = RENDERED | NOT_RENDERED
    assert fields == known, f"placed nowhere: {sorted(fields - known)}; gone: {sorted(known - fields)}"


@pytest.mark.parametrize("variant", range(VARIANTS))
def test_every_string_a_template_can_render_is_fingerprinted(variant: int) -> None:
    filler = Filler(variant)
    payload = {name: filler.fill(SCHEMA["properties"][name]) for name in sorted(RENDERED)}
    messages = []
    for turn in range(VARIANTS):  # turns of every shape the variants give, in one conversation
        filler.variant = variant + turn
        messages.append(filler.fill(SCHEMA["properties"]["messages"]["items"]))
    payload["messages"] = messages
    rendered = [text for name in RENDERED for text in _strings(payload[name])]
    assert rendered, payload
    texts = list(Prompt.of_chat(payload).texts())
    missed = [text for text in rendered if not any(text in fingerprinted for fingerprinted in texts)]
    assert not missed, f"reach the engine unfingerprinted: {missed}"
