"""Table-driven cases for the paged-KV bookkeeping."""
import pytest

from specserve.engine.block_manager import BlockManager, block_hash, salt_hash

CASES = [
    # (name, operations, free blocks after, table length after); block_size 4, 8 blocks
    ("grow to 1 token takes one block", [("grow", 1)], 7, 1),
    ("grow within a block takes nothing more", [("grow", 3), ("grow", 4)], 7, 1),
    ("grow across a boundary takes one more", [("grow", 4), ("grow", 5)], 6, 2),
    ("shrink releases whole blocks past the tokens", [("grow", 13), ("shrink", 5)], 6, 2),
    ("shrink to a block boundary keeps it exactly", [("grow", 13), ("shrink", 8)], 6, 2),
    ("shrink never grows", [("grow", 5), ("shrink", 16)], 6, 2),
    ("free returns everything", [("grow", 30), ("free", None)], 8, 0),
]


@pytest.mark.parametrize("name,ops,free,length", CASES, ids=[c[0] for c in CASES])
def test_block_table_operations(name, ops, free, length):
    bm, table = BlockManager(8, 4), []
    for op, n in ops:
        if op == "grow":
            assert bm.can_grow(table, n)
            bm.grow(table, n)
        elif op == "shrink":
            bm.shrink(table, n)
        else:
            bm.free(table)
    assert (bm.num_free, len(table)) == (free, length)
    assert len(set(table)) == len(table) and not set(table) & set(bm.free_blocks)


@pytest.mark.parametrize("held,want,ok", [(0, 32, True), (0, 33, False), (5, 32, True), (8, 33, False)])
def test_can_grow_counts_held_and_free_blocks(held, want, ok):
    bm, table = BlockManager(8, 4), []
    bm.grow(table, held * 4)
    assert bm.can_grow(table, want) is ok
    assert bm.usage == held / 8


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError):
        BlockManager(0, 4)


# ---- prefix cache -------------------------------------------------------------------------------

def chain(tokens: list[int], size: int = 4, salt: str | None = None) -> list[bytes]:
    hashes, parent = [], salt_hash(salt)
    for i in range(len(tokens) // size):
        parent = block_hash(parent, tokens[i * size:(i + 1) * size])
        hashes.append(parent)
    return hashes


def cached_table(bm: BlockManager, tokens: list[int]) -> list[int]:
    """A request that computed `tokens` and registered its full blocks."""
    table = []
    bm.grow(table, len(tokens))
    for block, h in zip(table, chain(tokens)):
        bm.register(block, h)
    return table


def test_a_later_prompt_takes_the_cached_blocks_of_its_longest_shared_prefix():
    bm = BlockManager(8, 4, enable_caching=True)
    first = cached_table(bm, list(range(10)))  # blocks of tokens 0-3 and 4-7 are full
    taken = bm.match(chain([0, 1, 2, 3, 4, 5, 6, 7, 99, 98]), 10)
    assert taken == first[:2] and [bm.refs[b] for b in taken] == [2, 2]
    assert bm.match(chain([0, 1, 2, 3, 9, 9, 9, 9, 9]), 9) == first[:1]  # diverges in the second block
    assert bm.match(chain([5, 1, 2, 3, 4, 5, 6, 7, 8]), 9) == []          # diverges in the first: nothing


def test_the_last_token_is_never_taken_from_the_cache():
    bm = BlockManager(8, 4, enable_caching=True)
    cached_table(bm, list(range(8)))
    assert len(bm.match(chain(list(range(8))), 8)) == 1  # its logits are needed: the second block is computed
    assert len(bm.match(chain(list(range(9))), 9)) == 2


def test_freed_blocks_keep_their_content_until_evicted_least_recently_freed_first():
    bm = BlockManager(4, 4, enable_caching=True)
    a = cached_table(bm, list(range(8)))
    bm.free(list(a))
    assert bm.num_free == 4  # free for anyone, still cached
    assert bm.match(chain(list(range(9))), 9) == a  # taken back from the free list
    bm.free(list(a))
    table = []
    bm.grow(table, 12)  # blocks never used first, then the least recently freed: a's tail (freed first)
    assert table[2] == a[1] and bm.match(chain(list(range(9))), 9) == [a[0]]


def test_different_salts_never_share_and_a_disabled_cache_finds_nothing():
    bm = BlockManager(8, 4, enable_caching=True)
    cached_table(bm, list(range(8)))
    assert chain(list(range(8)), salt="tenant-b") != chain(list(range(8)))
    assert bm.match(chain(list(range(9)), salt="tenant-b"), 9) == []
    off = BlockManager(8, 4)
    cached_table(off, list(range(8)))
    assert off.match(chain(list(range(9))), 9) == [] and not off.cached


def test_reset_forgets_every_prefix_and_frees_nothing():
    bm = BlockManager(8, 4, enable_caching=True)
    held = cached_table(bm, list(range(8)))
    bm.reset_cache()
    assert bm.match(chain(list(range(9))), 9) == [] and bm.num_free == 6 and len(held) == 2
