"""Per-request block tables over the block pool, with automatic prefix caching.

A full block's hash chains the previous block's hash with its own tokens, so equal hashes mean
equal prefixes. A prompt whose leading full blocks are cached skips computing them.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from service.core.block_pool import Block, BlockPool


@dataclass
class PrefixHit:
    blocks: list[Block]
    num_tokens: int


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True) -> None:
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._tables: dict[int, list[Block]] = {}
        self._hashes: dict[int, list[int]] = {}  # hashes of each request's full blocks, computed once
        self.num_hit_tokens = 0
        self.num_queried_tokens = 0

    # -- queries ---------------------------------------------------------------------------------------
    def block_ids(self, request_id: int) -> list[int]:
        return [b.block_id for b in self._tables.get(request_id, ())]

    def holds(self, request_id: int) -> bool:
        return request_id in self._tables

    @property
    def usage(self) -> float:
        return 1.0 - self.pool.num_free / self.pool.num_blocks

    @property
    def hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache ----------------------------------------------------------------------------------
    def find_prefix(self, request_id: int, token_ids: Sequence[int]) -> PrefixHit:
        """Longest cached run of full blocks at the start of token_ids, capped at len(token_ids) - 1
        tokens because the last token must be computed to get logits. Takes no references."""
        hit = PrefixHit([], 0)
        if not self.enable_prefix_caching:
            return hit
        for block_hash in self._full_block_hashes(request_id, token_ids):
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hit.blocks.append(block)
        if hit.blocks and len(hit.blocks) * self.block_size >= len(token_ids):
            hit.blocks.pop()
        hit.num_tokens = len(hit.blocks) * self.block_size
        return hit

    def _full_block_hashes(self, request_id: int, token_ids: Sequence[int]) -> list[int]:
        hashes = self._hashes.setdefault(request_id, [])
        bs = self.block_size
        for i in range(len(hashes), len(token_ids) // bs):
            parent = hashes[-1] if hashes else 0
            hashes.append(hash((parent, tuple(token_ids[i * bs : (i + 1) * bs]))))
        return hashes

    # -- allocation ------------------------------------------------------------------------------------
    def allocate(self, request_id: int, num_tokens: int, prefix: PrefixHit | None = None, keep_free: int = 0) -> bool:
        """Make the request's table cover num_tokens tokens, first taking the prefix-hit blocks.
        Returns False, changing nothing, when the pool cannot supply the new blocks and still keep
        keep_free blocks free."""
        table = self._tables.get(request_id, [])
        hit_blocks = prefix.blocks if prefix and not table else []
        num_new = self.blocks_needed(num_tokens) - len(table) - len(hit_blocks)
        reusable_free = sum(1 for b in hit_blocks if b.ref_count == 0)
        if num_new > self.pool.num_free - reusable_free - keep_free:
            return False
        if request_id not in self._tables:
            self._tables[request_id] = table
            self.num_queried_tokens += num_tokens if prefix is not None else 0
            self.num_hit_tokens += prefix.num_tokens if prefix is not None else 0
        for block in hit_blocks:
            self.pool.acquire(block)
            table.append(block)
        for _ in range(max(num_new, 0)):
            fresh = self.pool.allocate()
            assert fresh is not None
            table.append(fresh)
        return True

    def cache_full_blocks(self, request_id: int, token_ids: Sequence[int], num_computed: int) -> None:
        """After a step: register the blocks that the computed tokens have filled."""
        if not self.enable_prefix_caching:
            return
        table = self._tables[request_id]
        num_full = num_computed // self.block_size
        hashes = self._full_block_hashes(request_id, token_ids[: num_full * self.block_size])
        for i in range(num_full):
            if table[i].hash is None:
                self.pool.cache(table[i], hashes[i])

    def free(self, request_id: int) -> None:
        """Release every block the request holds; tail blocks first so they are evicted first."""
        for block in reversed(self._tables.pop(request_id, [])):
            self.pool.release(block)
        self._hashes.pop(request_id, None)
