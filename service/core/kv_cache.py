"""Per-request block tables over the block pool, with automatic prefix caching.

A full block's digest chains the previous block's digest with its own tokens (blake2b-256), so equal
digests mean equal prefixes. The chain starts from a root made of the engine's identity (the model and
every setting that changes what a block holds) and the request's cache salt: blocks of another model,
configuration or tenant can never match, and a crafted prompt cannot collide with another's blocks. A
prompt whose leading full blocks are cached skips computing them.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from service.core.block_pool import Block, BlockPool

DIGEST_BYTES = 32


def chain_digest(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """The digest of a full block: blake2b-256 over its parent's digest and its token ids (little-endian u32)."""
    return hashlib.blake2b(parent + struct.pack(f"<{len(token_ids)}I", *token_ids), digest_size=DIGEST_BYTES).digest()


def root_digest(identity: bytes, cache_salt: str) -> bytes:
    """Where a request's chain starts: the engine's identity, then the tenant's salt ("" when none)."""
    salt = cache_salt.encode()
    return hashlib.blake2b(identity + struct.pack("<I", len(salt)) + salt, digest_size=DIGEST_BYTES).digest()


@dataclass
class PrefixHit:
    blocks: list[Block]
    num_tokens: int


class KVCacheManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, identity: bytes = b""
    ) -> None:
        self.pool = BlockPool(num_blocks)
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.identity = identity
        self._tables: dict[int, list[Block]] = {}
        self._digests: dict[int, list[bytes]] = {}  # digests of each request's full blocks, computed once
        self._newly_cached: list[Block] = []  # blocks that entered the cache since take_newly_cached()
        self.num_hit_tokens = 0
        self.num_queried_tokens = 0

    # -- queries ---------------------------------------------------------------------------------------
    def block_ids(self, request_id: int) -> list[int]:
        return [b.block_id for b in self._tables.get(request_id, ())]

    def num_blocks(self, request_id: int) -> int:
        return len(self._tables.get(request_id, ()))

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
    def find_prefix(self, request_id: int, token_ids: Sequence[int], cache_salt: str = "") -> PrefixHit:
        """Longest cached run of full blocks at the start of token_ids, capped at len(token_ids) - 1
        tokens because the last token must be computed to get logits. Takes no references."""
        hit = PrefixHit([], 0)
        if not self.enable_prefix_caching:
            return hit
        for digest in self.full_block_digests(request_id, token_ids, cache_salt):
            block = self.pool.lookup(digest)
            if block is None:
                break
            hit.blocks.append(block)
        if hit.blocks and len(hit.blocks) * self.block_size >= len(token_ids):
            hit.blocks.pop()
        hit.num_tokens = len(hit.blocks) * self.block_size
        return hit

    def full_block_digests(self, request_id: int, token_ids: Sequence[int], cache_salt: str) -> list[bytes]:
        """The chained digests of token_ids' full blocks (computed once per request, then extended)."""
        digests = self._digests.setdefault(request_id, [])
        bs = self.block_size
        for i in range(len(digests), len(token_ids) // bs):
            parent = digests[-1] if digests else root_digest(self.identity, cache_salt)
            digests.append(chain_digest(parent, token_ids[i * bs : (i + 1) * bs]))
        return digests

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

    def cache_full_blocks(
        self, request_id: int, token_ids: Sequence[int], num_computed: int, cache_salt: str = ""
    ) -> None:
        """After a step: register the blocks that the computed tokens have filled."""
        if not self.enable_prefix_caching:
            return
        table = self._tables[request_id]
        num_full = num_computed // self.block_size
        digests = self.full_block_digests(request_id, token_ids[: num_full * self.block_size], cache_salt)
        for i in range(num_full):
            if table[i].digest is None and self.pool.cache(table[i], digests[i]):
                self._newly_cached.append(table[i])

    def take_newly_cached(self) -> list[Block]:
        """The blocks that entered the prefix cache since the last call and still hold that content."""
        blocks, self._newly_cached = self._newly_cached, []
        return [b for b in blocks if b.digest is not None]

    def trim(self, request_id: int, num_tokens: int) -> None:
        """Give back the blocks past the first num_tokens tokens (rejected draft tokens' positions)."""
        table = self._tables[request_id]
        while len(table) > self.blocks_needed(num_tokens):
            self.pool.release(table.pop())

    def free(self, request_id: int) -> None:
        """Release every block the request holds; tail blocks first so they are evicted first."""
        for block in reversed(self._tables.pop(request_id, [])):
            self.pool.release(block)
        self._digests.pop(request_id, None)
