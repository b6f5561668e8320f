"""Attention over a paged KV cache for a ragged batch.

A step carries any mix of sequences, each contributing `q_len` new tokens (a prefill chunk, one decode
token, or k+1 verify tokens) on top of `ctx_len - q_len` tokens already cached. The new tokens of all
sequences are flattened into one [T, ...] batch for the projections and MLP; attention regroups them.

Sequences are split into groups: long queries (prefill chunks) apart from short ones (decodes,
verifies), so that a 512-token prefill does not pad every decode to 512 queries, and short ones by
context length, so that a 40-token chat does not gather and multiply 2,000 padded keys because it
decodes beside a long document (the keys' memory traffic is what a CPU decode step's attention costs).
Inside a group, queries are padded to the group's longest, keys are gathered from the cache through
each sequence's block table, and attention runs under a causal mask. Index tensors and the mask are
built once per step (`AttentionMetadata.build`) and reused by every layer: that is the only
per-sequence Python work.

On the CPU, short queries (decodes, verifies) go to a C kernel instead (`model/kernels`), which reads
each sequence's keys and values once, straight from the cache, with no gather and no padding; the
groups then hold prefill chunks only. On a CUDA GPU a Triton kernel with the same inputs takes them
(`model/gpu_attention`): one launch per layer, no host work, so that the step can be a CUDA graph. The torch
ops path remains for other devices and dtypes.

Prefill chunks use torch's SDPA (its fused CPU kernel was 2.3x faster than the matmuls for 256-token
chunks). Short queries on the torch path use two matmuls instead: for 1-token decodes of a batch, SDPA
with a mask and grouped-query heads was 2-5x slower (it parallelises poorly over single queries). Folding the query
heads that share a KV head into the query dimension ([G, Hkv, heads_per_kv * Q, D]) makes GQA one
batched matmul without repeating keys. Scores are taken in float32 for the softmax, as the reference does.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from specserve.model import gpu_attention
from specserve.model.kernels import short_attention
from specserve.settings import settings

SHORT_QUERY_MAX = 16  # decodes and verifies (k+1 <= 16) share a group; longer queries are prefill chunks
# With batch invariance on (the default, see `batch_invariant`), the C kernel takes every query, prefill
# chunks too, in pieces of this many tokens.
KERNEL_QUERY_CHUNK = 32
# A further group costs about as much as gathering and multiplying this many padded key blocks per
# sequence (~0.1 ms of per-layer op overhead vs ~4 us per block on the CPU): short queries start a new
# group when joining the current one would pad more blocks than that.
GROUP_OVERHEAD_BLOCKS = 24


def batch_invariant() -> bool:
    """Whether a row's attention must not depend on what else its step carries (SPECSERVE_BATCH_INVARIANT
    not "0"; the default): then the C kernel takes every query, prefill chunks included, so that a prefill
    (a recompute after preemption) rounds exactly as the decodes and verifies of the same tokens did. It
    cost +2% on a 256-token bf16 prefill here against SDPA (docs/cpu-kernels.md). The linear layers'
    side of the setting is `cpu_linear.invariant_linears`."""
    return settings.batch_invariant is not False


@dataclass(slots=True)
class AttentionGroup:
    token_index: torch.Tensor   # [n] flat indices (into the step's T tokens) of this group's tokens
    query_index: torch.Tensor   # [G, Qmax] flat token index of each padded query slot (0 for padding)
    out_index: torch.Tensor     # [n] position of each of the group's tokens in the [G * Qmax] padded output
    block_tables: torch.Tensor  # [G, max_blocks] cache blocks of each sequence (0 for padding)
    query_pos: torch.Tensor     # [G, Qmax] position of each padded query slot (0 for padding)
    is_whole_batch: bool        # the group holds every token in order with Qmax == 1 (pure decode)
    # Made on first use, because they depend on the layer's window (Gemma 3 mixes two) and the model's head
    # counts (target and draft differ), keyed by window (None: causal only):
    masks: dict = field(default_factory=dict)   # [G, 1, Qmax, max_blocks * block_size] True where a query may attend
    biases: dict = field(default_factory=dict)  # [G, 1, heads_per_kv * Qmax, Kmax] float32, 0 or -inf (short queries)
    kv_index: torch.Tensor | None = None  # [G * Hkv * max_blocks] rows of the cache viewed as [blocks * Hkv, ...]

    def mask(self, window: int | None, block_size: int) -> torch.Tensor:
        if window not in self.masks:
            key_pos = torch.arange(self.block_tables.shape[1] * block_size, device=self.query_pos.device)
            mask = key_pos[None, None, :] <= self.query_pos[:, :, None]
            if window is not None:
                mask &= key_pos[None, None, :] > self.query_pos[:, :, None] - window
            self.masks[window] = mask[:, None]
        return self.masks[window]


@dataclass(slots=True)
class ShortQueries:
    """Sequences with short queries, for the C kernel (int32, as it reads them) or the GPU kernel."""
    seqs: torch.Tensor          # [3, S] first query row (into the step's T tokens), q_len, ctx_len
    block_tables: torch.Tensor  # [S, max_blocks] cache blocks of each sequence (0 for padding)
    num_tokens: int             # sum of their q_lens
    qmax: int = KERNEL_QUERY_CHUNK  # the most queries of one sequence (1 for pure decodes)


@dataclass(slots=True)
class AttentionMetadata:
    positions: torch.Tensor     # [T] position of each new token in its sequence
    slot_mapping: torch.Tensor  # [T] flat cache slot (block * block_size + offset) each new token writes
    groups: list[AttentionGroup]
    short: ShortQueries | None = None  # set when the C kernel takes the short queries (not in `groups`)
    write_index: torch.Tensor | None = None  # [T * Hkv] rows the new keys/values go to (made on first use)

    @classmethod
    def build(cls, q_lens: list[int], ctx_lens: list[int], block_tables: list[list[int]],
              block_size: int, device: torch.device | str = "cpu", short_kernel: bool = False) -> "AttentionMetadata":
        """q_lens[i] new tokens of sequence i end at position ctx_lens[i] - 1; block_tables[i] holds
        at least ceil(ctx_lens[i] / block_size) blocks. `short_kernel`: short queries go to the C kernel
        (`kernels.short_attention_supported` says when it can run)."""
        positions, slots, starts = [], [], []
        start = 0
        for q, c, table in zip(q_lens, ctx_lens, block_tables):
            if q <= 0 or c < q or len(table) * block_size < c:
                raise ValueError(f"bad sequence shape q_len={q} ctx_len={c} blocks={len(table)}")
            pos = range(c - q, c)
            positions.extend(pos)
            slots.extend(table[p // block_size] * block_size + p % block_size for p in pos)
            starts.append(start)
            start += q
        to_kernel = [short_kernel and (q <= SHORT_QUERY_MAX or batch_invariant()) for q in q_lens]
        short = [i for i, k in enumerate(to_kernel) if k or q_lens[i] <= SHORT_QUERY_MAX]
        long = [i for i, k in enumerate(to_kernel) if not k and q_lens[i] > SHORT_QUERY_MAX]
        used_blocks = [(c + block_size - 1) // block_size for c in ctx_lens]
        short_queries = None
        if short_kernel and short:
            # A long query goes to the kernel in pieces of KERNEL_QUERY_CHUNK tokens, each as if it were a
            # sequence ending at its last token: a piece reads only the keys its rows may see, and the
            # pieces spread over the threads. A row's arithmetic is the same in any piece (kernel comment).
            pieces = []  # (first row, rows, context up to its last row, sequence)
            for i in short:
                for a in range(0, q_lens[i], KERNEL_QUERY_CHUNK):
                    n = min(KERNEL_QUERY_CHUNK, q_lens[i] - a)
                    pieces.append((starts[i] + a, n, ctx_lens[i] - q_lens[i] + a + n, i))
            blocks = [-(-c // block_size) for _, _, c, _ in pieces]
            width = max(blocks)
            short_queries = ShortQueries(
                torch.tensor([[p[j] for p in pieces] for j in range(3)], dtype=torch.int32, device=device),
                torch.tensor([list(block_tables[p[3]][:n]) + [0] * (width - n) for p, n in zip(pieces, blocks)],
                             dtype=torch.int32, device=device),
                sum(q_lens[i] for i in short), max(p[1] for p in pieces))
            short = []
        groups = [_build_group(members, q_lens, ctx_lens, used_blocks, block_tables, starts, block_size,
                               start, device)
                  for members in _split_by_context(short, used_blocks) + _split_by_context(long, used_blocks)]
        as_tensor = lambda x: torch.tensor(x, dtype=torch.long, device=device)  # noqa: E731
        return cls(as_tensor(positions), as_tensor(slots), groups, short_queries)


def _split_by_context(members: list[int], used_blocks: list[int]) -> list[list[int]]:
    """Partition sequences (by ascending context) so that padding every member of a group to its
    longest costs less than running another group (greedy, one pass)."""
    groups: list[list[int]] = []
    for i in sorted(members, key=lambda i: used_blocks[i]):
        if groups and len(groups[-1]) * (used_blocks[i] - used_blocks[groups[-1][-1]]) <= GROUP_OVERHEAD_BLOCKS:
            groups[-1].append(i)
        else:
            groups.append([i])
    return [sorted(g) for g in groups]  # batch order inside a group: one group of all is the whole batch


def _build_group(members, q_lens, ctx_lens, used_blocks, block_tables, starts, block_size, total_tokens,
                 device) -> AttentionGroup:
    qmax = max(q_lens[i] for i in members)
    nblocks = max(used_blocks[i] for i in members)
    token_index, query_index, out_index, q_pos, tables = [], [], [], [], []
    for g, i in enumerate(members):
        q, c, s = q_lens[i], ctx_lens[i], starts[i]
        token_index.extend(range(s, s + q))
        out_index.extend(range(g * qmax, g * qmax + q))
        query_index.append(list(range(s, s + q)) + [0] * (qmax - q))
        # Padding queries get position 0: they attend to key 0 only (no all-masked rows, no NaN).
        q_pos.append(list(range(c - q, c)) + [0] * (qmax - q))
        tables.append(list(block_tables[i][:used_blocks[i]]) + [0] * (nblocks - used_blocks[i]))
    t = lambda x: torch.tensor(x, dtype=torch.long, device=device)  # noqa: E731
    whole = qmax == 1 and token_index == list(range(total_tokens))
    return AttentionGroup(t(token_index), t(query_index), t(out_index), t(tables), t(q_pos), whole)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                    window: int | None = None) -> torch.Tensor:
    """q: [T, H, D]; k, v: [T, Hkv, D] for the new tokens; k_cache, v_cache: [num_blocks, Hkv, block_size,
    D], updated in place with the new keys/values (k, v None: already written, `gpu_fused.rope_and_cache`);
    window: the layer's sliding window (a query sees the `window` latest positions, itself included).
    Returns [T, H * D].

    The cache keeps each (block, KV head) as one contiguous [block_size, D] row, so that one gather
    yields keys already laid out [G, Hkv, Kmax, D] for the matmul, with no transposing copy."""
    num_tokens, num_heads, head_dim = q.shape
    num_blocks, num_kv_heads, block_size, _ = k_cache.shape
    per_kv = num_heads // num_kv_heads
    if k is not None:
        if meta.write_index is None:
            block, offset = meta.slot_mapping // block_size, meta.slot_mapping % block_size
            heads = torch.arange(num_kv_heads, device=q.device)
            meta.write_index = ((block[:, None] * num_kv_heads + heads) * block_size + offset[:, None]).flatten()
        k_cache.view(-1, head_dim).index_copy_(0, meta.write_index, k.reshape(-1, head_dim))
        v_cache.view(-1, head_dim).index_copy_(0, meta.write_index, v.reshape(-1, head_dim))
    out = q.new_empty(num_tokens, num_heads * head_dim)
    if meta.short is not None:
        short = meta.short
        if q.device.type == "cuda":
            gpu_attention.short_attention(q, k_cache, v_cache, out, short.seqs, short.block_tables, scale,
                                          window, short.qmax)
        else:
            short_attention(q, k_cache, v_cache, out, short.seqs, short.block_tables, scale, window)
        if short.num_tokens == num_tokens:
            return out
    for group in meta.groups:
        num_seqs, qmax = group.query_index.shape
        if group.kv_index is None:
            heads = torch.arange(num_kv_heads, device=q.device)
            group.kv_index = (group.block_tables[:, None, :] * num_kv_heads + heads[None, :, None]).flatten()
        mask = group.mask(window, block_size)
        kmax = mask.shape[-1]  # max_blocks * block_size
        if qmax <= SHORT_QUERY_MAX and window not in group.biases:
            allowed = mask[:, :, None].expand(num_seqs, 1, per_kv, qmax, kmax)
            group.biases[window] = torch.zeros(allowed.shape, dtype=torch.float32, device=q.device).masked_fill_(
                ~allowed, float("-inf")).view(num_seqs, 1, per_kv * qmax, kmax)
        # index_select, not advanced indexing: on the CPU it gathers these rows ~6x faster.
        keys = k_cache.view(num_blocks * num_kv_heads, block_size * head_dim).index_select(
            0, group.kv_index).view(num_seqs, num_kv_heads, kmax, head_dim)  # [G, Hkv, Kmax, D]
        values = v_cache.view(num_blocks * num_kv_heads, block_size * head_dim).index_select(
            0, group.kv_index).view(num_seqs, num_kv_heads, kmax, head_dim)
        queries = q.index_select(0, group.query_index.flatten()).view(num_seqs, qmax, num_heads, head_dim)
        if qmax > SHORT_QUERY_MAX:
            # Prefill chunks: SDPA's fused kernel (no [G, H, Qmax, Kmax] float32 scores in memory).
            o = F.scaled_dot_product_attention(queries.transpose(1, 2), keys, values, attn_mask=mask,
                                               scale=scale, enable_gqa=per_kv > 1)  # [G, H, Qmax, D]
            o = o.transpose(1, 2).reshape(num_seqs * qmax, num_heads * head_dim)
        else:
            # [G, Qmax, H, D] -> [G, Hkv, per_kv * Qmax, D]: query head h uses KV head h // per_kv
            queries = queries.view(num_seqs, qmax, num_kv_heads, per_kv, head_dim).permute(0, 2, 3, 1, 4)
            queries = queries.reshape(num_seqs, num_kv_heads, per_kv * qmax, head_dim)
            scores = torch.matmul(queries, keys.transpose(-1, -2)).float().mul_(scale).add_(group.biases[window])
            o = torch.matmul(torch.softmax(scores, dim=-1).to(values.dtype), values)  # [G, Hkv, per_kv*Qmax, D]
            o = o.view(num_seqs, num_kv_heads, per_kv, qmax, head_dim).permute(0, 3, 1, 2, 4)
            o = o.reshape(num_seqs * qmax, num_heads * head_dim)  # [G * Qmax, H * D]
        if group.is_whole_batch:
            return o
        out.index_copy_(0, group.token_index, o[group.out_index])
    return out


def allocate_kv_cache(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int,
                      head_dim: int, dtype: torch.dtype, device="cpu") -> torch.Tensor:
    """[num_layers, 2 (k, v), num_blocks, Hkv, block_size, D]. Zero-filled: masked-out keys are still
    multiplied by zero attention weights, and 0 * NaN from uninitialised memory would poison outputs."""
    return torch.zeros(num_layers, 2, num_blocks, num_kv_heads, block_size, head_dim, dtype=dtype,
                       device=device)
