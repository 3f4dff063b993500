"""A paged KV cache with automatic prefix caching, modelled on vLLM's V1 block pool and KV cache manager.

The cache is `num_blocks` blocks of `block_size` token slots. A sequence (one request's prompt, then its
generated tokens) is written block by block into blocks taken from the free queue. What the simulator keeps
per block is the token ids written into it: that is all a stale-page fault needs to leak, and all a prefix
hit needs to be checked against.

Like GPU memory, a freed block keeps its contents until it is handed out again. The free queue is vLLM's
`FreeKVCacheBlockQueue`: blocks are taken from the front (least recently freed first) and a sequence's blocks
are freed in reverse order onto the back, so its tail blocks are evicted before its head, and reading the
queue from the back yields the most recently finished sequence from its first block on.

Prefix caching: every full block is named by a hash chain, hash((parent hash, block token ids)), whose root
is derived from the request's cache_salt (no salt is a root of its own). vLLM mixes the salt into the first
block's extra keys only; because every later hash contains its parent's, the whole chain is salt-specific.
A new sequence reuses the blocks whose chain matches its leading full blocks, whether in use or free but not
yet reused (taking a free one off the queue), and never its last partial block. As in vLLM, the last prompt
token is always recomputed, so a block-aligned prompt can hit at most all its blocks but the last. A hit is
checked against the block's stored parent hash and tokens, so a hash collision cannot leak a block.

Resizing (a disaggregated pool's capacity changed at run time, `PUT /sim/capacity`): growing adds blank blocks at
the front of the free queue; shrinking takes free blocks out of service from the front (those evicted next
anyway), and when too few are free, retires held blocks as their sequences free them. A retired block keeps its
id (block ids index the per-block lists) but is in no queue and names no prefix; growing again revives retired
blocks before it adds new ones.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field


@dataclass(eq=False)
class BlockTable:
    """The blocks one sequence holds, in order, and where its next token goes."""

    blocks: list[int]
    num_tokens: int
    parent: int  # hash of the last full block (the chain root before the first), parent of the next full one
    hit_tokens: int  # prompt tokens found in the prefix cache at allocation
    overflowed: bool = False  # the cache ran out of free blocks while writing generated tokens
    freed: bool = False


@dataclass
class _Blocks:
    """Per-block state, in parallel lists indexed by block id (cheaper than an object per block)."""

    contents: list[tuple[int, ...]]
    refs: list[int]
    hashes: list[int | None]  # the chain hash of a full block's contents; None for a partial or unwritten one
    parents: list[int]
    free: OrderedDict[int, None] = field(default_factory=OrderedDict)  # front = least recently freed


class KVCache:
    def __init__(self, block_size: int, num_blocks: int) -> None:
        if block_size < 1 or num_blocks < 1:
            raise ValueError("block_size and num_blocks must be at least 1")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self._blocks = _Blocks(
            contents=[()] * num_blocks, refs=[0] * num_blocks, hashes=[None] * num_blocks, parents=[0] * num_blocks
        )
        self._blocks.free.update(dict.fromkeys(range(num_blocks)))
        self._cached: dict[int, int] = {}  # chain hash -> the block holding those tokens
        self._retired: list[int] = []  # blocks out of service after a shrink
        self._retiring = 0  # held blocks a shrink still has to take out of service as they are freed

    @property
    def capacity_tokens(self) -> int:
        return self.block_size * self.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._blocks.free)

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by sequences (after a shrink, for a while more than num_blocks)."""
        return len(self._blocks.refs) - len(self._retired) - len(self._blocks.free)

    def usage(self) -> float:
        """Fraction of blocks held by sequences, vLLM's kv_cache_usage_perc (cached free blocks count as free)."""
        return min(1.0, self.num_used_blocks / self.num_blocks)

    def resize(self, num_blocks: int) -> None:
        """Make the cache num_blocks blocks: new or revived ones first in the free queue, or free ones (then held
        ones, as they are freed) out of service."""
        if num_blocks < 1:
            raise ValueError("num_blocks must be at least 1")
        change = num_blocks - self.num_blocks
        self.num_blocks = num_blocks
        if change > 0:
            self._grow(change)
        elif change < 0:
            self._shrink(-change)

    def _grow(self, count: int) -> None:
        kept = min(count, self._retiring)  # held blocks a shrink had not yet taken stay in service
        self._retiring -= kept
        count -= kept
        state = self._blocks
        for _ in range(count):
            if self._retired:
                block = self._retired.pop()
            else:
                block = len(state.refs)
                state.contents.append(())
                state.refs.append(0)
                state.hashes.append(None)
                state.parents.append(0)
            state.contents[block] = ()
            state.free[block] = None
            state.free.move_to_end(block, last=False)

    def _shrink(self, count: int) -> None:
        free = self._blocks.free
        while count and free:
            block, _ = free.popitem(last=False)
            self._retire(block)
            count -= 1
        self._retiring += count

    def _retire(self, block: int) -> None:
        old = self._blocks.hashes[block]
        if old is not None and self._cached.get(old) == block:
            del self._cached[old]
        self._blocks.hashes[block] = None
        self._retired.append(block)

    def contents(self, block: int) -> tuple[int, ...]:
        return self._blocks.contents[block]

    def free_blocks(self) -> list[int]:
        """The free queue, the block handed out next first."""
        return list(self._blocks.free)

    def allocate(self, token_ids: Sequence[int], salt: str | None = None) -> BlockTable | None:
        """Write a prompt into the cache, reusing cached leading blocks; None if too few blocks are free.

        The loops are inlined on purpose: a 2,048-token prompt is 128 blocks, and this runs on every request
        of the gateway's overhead benchmarks (about 60 µs for 128 new blocks, 50 µs for 128 hits).
        """
        size = self.block_size
        ids = tuple(token_ids)
        count = len(ids)
        state = self._blocks
        contents, parents, refs, hashes, free = state.contents, state.parents, state.refs, state.hashes, state.free
        cached = self._cached
        parent = _root(salt)
        blocks: list[int] = []
        for start in range(0, (count - 1) // size * size, size):
            chunk = ids[start : start + size]
            block_hash = hash((parent, chunk))
            block = cached.get(block_hash)
            if block is None or parents[block] != parent or contents[block] != chunk:
                break
            blocks.append(block)
            parent = block_hash
        hit_blocks = len(blocks)
        needed = -(-count // size) - hit_blocks
        if needed > len(free) or needed + sum(1 for block in blocks if refs[block] == 0) > len(free):
            return None
        for block in blocks:
            if refs[block] == 0:
                del free[block]
            refs[block] += 1
        take = free.popitem
        for start in range(hit_blocks * size, count, size):
            chunk = ids[start : start + size]
            block = take(last=False)[0]
            old = hashes[block]
            if old is not None and cached.get(old) == block:
                del cached[old]
            refs[block] = 1
            contents[block] = chunk
            blocks.append(block)
            if len(chunk) == size:
                block_hash = hash((parent, chunk))
                hashes[block] = block_hash
                parents[block] = parent
                # A second block with the same chain stays unnamed, as in vLLM: the first keeps the name.
                cached.setdefault(block_hash, block)
                parent = block_hash
            else:
                hashes[block] = None
        return BlockTable(blocks=blocks, num_tokens=count, parent=parent, hit_tokens=hit_blocks * size)

    def append(self, table: BlockTable, token_ids: Sequence[int]) -> None:
        """Write generated tokens after the sequence's last one; past the last free block they are not kept."""
        if table.freed or table.overflowed or not token_ids:
            return
        size = self.block_size
        contents = self._blocks.contents
        position = 0
        while position < len(token_ids):
            used = table.num_tokens % size
            if used == 0:
                if not self._blocks.free:
                    table.overflowed = True  # vLLM would preempt; the simulator just stops recording
                    return
                block = self._take_free()
                contents[block] = ()
                table.blocks.append(block)
            block = table.blocks[-1]
            chunk = tuple(token_ids[position : position + size - used])
            contents[block] += chunk
            position += len(chunk)
            table.num_tokens += len(chunk)
            if used + len(chunk) == size:
                table.parent = self._register(block, table.parent, contents[block])

    def free(self, table: BlockTable) -> None:
        """Give the sequence's blocks back, last block first, keeping their contents and hashes."""
        if table.freed:
            return
        table.freed = True
        refs, free = self._blocks.refs, self._blocks.free
        for block in reversed(table.blocks):
            refs[block] -= 1
            if refs[block] == 0:
                if self._retiring:
                    self._retiring -= 1
                    self._retire(block)
                else:
                    free[block] = None

    def stale_tokens(self) -> Iterator[int]:
        """What freed blocks still hold, most recently freed block first, each block's tokens in order."""
        contents = self._blocks.contents
        for block in reversed(self._blocks.free):
            yield from contents[block]

    def _take_free(self) -> int:
        block, _ = self._blocks.free.popitem(last=False)
        state = self._blocks
        old = state.hashes[block]
        if old is not None:
            if self._cached.get(old) == block:
                del self._cached[old]
            state.hashes[block] = None
        state.refs[block] = 1
        return block

    def _register(self, block: int, parent: int, chunk: tuple[int, ...]) -> int:
        block_hash = hash((parent, chunk))
        self._blocks.hashes[block] = block_hash
        self._blocks.parents[block] = parent
        self._cached.setdefault(block_hash, block)
        return block_hash


def _root(salt: str | None) -> int:
    return hash(("cache_salt", salt))
