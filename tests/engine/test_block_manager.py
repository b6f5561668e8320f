"""Table-driven cases for the paged-KV bookkeeping."""
import pytest

from specserve.engine.block_manager import BlockManager

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
