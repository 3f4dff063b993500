"""The simulator's paged KV cache: block reuse, prefix caching by salt, stale contents, and reading them back."""

from __future__ import annotations

from pathlib import Path

import pytest

from isolation.sim.detokenizer import Detokenizer
from isolation.sim.kvcache import BlockTable, KVCache
from isolation.tokens import ModelTokenizer

BLOCK = 4


def tokens(start: int, count: int) -> list[int]:
    return list(range(start, start + count))


def allocated(cache: KVCache, ids: list[int], salt: str | None = None) -> BlockTable:
    table = cache.allocate(ids, salt)
    assert table is not None
    return table


def test_a_prompt_is_written_block_by_block_and_freed_blocks_keep_their_contents() -> None:
    cache = KVCache(BLOCK, 8)
    table = allocated(cache, tokens(100, 10))
    assert table.blocks == [0, 1, 2]
    assert [cache.contents(block) for block in table.blocks] == [(100, 101, 102, 103), (104, 105, 106, 107), (108, 109)]
    assert (cache.num_used_blocks, cache.usage()) == (3, 3 / 8)
    cache.free(table)
    assert (cache.num_used_blocks, cache.usage()) == (0, 0)
    assert cache.contents(0) == (100, 101, 102, 103)  # like GPU memory: freeing does not clear
    cache.free(table)  # a second free is a no-op
    assert cache.num_free_blocks == 8


def test_free_queue_hands_out_least_recently_freed_first_and_a_sequence_tail_first() -> None:
    cache = KVCache(BLOCK, 8)
    first = allocated(cache, tokens(0, 12))  # blocks 0, 1, 2
    second = allocated(cache, tokens(50, 8))  # blocks 3, 4
    cache.free(first)
    cache.free(second)
    # Never-used blocks first, then each freed sequence from its last block to its first.
    assert cache.free_blocks() == [5, 6, 7, 2, 1, 0, 4, 3]
    third = allocated(cache, tokens(200, 20))
    assert third.blocks == [5, 6, 7, 2, 1]
    assert cache.contents(2) == (212, 213, 214, 215)
    assert cache.free_blocks() == [0, 4, 3]


def test_stale_tokens_read_the_most_recently_freed_sequence_first_in_order() -> None:
    cache = KVCache(BLOCK, 8)
    older = allocated(cache, tokens(0, 6))
    newer = allocated(cache, tokens(100, 9))
    cache.free(older)
    cache.free(newer)
    assert list(cache.stale_tokens()) == [*tokens(100, 9), *tokens(0, 6)]
    assert list(KVCache(BLOCK, 4).stale_tokens()) == []


def test_generated_tokens_follow_the_prompt_and_full_blocks_become_cached() -> None:
    cache = KVCache(BLOCK, 8)
    table = allocated(cache, tokens(0, 6))
    cache.append(table, (6,))
    cache.append(table, (7, 8, 9))
    assert [cache.contents(block) for block in table.blocks] == [(0, 1, 2, 3), (4, 5, 6, 7), (8, 9)]
    assert table.num_tokens == 10
    cache.free(table)
    # A follow-up turn whose prompt repeats prompt and answer hits the blocks the answer filled.
    assert allocated(cache, tokens(0, 11)).hit_tokens == 8


def test_generated_tokens_stop_being_recorded_when_the_cache_is_full() -> None:
    cache = KVCache(BLOCK, 2)
    table = allocated(cache, tokens(0, 7))
    cache.append(table, (7, 8, 9))
    assert table.overflowed and table.num_tokens == 8
    cache.append(table, (10,))
    assert table.num_tokens == 8


def test_prefix_hits_count_whole_blocks_and_never_the_last_prompt_token() -> None:
    cache = KVCache(BLOCK, 16)
    first = allocated(cache, tokens(0, 10), "salt-a")
    assert first.hit_tokens == 0
    again = allocated(cache, tokens(0, 10), "salt-a")
    assert again.hit_tokens == 8
    assert again.blocks[:2] == first.blocks[:2] and again.blocks[2] != first.blocks[2]
    # A block-aligned prompt recomputes its last token, so its last block is not a hit (vLLM's rule).
    assert allocated(cache, tokens(0, 8), "salt-a").hit_tokens == 4
    # A diverging second block stops the chain there.
    assert allocated(cache, [*tokens(0, 4), 99, 5, 6, 7, 8, 9], "salt-a").hit_tokens == 4


def test_the_salt_separates_the_cache_and_no_salt_is_shared() -> None:
    cache = KVCache(BLOCK, 32)
    allocated(cache, tokens(0, 20), "tenant-a")
    assert allocated(cache, tokens(0, 20), "tenant-b").hit_tokens == 0
    assert allocated(cache, tokens(0, 20)).hit_tokens == 0
    assert allocated(cache, tokens(0, 20)).hit_tokens == 16  # two unsalted callers share the cache


