"""Block pool and KV cache manager, without any model."""

from service.core.block_pool import BlockPool
from service.core.kv_cache import KVCacheManager

BS = 4


def tokens(n: int, start: int = 0) -> list[int]:
    return list(range(start, start + n))


def test_allocate_and_release_all_blocks():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    assert kv.allocate("a", 10)  # 3 blocks
    assert kv.allocate("b", 20)  # 5 blocks
    assert kv.pool.num_free == 0
    assert not kv.allocate("c", 1)
    assert not kv.holds("c")
    kv.free("a")
    kv.free("b")
    assert kv.pool.num_free == 8


def test_allocate_grows_table_block_by_block():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    assert kv.allocate("a", 3)
    assert len(kv.block_ids("a")) == 1
    assert kv.allocate("a", 5)
    assert len(kv.block_ids("a")) == 2
    assert kv.allocate("a", 16)
    assert not kv.allocate("a", 17)
    assert len(kv.block_ids("a")) == 4  # a failed allocation changes nothing


def test_prefix_hit_after_free_keeps_cached_block():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    prompt = tokens(10)
    assert kv.allocate("a", 10, kv.find_prefix("a", prompt))
    kv.cache_full_blocks("a", prompt, 10)
    first_blocks = kv.block_ids("a")[:2]
    kv.free("a")  # blocks are free but still hold their content
    hit = kv.find_prefix("b", prompt)
    assert hit.num_tokens == 8
    assert kv.allocate("b", 10, hit)
    assert kv.block_ids("b")[:2] == first_blocks
    # Reusing a freed-but-cached block must not lose its cache entry.
    kv.free("b")
    assert kv.find_prefix("c", prompt).num_tokens == 8
    assert kv.hit_rate == 8 / 20


def test_prefix_hit_capped_below_prompt_length():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    prompt = tokens(8)  # exactly two full blocks
    kv.allocate("a", 8, kv.find_prefix("a", prompt))
    kv.cache_full_blocks("a", prompt, 8)
    hit = kv.find_prefix("b", prompt)
    assert hit.num_tokens == 4  # the last token must be computed to get logits


def test_prefix_hash_chains_whole_prefix():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    a = tokens(9)
    kv.allocate("a", 9, kv.find_prefix("a", a))
    kv.cache_full_blocks("a", a, 9)
    b = [99] + a[1:]  # same second block, different first block
    assert kv.find_prefix("b", b).num_tokens == 0


def test_shared_prefix_blocks_are_reference_counted():
    kv = KVCacheManager(num_blocks=8, block_size=BS)
    prompt = tokens(9)
    kv.allocate("a", 9, kv.find_prefix("a", prompt))
    kv.cache_full_blocks("a", prompt, 9)
    kv.allocate("b", 9, kv.find_prefix("b", prompt))
    shared = kv.block_ids("a")[:2]
    assert kv.block_ids("b")[:2] == shared
    assert kv.pool.num_free == 8 - 4
    kv.free("a")
    assert kv.pool.num_free == 8 - 3  # a's private tail is free, the shared blocks still held by b
    kv.free("b")
    assert kv.pool.num_free == 8


def test_eviction_order_uncached_first_then_least_recently_freed():
    pool = BlockPool(4)
    blocks = [pool.allocate() for _ in range(4)]
    pool.cache(blocks[0], 100)
    pool.cache(blocks[1], 101)
    pool.release(blocks[0])  # cached, freed first
    pool.release(blocks[1])  # cached, freed second
    pool.release(blocks[2])  # no content
    assert pool.allocate() is blocks[2]
    assert pool.num_evictions == 0
    assert pool.allocate() is blocks[0]
    assert pool.num_evictions == 1
    assert pool.lookup(100) is None
    assert pool.lookup(101) is blocks[1]


def test_full_pool_evicts_cached_blocks_for_new_requests():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    prompt = tokens(16)
    kv.allocate("a", 16, kv.find_prefix("a", prompt))
    kv.cache_full_blocks("a", prompt, 16)
    kv.free("a")
    assert kv.pool.num_cached == 4
    assert kv.allocate("b", 16, kv.find_prefix("b", tokens(16, 1000)))
    assert kv.pool.num_evictions == 4
    assert kv.find_prefix("c", prompt).num_tokens == 0


def test_usage_counts_held_blocks():
    kv = KVCacheManager(num_blocks=4, block_size=BS)
    kv.allocate("a", 8)
    assert kv.usage == 0.5


def test_cache_salts_never_share_blocks():
    kv = KVCacheManager(num_blocks=16, block_size=BS)
    prompt = tokens(13)
    assert kv.allocate("a", 13, kv.find_prefix("a", prompt, "tenant-1"))
    kv.cache_full_blocks("a", prompt, 13, "tenant-1")
    kv.free("a")
    assert kv.find_prefix("b", prompt, "tenant-2").num_tokens == 0
    assert kv.find_prefix("c", prompt).num_tokens == 0  # no salt is a tenant of its own
    assert kv.find_prefix("d", prompt, "tenant-1").num_tokens == 12


def test_digests_chain_and_depend_on_the_engine_identity():
    from service.core.kv_cache import chain_digest, root_digest

    root = root_digest(b"model-a", "")
    assert root != root_digest(b"model-b", "") and root != root_digest(b"model-a", "salt")
    first = chain_digest(root, [1, 2, 3, 4])
    assert len(first) == 32 and first == chain_digest(root, [1, 2, 3, 4])
    assert chain_digest(first, [5, 6, 7, 8]) != chain_digest(root, [5, 6, 7, 8])  # the position is in the chain
    assert chain_digest(root, [1, 2, 3, 4]) != chain_digest(root, [1, 2, 3, 5])
    # ids are fixed-width, so different splits of the same digits cannot meet
    assert chain_digest(root, [1, 23]) != chain_digest(root, [12, 3])
