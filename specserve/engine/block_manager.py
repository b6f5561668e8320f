"""Paged KV cache bookkeeping: fixed-size blocks, one block table per sequence, and the prefix cache.

Prefix caching (on by default, as in vLLM): a block whose every position holds final KV (committed
tokens, computed) is registered under the hash of its tokens chained to its predecessor's hash, so that
a later request whose tokens start the same way takes those blocks instead of computing them again. A
block is reference-counted; at zero references it joins the free list but keeps its content and hash
until a block is needed and it is the least recently freed one (LRU eviction). A sequence releases its
blocks last first, so the tail of a conversation is evicted before the system prompt it shares.
The chain starts from a salt (the request's `cache_salt`): requests with different salts never share.
"""
from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np


def block_hash(parent: bytes, tokens: list[int]) -> bytes:
    """The hash of a full block: its tokens chained to the hash of every block before it."""
    return hashlib.blake2b(parent + np.asarray(tokens, dtype=np.int64).tobytes(), digest_size=16).digest()


def salt_hash(salt: str | None) -> bytes:
    """The chain's start: requests with different salts never share a block."""
    return hashlib.blake2b((salt or "").encode(), digest_size=16).digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False):
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.free_blocks: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # LRU first
        self.refs = [0] * num_blocks
        self.cached: dict[bytes, int] = {}   # hash -> block holding that content
        self.hash_of: dict[int, bytes] = {}  # block -> its hash, while it is registered

    @property
    def num_free(self) -> int:
        """Blocks a sequence can take: unreferenced ones, cached content or not."""
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
            block, _ = self.free_blocks.popitem(last=False)
            if (h := self.hash_of.pop(block, None)) is not None:  # evicted: its content is about to change
                del self.cached[h]
            self.refs[block] = 1
            table.append(block)

    def shrink(self, table: list[int], num_tokens: int) -> None:
        """Release the blocks past the first `num_tokens` slots (e.g. rejected draft positions)."""
        keep = self.blocks_needed(num_tokens)
        while len(table) > keep:
            self._release(table.pop())

    def free(self, table: list[int]) -> None:
        for block in reversed(table):  # the tail first: it is evicted before the prefix others may share
            self._release(block)
        table.clear()

    def _release(self, block: int) -> None:
        self.refs[block] -= 1
        if not self.refs[block]:
            self.free_blocks[block] = None

    # ---- prefix cache ----------------------------------------------------------------------------
    def match(self, hashes: list[bytes], num_tokens: int) -> list[int]:
        """Take the cached blocks of the longest prefix of `hashes` (the full blocks of a prompt of
        `num_tokens` tokens, the last of which is always computed, not taken from the cache)."""
        taken = []
        if self.enable_caching:
            for h in hashes[:(num_tokens - 1) // self.block_size]:
                block = self.cached.get(h)
                if block is None:
                    break
                if not self.refs[block]:
                    del self.free_blocks[block]
                self.refs[block] += 1
                taken.append(block)
        return taken

    def reset_cache(self) -> None:
        """Forget every cached prefix (vLLM's reset_prefix_cache): blocks in use keep their content but are
        no longer shared with later requests."""
        self.cached.clear()
        self.hash_of.clear()

    def register(self, block: int, h: bytes) -> None:
        """The block's positions all hold final KV for the tokens `h` hashes: later prompts may share it.
        (Content already cached in another block stays there: this one remains private.)"""
        if self.enable_caching and h not in self.cached and block not in self.hash_of:
            self.cached[h] = block
            self.hash_of[block] = h
