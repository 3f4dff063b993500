"""Piecewise counts with kept pieces: always the whole text's count, kept per owner and within their bound."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer

from gateway.pipeline.piece_counts import ENTRY_BYTES, MAX_PIECES, PieceCounts, _trie_pattern
from gateway.settings import TenantSettings
from gateway.tenancy.directory import Tenant
from gateway.tenancy.tenants import hash_key
from isolation.sim.tinymodel import BOS, EOT, HEADER_END, HEADER_START
from isolation.tokens import ModelTokenizer, token_counts

SPECIALS = [BOS, EOT, HEADER_START, HEADER_END]
# Text that tokenizes differently depending on what stands beside it: spaces, newlines, words, digits, non-ASCII.
ATOMS = [" ", "  ", "\n", "\n\n", "\t", "a", "hello", " world", "42", "é", "日本", "🙂", "<|", "|>", "eot_id"]


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir: Path) -> Tokenizer:
    return ModelTokenizer.from_dir(tokenizer_dir).tokenizer


def whole(tokenizer: Tokenizer, text: str) -> int:
    return token_counts(tokenizer, [text], add_special_tokens=False)[0]


def variant(tokenizer_dir: Path, tmp_path: Path, change: Any) -> Tokenizer:
    """The tiny tokenizer with its JSON changed by `change`."""
    config = json.loads((tokenizer_dir / "tokenizer.json").read_text())
    change(config)
    path = tmp_path / "tokenizer.json"
    path.write_text(json.dumps(config))
    return Tokenizer.from_file(str(path))


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(ATOMS + SPECIALS), max_size=40), st.sampled_from(["alice", "bob"]))
def test_a_piecewise_count_is_the_whole_count_counted_or_kept(
    tokenizer: Tokenizer, atoms: list[str], owner: str
) -> None:
    counts = PieceCounts(tokenizer, max_bytes=100_000)
    assert counts.piecewise
    text = "".join(atoms)
    expected = whole(tokenizer, text)
    assert counts.count(text, owner) == expected  # every piece tokenized
    assert counts.count(text, owner) == expected  # every piece kept
    assert counts.count(text + EOT + text, owner) == whole(tokenizer, text + EOT + text)


def test_a_rendered_chat_is_counted_from_kept_pieces(tokenizer_dir: Path) -> None:
    model = ModelTokenizer.from_dir(tokenizer_dir)
    counts = PieceCounts(model.tokenizer, max_bytes=100_000)
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Tell me about ships."}]
    first = model.render_chat(history)
    assert counts.count(first, "alice") == whole(model.tokenizer, first)
    tokenized = counts.misses
    # The next turn sends the history again: only the new message's text is tokenized.
    history += [{"role": "assistant", "content": "They float."}, {"role": "user", "content": "And bulkheads?"}]
    second = model.render_chat(history)
    assert counts.count(second, "alice") == whole(model.tokenizer, second)
    assert counts.misses - tokenized == 2  # "They float." and "And bulkheads?" (headers and roles were kept)


def test_pieces_are_kept_per_owner(tokenizer: Tokenizer) -> None:
    counts = PieceCounts(tokenizer, max_bytes=100_000)
    text = f"{HEADER_START}user{HEADER_END}a secret of alice's{EOT}"
    counts.count(text, "alice")
    before = counts.misses
    counts.count(text, "alice")
    assert counts.misses == before  # alice's own pieces are known to alice
    counts.count(text, "bob")
    assert counts.misses == before + 2  # but not to bob: his count tokenizes them, taking as long as a new text


def test_kept_pieces_stay_within_their_memory_bound(tokenizer: Tokenizer) -> None:
    first = "the first piece, 30 characters"
    # Room for a few entries, each charged its string's size and its entry's overhead.
    room = 4 * (sys.getsizeof(first) + ENTRY_BYTES)
    counts = PieceCounts(tokenizer, max_bytes=room)
    counts.count(first, "alice")
    for number in range(4):
        counts.count(f"{EOT}piece {number:04d}", "alice")
    before = counts.misses
    assert counts.count(first, "alice") == whole(tokenizer, first)
    assert counts.misses == before + 1  # pushed out by newer pieces: tokenized again
    # A piece bigger than the whole bound is counted and never kept.
    long = "x " * 1000
    assert counts.count(long, "alice") == whole(tokenizer, long)
    assert counts.count(long, "alice") == whole(tokenizer, long)
    assert counts.misses == before + 3


def test_a_text_of_too_many_pieces_is_counted_whole_and_nothing_of_it_kept(tokenizer: Tokenizer) -> None:
    counts = PieceCounts(tokenizer, max_bytes=100_000_000)
    stuffed = EOT.join(f"w{number}" for number in range(MAX_PIECES + 1))
    assert counts.count(stuffed, "alice") == whole(tokenizer, stuffed)
    assert counts.hits == counts.misses == 0
    fitting = EOT.join(f"w{number}" for number in range(MAX_PIECES))
    assert counts.count(fitting, "alice") == whole(tokenizer, fitting)
    assert counts.misses == MAX_PIECES


@settings(max_examples=200, deadline=None)
@given(
    st.sets(st.text(alphabet="<|ab>_", min_size=1, max_size=6), min_size=1, max_size=12),
    st.text("<|ab>_ ", max_size=60),
)
def test_the_prefix_tree_pattern_cuts_where_the_longest_token_first_alternation_does(
    words: set[str], text: str
) -> None:
    # The plain alternation, longest first, is what the tokenizer's leftmost-longest matching does.
    plain = re.compile("(" + "|".join(re.escape(word) for word in sorted(words, key=len, reverse=True)) + ")")
    assert re.compile("(" + _trie_pattern(words) + ")").split(text) == plain.split(text)


def test_a_tenant_id_used_again_after_a_delete_is_another_owner() -> None:
    configured = TenantSettings(id="acme", key_hashes=[hash_key("bk-one")])
    first = Tenant(id="acme", created_at=1_000.0, updated_at=1_000.0)
    again = Tenant(id="acme", created_at=2_000.0, updated_at=2_000.0)
    changed = first.model_copy(update={"updated_at": 1_500.0})
    assert configured.incarnation() == "acme"
    assert first.incarnation() != again.incarnation()
    assert changed.incarnation() == first.incarnation()  # an update keeps what was kept


def test_no_owner_or_no_room_counts_the_whole_text(tokenizer: Tokenizer) -> None:
    text = f"{BOS}hello{EOT}"
    for counts, owner in ((PieceCounts(tokenizer, 100_000), None), (PieceCounts(tokenizer, 0), "alice")):
        assert counts.count(text, owner) == counts.count(text, owner) == whole(tokenizer, text)
        assert counts.hits == counts.misses == 0


def _lstrip(config: dict[str, Any]) -> None:
    config["added_tokens"][1]["lstrip"] = True


def _normalized(config: dict[str, Any]) -> None:
    config["added_tokens"][2]["normalized"] = True


def _metaspace_first(config: dict[str, Any]) -> None:
    config["pre_tokenizer"] = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": True}


@pytest.mark.parametrize("change", [_lstrip, _normalized, _metaspace_first])
def test_a_tokenizer_whose_pieces_depend_on_their_neighbours_counts_whole_texts(
    tokenizer_dir: Path, tmp_path: Path, change: Any
) -> None:
    tokenizer = variant(tokenizer_dir, tmp_path, change)
    counts = PieceCounts(tokenizer, max_bytes=100_000)
    assert not counts.piecewise
    text = f"{BOS} hello {EOT}  world{HEADER_START}"
    assert counts.count(text, "alice") == counts.count(text, "alice") == whole(tokenizer, text)


def test_a_tokenizer_that_would_truncate_or_pad_counts_every_token(tokenizer_dir: Path, tmp_path: Path) -> None:
    def truncate_and_pad(config: dict[str, Any]) -> None:
        config["truncation"] = {"direction": "Right", "max_length": 4, "strategy": "LongestFirst", "stride": 0}
        config["padding"] = {
            "strategy": {"Fixed": 64},
            "direction": "Right",
            "pad_to_multiple_of": None,
            "pad_id": 0,
            "pad_type_id": 0,
            "pad_token": BOS,
        }

    variant(tokenizer_dir, tmp_path, truncate_and_pad)
    (tmp_path / "tokenizer_config.json").write_text((tokenizer_dir / "tokenizer_config.json").read_text())
    model = ModelTokenizer.from_dir(tmp_path)
    plain = ModelTokenizer.from_dir(tokenizer_dir)
    text = "a prompt of a good many more than four tokens, and far fewer than sixty-four"
    assert model.count_text(text, add_special_tokens=False) == plain.count_text(text, add_special_tokens=False) > 4