def test_shared_blocks_stay_in_use_until_their_last_holder_frees_them() -> None:
    cache = KVCache(BLOCK, 8)
    first = allocated(cache, tokens(0, 9))
    second = allocated(cache, tokens(0, 9))
    assert cache.num_used_blocks == 4  # two shared blocks, and a partial last block each
    cache.free(first)
    assert cache.num_used_blocks == 3
    cache.free(second)
    assert cache.num_used_blocks == 0


def test_a_hit_on_a_free_block_takes_it_off_the_free_queue() -> None:
    cache = KVCache(BLOCK, 4)
    cache.free(allocated(cache, tokens(0, 9)))  # blocks 0, 1, 2 freed; 0 and 1 still name their contents
    table = allocated(cache, tokens(0, 9))
    assert (table.hit_tokens, table.blocks) == (8, [0, 1, 3])
    assert cache.free_blocks() == [2]


def test_a_reused_block_loses_its_place_in_the_prefix_cache() -> None:
    cache = KVCache(BLOCK, 3)
    cache.free(allocated(cache, tokens(0, 9)))
    cache.free(allocated(cache, tokens(500, 12)))  # takes every block, overwriting the first prompt
    assert allocated(cache, tokens(0, 9)).hit_tokens == 0


def test_allocation_fails_when_too_few_blocks_are_free() -> None:
    cache = KVCache(BLOCK, 4)
    held = allocated(cache, tokens(0, 9))
    assert cache.allocate(tokens(100, 8)) is None
    assert cache.num_used_blocks == 3  # a failed allocation takes nothing
    cache.free(held)
    assert cache.allocate(tokens(100, 16)) is not None


def test_the_cache_needs_a_block_and_a_slot() -> None:
    with pytest.raises(ValueError):
        KVCache(0, 4)
    assert KVCache(16, 1024).capacity_tokens == 16_384


def test_growing_adds_blank_blocks_first_in_the_free_queue() -> None:
    cache = KVCache(BLOCK, 2)
    cache.free(allocated(cache, tokens(0, 8)))
    cache.resize(4)
    assert (cache.num_blocks, cache.capacity_tokens, cache.num_free_blocks) == (4, 16, 4)
    assert cache.free_blocks()[2:] == [1, 0]  # the freed sequence stays where it was, last in line
    assert list(cache.stale_tokens()) == tokens(0, 8)
    assert allocated(cache, tokens(0, 8)).hit_tokens == 4  # and still serves its prefix


def test_shrinking_takes_free_blocks_out_of_service_next_evicted_first() -> None:
    cache = KVCache(BLOCK, 4)
    cache.free(allocated(cache, tokens(0, 8)))  # blocks 0, 1; free queue [2, 3, 1, 0]
    cache.resize(2)
    assert cache.free_blocks() == [1, 0]
    assert (cache.capacity_tokens, cache.usage()) == (8, 0)
    assert cache.allocate(tokens(100, 9)) is None  # three blocks: more than the cache has now
    with pytest.raises(ValueError):
        cache.resize(0)


def test_shrinking_below_the_held_blocks_retires_them_as_they_are_freed() -> None:
    cache = KVCache(BLOCK, 3)
    held = allocated(cache, tokens(0, 8))  # blocks 0, 1
    cache.resize(1)  # block 2 at once, then one of the held blocks
    assert (cache.num_free_blocks, cache.num_used_blocks, cache.usage()) == (0, 2, 1.0)
    cache.free(held)  # its last block is retired, its first is free
    assert (cache.free_blocks(), cache.num_used_blocks) == ([0], 0)
    cache.resize(3)  # the retired blocks come back, blank, before any new one is made
    assert sorted(cache.free_blocks()) == [0, 1, 2]
    assert allocated(cache, tokens(0, 9)).hit_tokens == 4  # block 1, once retired, names no prefix any more


@pytest.fixture(scope="module")
def detokenizer(tokenizer_dir: Path) -> tuple[Detokenizer, ModelTokenizer]:
    model = ModelTokenizer.from_dir(tokenizer_dir)
    return Detokenizer(model.tokenizer), model


@pytest.mark.parametrize("text", ["Hello there, CNRY-ABCDEFGHIJKLMNOPQRST!", "héllo 🚀 wörld", "日本語のテキスト"])
def test_pieces_join_to_the_decoded_text(detokenizer: tuple[Detokenizer, ModelTokenizer], text: str) -> None:
    detok, model = detokenizer
    ids = model.tokenizer.encode(text, add_special_tokens=False).ids
    pieces = detok.pieces(ids)
    assert len(pieces) == len(ids)
    assert "".join(pieces) == text
    assert all("\ufffd" not in piece for piece in pieces)


def test_special_tokens_are_known_and_never_decoded(detokenizer: tuple[Detokenizer, ModelTokenizer]) -> None:
    detok, model = detokenizer
    bos = model.tokenizer.token_to_id("<|begin_of_text|>")
    assert bos in detok.special_ids
    assert detok.decode([bos]) == "" and detok.pieces([]) == ()
