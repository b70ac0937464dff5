"""KV-cache blocks: reference counts, a free list in eviction order, and the prefix-cache digest map.

The pool is mechanics only; which request holds which blocks is the KV cache manager's business.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(eq=False)
class Block:
    block_id: int
    ref_count: int = 0
    digest: bytes | None = None  # set once the block is full and its content is known


class BlockPool:
    """Owns every block. A free block may still hold cached content (digest set) until it is reused.

    Free blocks sit in an OrderedDict in eviction order: blocks without content first, then cached
    blocks from least to most recently freed. Every operation is O(1).
    """

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, Block] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[bytes, Block] = {}
        self.num_evictions = 0

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def allocate(self) -> Block | None:
        """Take the first block in eviction order, dropping its cached content. None when none is free."""
        if not self._free:
            return None
        _, block = self._free.popitem(last=False)
        if block.digest is not None:
            del self._cached[block.digest]
            block.digest = None
            self.num_evictions += 1
        block.ref_count = 1
        return block

    def lookup(self, digest: bytes) -> Block | None:
        return self._cached.get(digest)

    def acquire(self, block: Block) -> None:
        """Add a reference to a cached block, taking it off the free list if nobody held it.

        Its digest is kept: reusing a freed-but-cached block must not lose the cache entry.
        """
        if block.ref_count == 0:
            del self._free[block.block_id]
        block.ref_count += 1

    def release(self, block: Block) -> None:
        block.ref_count -= 1
        assert block.ref_count >= 0, f"block {block.block_id} released more often than acquired"
        if block.ref_count == 0:
            self._free[block.block_id] = block
            if block.digest is None:  # nothing worth keeping: reuse it before any cached block
                self._free.move_to_end(block.block_id, last=False)

    def cache(self, block: Block, digest: bytes) -> bool:
        """Record a full block's content digest; False when an identical block already holds the entry."""
        if block.digest is not None or digest in self._cached:
            return False
        block.digest = digest
        self._cached[digest] = block
        return True
