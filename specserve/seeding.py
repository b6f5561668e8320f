"""Per-request random generators from 64-bit seeds, without aliasing.

`torch.Generator.manual_seed` on the CPU seeds mt19937 from the low 32 bits of the seed only (its state
is filled from `seed & 0xffffffff` by the classic recurrence), so seeds that differ in their high bits,
-1 and 2**63 - 1 among them, would give the same stream. Here a seed is any integer of the signed 64-bit
range; it is taken modulo 2**64 (a bijection on that range) and expanded with SplitMix64 into all 624
words of the mt19937 state, which `Generator.set_state` installs. Distinct seeds give distinct states, and
the same seed always gives the same stream. CUDA's generator (Philox) keeps all 64 bits of its seed, so
there `manual_seed` is enough.
"""
from __future__ import annotations

import logging
import struct

import numpy as np
import torch

from specserve.errors import InvalidRequestError

SEED_MIN, SEED_MAX = -(1 << 63), (1 << 63) - 1  # the seeds accepted: a signed 64-bit integer
_MASK64 = (1 << 64) - 1
_MT_WORDS = 624
# torch's CPUGeneratorImplState (aten/src/ATen/CPUGeneratorImpl.cpp): the_initial_seed u64, left i32,
# seeded i32, next u64, state[624] u64 (one 32-bit word each), then the normal-sample caches.
_HEAD = struct.Struct("<QiiQ")
_STATE_OFFSET = _HEAD.size
_STATE_BYTES = 5056

log = logging.getLogger("specserve.engine")


def check_seed(seed) -> int:
    """The seed as an int, or InvalidRequestError naming the range (bool is not a seed)."""
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise InvalidRequestError(f"seed must be an integer, got {seed!r}")
    if not SEED_MIN <= seed <= SEED_MAX:
        raise InvalidRequestError(f"seed must be in [{SEED_MIN}, {SEED_MAX}] (a signed 64-bit integer), got {seed}")
    return seed


def splitmix64(seed: int, n: int) -> np.ndarray:
    """The first `n` outputs of SplitMix64 started at `seed` (mod 2**64), as uint64 (numpy wraps mod 2**64)."""
    return _splitmix64_at(seed, np.arange(n, dtype=np.uint64))


def _splitmix64_at(seed, indices: np.ndarray) -> np.ndarray:
    """Outputs number `indices` (0-based) of SplitMix64 started at `seed` (an int, or uint64 per index):
    any output directly, without running the stream up to it."""
    with np.errstate(over="ignore"):
        start = np.uint64(seed & _MASK64) if isinstance(seed, int) else seed
        x = start + (indices.astype(np.uint64) + np.uint64(1)) * np.uint64(0x9E3779B97F4A7C15)
        z = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


_POSITIONS = 0x5EED0F0A7B17  # keys the position streams apart from the generator states made from a seed


def position_uniforms(seeds: list[int], positions: list[int]) -> np.ndarray:
    """float64 U[0, 1) draws with 53 random bits, one per (seed, output position) pair: draw i is a function
    of seeds[i] and positions[i] alone, so the token a seeded request samples at a position does not depend
    on how many draws came before it (speculation's draft lengths, which change with load)."""
    streams = np.array([(seed ^ _POSITIONS) & _MASK64 for seed in seeds], dtype=np.uint64)
    keys = _splitmix64_at(streams, np.zeros(len(seeds), dtype=np.uint64))
    bits = _splitmix64_at(keys, np.asarray(positions, dtype=np.uint64))
    return (bits >> np.uint64(11)).astype(np.float64) * 2.0 ** -53


def mt19937_words(seed: int) -> np.ndarray:
    """The 624 32-bit words of the mt19937 state for a 64-bit seed (each output gives its low, then high word)."""
    words = splitmix64(seed, _MT_WORDS // 2).view(np.uint32).astype("<u4")  # little-endian: low word first
    if not words[1:].any() and not words[0] >> 31:  # the one degenerate state (never met in practice)
        words[0] = 0x80000000
    return words


def _template() -> bytearray | None:
    """A fresh CPU generator's state, if its layout is the one this module writes; else None."""
    g = torch.Generator().manual_seed(5489)
    state = bytes(g.get_state().tolist())
    expected = [5489]
    for i in range(1, 4):
        expected.append((1812433253 * (expected[-1] ^ (expected[-1] >> 30)) + i) & 0xFFFFFFFF)
    if (len(state) != _STATE_BYTES or _HEAD.unpack_from(state, 0) != (5489, 1, 1, 0)
            or list(struct.unpack_from("<4Q", state, _STATE_OFFSET)) != expected):
        return None
    return bytearray(state)


_TEMPLATE: bytearray | None | bool = False  # False: not computed yet


def _cpu_template() -> bytearray | None:
    global _TEMPLATE
    if _TEMPLATE is False:
        _TEMPLATE = _template()
        if _TEMPLATE is None:
            log.warning("unknown torch CPU generator state layout: 64-bit seeds are folded to 32 bits")
    return _TEMPLATE


def make_generator(seed: int, device: str | torch.device = "cpu") -> torch.Generator:
    """A generator on `device` whose stream is determined by all 64 bits of `seed` (see the module doc)."""
    seed = check_seed(seed)
    gen = torch.Generator(device)
    if gen.device.type != "cpu":
        return gen.manual_seed(seed & _MASK64)
    template = _cpu_template()
    if template is None:  # a torch whose layout we do not know: fold, so high bits still count
        z = int(splitmix64(seed, 1)[0])
        return gen.manual_seed((z ^ (z >> 32)) & 0xFFFFFFFF)
    state = bytearray(template)
    _HEAD.pack_into(state, 0, seed & _MASK64, 1, 1, 0)  # left = 1: the first draw regenerates the block
    state[_STATE_OFFSET:_STATE_OFFSET + 8 * _MT_WORDS] = mt19937_words(seed).astype("<u8").tobytes()
    gen.set_state(torch.frombuffer(state, dtype=torch.uint8).clone())
    return gen
