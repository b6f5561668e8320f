"""Paged KV cache bookkeeping: a free list of fixed-size blocks and one block table per sequence."""
from __future__ import annotations

from collections import deque


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.free_blocks: deque[int] = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free_blocks)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_grow(self, table: list[int], num_tokens: int) -> bool:
        return self.blocks_needed(num_tokens) - len(table) <= self.num_free

    def grow(self, table: list[int], num_tokens: int) -> None:
        """Extend `table` in place so it covers `num_tokens` slots. Caller checked can_grow."""
        for _ in range(self.blocks_needed(num_tokens) - len(table)):
            table.append(self.free_blocks.popleft())

    def shrink(self, table: list[int], num_tokens: int) -> None:
        """Release the blocks past the first `num_tokens` slots (e.g. rejected draft positions)."""
        keep = self.blocks_needed(num_tokens)
        while len(table) > keep:
            self.free_blocks.append(table.pop())

    def free(self, table: list[int]) -> None:
        self.free_blocks.extend(table)
        table.clear()
