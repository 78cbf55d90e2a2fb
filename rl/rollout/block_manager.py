"""``BlockManager``: the paged KV cache's block pool, reference counts and prefix cache.

The cache is ``num_blocks`` blocks of ``block_size`` token slots. A sequence owns a block
table (block ids in position order); a block shared by several tables (a GRPO group's common
prompt, a session prefix) has a reference count above 1. Only *full* blocks are shared, and
a full block is never written again, so sharing needs no copy: a sequence only ever writes
into its own partial last block.

Prefix cache. A full block, once its keys/values are computed, is registered under a key
that chains the whole prefix: ``hash((version, chain_i))`` with
``chain_i = hash((chain_{i-1}, tokens of block i))``, so a hit means the same tokens at the
same positions under the same weights (the tokens are compared too, so a hash collision is
a miss). Blocks whose count drops to 0 go to an LRU free list *keeping* their key: they are
still prefix-cache hits until the allocator reuses them, oldest first.
"""

from __future__ import annotations

from collections import OrderedDict


def chain_hash(prev: int, tokens: tuple[int, ...]) -> int:
    return hash((prev, tokens))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"BlockManager needs num_blocks >= 1 and block_size >= 1, got {num_blocks}, {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.ref_count = [0] * num_blocks
        self._key: list[int | None] = [None] * num_blocks
        self._tokens: list[tuple[int, ...] | None] = [None] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # LRU order
        self._cached: dict[int, int] = {}  # prefix key -> block id

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def allocate(self) -> int:
        """A fresh block (the least recently freed one, dropping its prefix-cache entry)."""
        block, _ = self._free.popitem(last=False)
        if self._key[block] is not None:
            del self._cached[self._key[block]]
            self._key[block] = self._tokens[block] = None
        self.ref_count[block] = 1
        return block

    def lookup(self, key: int, tokens: tuple[int, ...]) -> int | None:
        block = self._cached.get(key)
        return block if block is not None and self._tokens[block] == tokens else None

    def acquire(self, block: int) -> None:
        """Share an existing (cached or live) block."""
        if self.ref_count[block] == 0:
            del self._free[block]
        self.ref_count[block] += 1

    def release(self, blocks: list[int]) -> None:
        # Tail first, so a prefix's head blocks are the last to be reused.
        for block in reversed(blocks):
            self.ref_count[block] -= 1
            assert self.ref_count[block] >= 0, f"block {block} released twice"
            if self.ref_count[block] == 0:
                self._free[block] = None

    def register(self, block: int, key: int, tokens: tuple[int, ...]) -> None:
        """Offer a computed full block to the prefix cache (first writer wins)."""
        if key in self._cached or self._key[block] is not None:
            return
        self._cached[key] = block
        self._key[block], self._tokens[block] = key, tokens

    def is_cached(self, key: int) -> bool:
        return key in self._cached

    def clear_cache(self) -> None:
        """Forget every prefix-cache entry (new weights make the cached keys/values stale)."""
        self._cached.clear()
        self._key = [None] * self.num_blocks
        self._tokens = [None] * self.num_blocks
