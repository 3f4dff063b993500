"""ModelTokenizer against the tiny model: the rendering and encoding rules that make our counts vLLM's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from isolation.sim.tinymodel import BOS, EOT, HEADER_END, HEADER_START
from isolation.tokens import ChatTemplateError, ModelTokenizer, TokenizerLoadError

USER_HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def tok(tokenizer_dir: Path) -> ModelTokenizer:
    return ModelTokenizer.from_dir(tokenizer_dir)


def special_id(tok: ModelTokenizer, text: str) -> int:
    token_id = tok.tokenizer.token_to_id(text)
    assert isinstance(token_id, int)
    return token_id


def test_chat_renders_special_tokens_and_generation_prompt(tok: ModelTokenizer) -> None:
    text = tok.render_chat([{"role": "system", "content": "Be brief."}, *USER_HI])
    assert text == (
        f"{BOS}{HEADER_START}system{HEADER_END}\n\nBe brief.{EOT}"
        f"{HEADER_START}user{HEADER_END}\n\nhi{EOT}"
        f"{HEADER_START}assistant{HEADER_END}\n\n"
    )


def test_a_continued_final_message_ends_the_prompt_where_its_text_ends(tok: ModelTokenizer) -> None:
    """transformers' continue_final_message, as vLLM's chat route renders a prefill: the template's own end of the
    turn cut off; a template that trims the text trims where it ends. A generation prompt too is refused."""
    prefill = [*USER_HI, {"role": "assistant", "content": "The answer is "}]
    text = tok.render_chat(prefill, add_generation_prompt=False, continue_final_message=True)
    assert text == f"{BOS}{HEADER_START}user{HEADER_END}\n\nhi{EOT}{HEADER_START}assistant{HEADER_END}\n\nThe answer is"
    with pytest.raises(ChatTemplateError, match="not compatible"):
        tok.render_chat(prefill, continue_final_message=True)
    parts = [*USER_HI, {"role": "assistant", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]
    assert tok.render_chat(parts, add_generation_prompt=False, continue_final_message=True).endswith("a\nb")


def test_generation_prompt_can_be_left_out(tok: ModelTokenizer) -> None:
    text = tok.render_chat(USER_HI, add_generation_prompt=False)
    assert text.endswith(f"hi{EOT}")
    assert "assistant" not in text


def test_chat_special_tokens_encode_as_single_ids_and_bos_is_not_doubled(tok: ModelTokenizer) -> None:
    ids = tok.encode_chat(USER_HI)
    bos, eot = special_id(tok, BOS), special_id(tok, EOT)
    assert ids[0] == bos
    assert ids.count(bos) == 1  # the template writes BOS; encoding must not add another
    assert ids.count(eot) == 1
    assert ids.count(special_id(tok, HEADER_START)) == 2


def test_content_part_lists_are_flattened_to_their_text_parts(tok: ModelTokenizer) -> None:
    parts = [
        {"type": "text", "text": "first"},
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        {"type": "text", "text": "second"},
    ]
    as_parts = tok.render_chat([{"role": "user", "content": parts}])
    as_string = tok.render_chat([{"role": "user", "content": "first\nsecond"}])
    assert as_parts == as_string
    assert "image" not in as_parts


def test_tool_call_arguments_are_rendered_as_objects(tok: ModelTokenizer) -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}
    text = tok.render_chat([*USER_HI, {"role": "assistant", "content": None, "tool_calls": [call]}])
    assert '{"name": "weather", "arguments": {"city": "Paris"}}' in text


def test_tools_are_rendered_into_the_prompt_and_counted(tok: ModelTokenizer) -> None:
    tool = {"type": "function", "function": {"name": "weather", "parameters": {"type": "object"}}}
    text = tok.render_chat(USER_HI, tools=[tool])
    # As vLLM's tool model dumps it: an omitted description is there, null.
    dumped = {
        "type": "function",
        "function": {"name": "weather", "description": None, "parameters": {"type": "object"}},
    }
    assert json.dumps(dumped) in text
    assert len(tok.encode_chat(USER_HI, tools=[tool])) > len(tok.encode_chat(USER_HI))


def test_template_kwargs_the_template_ignores_change_nothing(tok: ModelTokenizer) -> None:
    assert tok.render_chat(USER_HI, template_kwargs={"enable_thinking": False}) == tok.render_chat(USER_HI)


def test_completion_prompt_gets_bos(tok: ModelTokenizer) -> None:
    ids = tok.encode_prompt("hello world")
    assert ids[0] == special_id(tok, BOS)
    assert tok.decode(ids) == "hello world"


@pytest.mark.parametrize(
    "text",
    ["emoji 👩‍👩‍👧 and 🚀!", "中文和日本語のテキスト", "مرحبا بالعالم", "עברית RTL mixed עם English", "tab\tnew\nline"],
)
def test_decode_round_trips_any_unicode(tok: ModelTokenizer, text: str) -> None:
    assert tok.decode(tok.encode_prompt(text)) == text


def test_missing_tokenizer_file_is_a_load_error(tmp_path: Path) -> None:
    with pytest.raises(TokenizerLoadError):
        ModelTokenizer.from_dir(tmp_path)
    with pytest.raises(TokenizerLoadError, match="is not a directory"):
        ModelTokenizer.from_dir(tmp_path / "nowhere")


@pytest.mark.parametrize(
    ("name", "content"),
    [
        ("chat_template.jinja", "{% for m in messages %}"),
        ("tokenizer_config.json", "[]"),
        ("tokenizer_config.json", "{"),
    ],
)
def test_a_bad_file_beside_the_tokenizer_is_a_load_error_naming_it(
    tokenizer_dir: Path, tmp_path: Path, name: str, content: str
) -> None:
    (tmp_path / "tokenizer.json").write_bytes((tokenizer_dir / "tokenizer.json").read_bytes())
    (tmp_path / name).write_text(content)
    with pytest.raises(TokenizerLoadError, match=name):
        ModelTokenizer.from_dir(tmp_path)


def test_a_tokenizer_without_template_refuses_chat(tokenizer_dir: Path, tmp_path: Path) -> None:
    (tmp_path / "tokenizer.json").write_bytes((tokenizer_dir / "tokenizer.json").read_bytes())
    tok = ModelTokenizer.from_dir(tmp_path)
    with pytest.raises(ChatTemplateError):
        tok.render_chat(USER_HI)


def test_a_template_variable_of_the_wrong_type_is_the_requests_fault(tokenizer_dir: Path, tmp_path: Path) -> None:
    # Llama 3.1's template writes "Today Date: " + date_string: a number there once answered 500.
    (tmp_path / "tokenizer.json").write_bytes((tokenizer_dir / "tokenizer.json").read_bytes())
    (tmp_path / "chat_template.jinja").write_text(
        "{{ 'Today Date: ' + date_string }}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    )
    tok = ModelTokenizer.from_dir(tmp_path)
    assert tok.render_chat(USER_HI, template_kwargs={"date_string": "1 Dec"}).startswith("Today Date: 1 Dec")
    with pytest.raises(ChatTemplateError, match="TypeError"):
        tok.render_chat(USER_HI, template_kwargs={"date_string": 5})
