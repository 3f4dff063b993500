"""Prompt tokens counted exactly as vLLM counts them.

vLLM renders a chat request with the model's Hugging Face chat template (the way transformers does:
a sandboxed Jinja environment with trim_blocks/lstrip_blocks and a few helper globals) over the messages, tools and
variables its preprocessing makes of the request (isolation/conversation.py), then encodes the text *without*
adding special tokens, because the template writes them itself, unless the request asks for them (its Responses
route does, so its prompts start with two BOS). A completion prompt is encoded *with* special tokens (the
tokenizer's post-processor adds BOS). Matching these rules is what makes our count equal the engine's.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.parser import Parser
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

from isolation.conversation import ContentFormat, content_format, conversation, knows_developer, template_variables
from isolation.conversation import tool_dicts as template_tools

_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")


class TokenizerLoadError(Exception):
    """The tokenizer directory is missing a file or holds one that cannot be read."""


class ChatTemplateError(Exception):
    """The chat template refused the messages (it called raise_exception) or failed to render."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # transformers overrides Jinja's tojson (which HTML-escapes) with plain json.dumps; templates rely on it.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Generation(jinja2.ext.Extension):
    """transformers' `{% generation %}` tag (it marks the assistant's tokens for training masks): its body renders
    as it is."""

    tags = {"generation"}

    def parse(self, parser: Parser) -> list[nodes.Node]:
        next(parser.stream)
        return list(parser.parse_statements(("name:endgeneration",), drop_needle=True))


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def _compile_template(source: str) -> tuple[jinja2.Template, ContentFormat, bool]:
    """The template, the content format vLLM detects in it and whether it knows the developer role."""
    env = _environment()
    template = env.from_string(source)
    # Jinja keeps a template's globals as a ChainMap over its environment's and copies them key by key, in Python,
    # into every render's context, a third of a render's cost; a plain dict is copied at C speed. Nothing changes
    # them after this.
    template.globals = dict(template.globals)
    return template, content_format(env.parse(source)), knows_developer(source)


def _read(file: Path) -> str:
    try:
        return file.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TokenizerLoadError(f"{file}: cannot read: {exc}") from exc


def _token_text(value: object) -> str | None:
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


@dataclass(frozen=True)
class ModelTokenizer:
    """A model's tokenizer and chat template, loaded from a Hugging Face tokenizer directory."""

    tokenizer: Tokenizer
    template: jinja2.Template | None
    special_tokens: Mapping[str, str]
    # The most bytes one token can stand for (special tokens included): prompt bytes / this ≤ prompt tokens.
    longest_token_bytes: int
    # What vLLM reads in the template: content as one string or a list of parts; whether it names the developer role
    # (if not, developer messages become system ones).
    content_format: ContentFormat = "string"
    knows_developer: bool = True

    @classmethod
    def from_dir(cls, path: Path) -> ModelTokenizer:
        if not path.is_dir():
            raise TokenizerLoadError(
                f"{path} is not a directory: give a Hugging Face tokenizer directory, or leave it unset to count "
                "with the backend's /tokenize"
            )
        tokenizer_file = path / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise TokenizerLoadError(f"{tokenizer_file} does not exist")
        try:
            tokenizer = Tokenizer.from_file(str(tokenizer_file))
        except Exception as exc:  # the Rust loader raises a bare Exception for every kind of bad file
            raise TokenizerLoadError(f"{tokenizer_file}: {exc}") from exc
        # A tokenizer.json may ask to truncate or pad what it encodes; vLLM's tokenizer (transformers) does neither
        # unless asked, and a count must not either: a truncated prompt would be admitted as short.
        tokenizer.no_truncation()
        tokenizer.no_padding()
        config: dict[str, Any] = {}
        config_file = path / "tokenizer_config.json"
        if config_file.is_file():
            try:
                config = json.loads(_read(config_file))
            except ValueError as exc:
                raise TokenizerLoadError(f"{config_file}: {exc}") from exc
            if not isinstance(config, dict):
                raise TokenizerLoadError(f"{config_file}: not a JSON object")
        template_source = config.get("chat_template")
        template_file = path / "chat_template.jinja"
        if template_file.is_file():
            template_source = _read(template_file)
        template: jinja2.Template | None = None
        form: ContentFormat = "string"
        developer = True
        try:
            if isinstance(template_source, str):
                template, form, developer = _compile_template(template_source)
        except jinja2.TemplateError as exc:
            raise TokenizerLoadError(f"{template_file if template_file.is_file() else config_file}: {exc}") from exc
        special = {key: text for key in _SPECIAL_TOKEN_KEYS if (text := _token_text(config.get(key))) is not None}
        longest = max(
            len(tokenizer.decode([i], skip_special_tokens=False).encode()) for i in range(vocab_size(tokenizer))
        )
        return cls(
            tokenizer=tokenizer,
            template=template,
            special_tokens=special,
            longest_token_bytes=max(longest, 1),
            content_format=form,
            knows_developer=developer,
        )

    def render_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
        reasoning_effort: str | None = None,
        continue_final_message: bool = False,
    ) -> str:
        """The prompt text vLLM's chat route renders for these request fields (`template_kwargs`: the request's
        chat_template_kwargs; `continue_final_message`: the last message left open, for the answer to go on with)."""
        if self.template is None:
            raise ChatTemplateError("this model's tokenizer has no chat template")
        variables = template_variables(
            template_kwargs, add_generation_prompt=add_generation_prompt, reasoning_effort=reasoning_effort
        )
        if continue_final_message and add_generation_prompt:
            # transformers' apply_chat_template refuses both (a turn is either continued or a new one opened).
            raise ChatTemplateError("continue_final_message and add_generation_prompt are not compatible")
        turns = conversation(messages, self.content_format, self.knows_developer)
        final = _tag_final(turns) if continue_final_message else None
        try:
            rendered = self.template.render(
                {**self.special_tokens, **variables, "messages": turns, "tools": template_tools(tools)}
            )
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(str(exc)) from exc
        except (TypeError, ValueError, ArithmeticError, LookupError) as exc:
            # A template variable of a type the template does not expect ("Today: " + 5): the request's fault.
            raise ChatTemplateError(f"{type(exc).__name__}: {exc}") from exc
        return rendered if final is None else _cut_at_tag(rendered, final)

    def count_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> int:
        return self.count_text(self.render_chat(messages, tools, add_generation_prompt, template_kwargs), False)

    def count_text(self, text: str, add_special_tokens: bool) -> int:
        return token_counts(self.tokenizer, [text], add_special_tokens)[0]

    def encode_chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        template_kwargs: Mapping[str, Any] | None = None,
    ) -> list[int]:
        text = self.render_chat(messages, tools, add_generation_prompt, template_kwargs)
        return list(self.tokenizer.encode(text, add_special_tokens=False).ids)

    def encode_prompt(self, prompt: str) -> list[int]:
        return list(self.tokenizer.encode(prompt, add_special_tokens=True).ids)

    def decode(self, ids: Sequence[int]) -> str:
        # decode_batch lets go of the GIL while it works (decode holds it: 35 ms for 200,000 ids, which stalls every
        # other request even from a thread).
        return str(self.tokenizer.decode_batch([list(ids)], skip_special_tokens=True)[0])


# transformers' render_jinja_template (chat_template_utils.py), which vLLM's chat route calls: the final message's
# text is marked, rendered, and the prompt ends where the mark is.
_FINAL_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _tag_final(turns: list[dict[str, Any]]) -> str:
    """The final message's text to continue, its mark appended in place (to its last text part, if parts)."""
    final = turns[-1].get("content") if turns else None
    if isinstance(final, list):
        for part in reversed(final):
            if isinstance(part, dict) and "text" in part:
                text = str(part["text"])
                part["text"] = text + _FINAL_TAG
                return text
        raise ChatTemplateError("continue_final_message is set but the final message has no text to continue")
    if not isinstance(final, str):
        raise ChatTemplateError('continue_final_message is set but the final message has no "content" to continue')
    turns[-1]["content"] = final + _FINAL_TAG
    return final


def _cut_at_tag(rendered: str, final: str) -> str:
    mark = _FINAL_TAG.strip()
    if final.strip() not in rendered or mark not in rendered:
        raise ChatTemplateError("continue_final_message is set but the template drops part of the final message")
    at = rendered.rindex(mark)
    # A template that trims the message's trailing space has trimmed the mark's too: trimmed, the prompt ends there.
    return rendered[:at] if rendered[at : at + len(_FINAL_TAG)] == _FINAL_TAG else rendered[:at].rstrip()


def token_counts(tokenizer: Tokenizer, texts: Sequence[str], add_special_tokens: bool) -> list[int]:
    # encode_batch_fast releases the GIL while it works (encode does not) and computes no offsets, and len() of
    # an Encoding builds no list: building and freeing `.ids` and the full Encoding holds the GIL for a long time
    # after a huge count, which stalls every other request (docs/benchmarks.md, admission).
    encodings = tokenizer.encode_batch_fast(list(texts), add_special_tokens=add_special_tokens)
    return [len(encoding) for encoding in encodings]


def vocab_size(tokenizer: Tokenizer) -> int:
    return int(tokenizer.get_vocab_size(with_added_tokens=True))
