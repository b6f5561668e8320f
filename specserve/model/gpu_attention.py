"""Paged attention for short queries on a GPU: one Triton kernel per layer, reading K/V through the block tables.

The GPU counterpart of the CPU's C kernel (`kernels.short_attention`), with the same inputs: each sequence's
first query row, query count and context length (`seqs` [3, S]) and its block table. No gather, no padding to
the longest context, no mask tensor, no host work: the kernel reads each sequence's keys and values once, in
tiles of KEYS positions, straight from the cache, so it can be captured in a CUDA graph (`cuda_graphs.py`) and
replayed with new contents in the same buffers.

One program per (sequence, KV head) holds all the query heads that share that KV head, for every query of the
sequence: ROWS = QMAX * heads_per_kv rows, row r being query r // heads_per_kv of head r % heads_per_kv. Keys
and values are loaded once for them all (grouped-query attention without repeating keys). Softmax is online
(running max and sum in float32), so a row's arithmetic does not depend on the other rows of its program or on
the batch: a verify row rounds as the decode of the same token does. QMAX, the queries a program holds, is 1
for steps of pure decodes (a 16-row tensor-core tile, mostly the query heads), 8 for verifies of up to 7
drafts, 32 otherwise (32-token prefill pieces, see `attention.KERNEL_QUERY_CHUNK`): each step's longest query
picks one of the three compiled variants.

A long context is read by one program's loop (no split over the keys): fine for the contexts this kernel was
measured on (bench/gpu.py: up to ~400 tokens); a split-K variant would be the next step for long documents.
"""
from __future__ import annotations

import torch

from specserve.settings import settings

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU wheel of torch comes without Triton: the C kernel serves the CPU
    triton = None

KEYS = 64  # key positions per tile
QMAX_VARIANTS = (1, 8, 32)  # queries per sequence a compiled variant holds


def supported(dtype: torch.dtype, device: torch.device, head_dim: int) -> bool:
    """Whether the engine sends short queries to `short_attention`: on a CUDA device with Triton, for head
    sizes a tile can hold (SPECSERVE_GPU_ATTENTION=torch keeps the torch ops path). The tests also run the
    kernel on the CPU under Triton's interpreter (TRITON_INTERPRET=1)."""
    if triton is None or settings.gpu_attention == "torch":
        return False
    return device.type == "cuda" and dtype in (torch.float32, torch.bfloat16, torch.float16) and \
        16 <= head_dim <= 256 and head_dim & (head_dim - 1) == 0


if triton is not None:
    @triton.jit
    def _short_attention_kernel(q_ptr, k_ptr, v_ptr, out_ptr, seqs_ptr, tables_ptr, scale, window,
                                num_seqs, stride_qt, stride_qh, stride_cb, stride_ch, stride_cs, stride_ot,
                                stride_tb, PER_KV: tl.constexpr, QMAX: tl.constexpr, ROWS: tl.constexpr,
                                BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, KEYS: tl.constexpr,
                                WINDOW: tl.constexpr, PRECISION: tl.constexpr):
        s = tl.program_id(0)
        kv_head = tl.program_id(1)
        first = tl.load(seqs_ptr + s).to(tl.int64)
        q_len = tl.load(seqs_ptr + num_seqs + s)
        ctx = tl.load(seqs_ptr + 2 * num_seqs + s)
        r = tl.arange(0, ROWS)
        query = r // PER_KV
        head = kv_head * PER_KV + r % PER_KV
        live = (query < q_len) & (r < QMAX * PER_KV)
        d = tl.arange(0, HEAD_DIM)
        q_rows = (first + query) * stride_qt + head * stride_qh  # [ROWS]
        q = tl.load(q_ptr + q_rows[:, None] + d[None, :], mask=live[:, None], other=0.0)
        q_pos = ctx - q_len + query  # [ROWS] position of each row's query
        m = tl.full([ROWS], float("-inf"), tl.float32)
        total = tl.zeros([ROWS], tl.float32)
        acc = tl.zeros([ROWS, HEAD_DIM], tl.float32)
        lo = 0
        if WINDOW:
            lo = tl.maximum(ctx - q_len + 1 - window, 0) // KEYS * KEYS
        for start in range(lo, ctx, KEYS):
            pos = start + tl.arange(0, KEYS)
            in_ctx = pos < ctx
            block = tl.load(tables_ptr + s * stride_tb + pos // BLOCK_SIZE, mask=in_ctx, other=0).to(tl.int64)
            kv_rows = block * stride_cb + kv_head * stride_ch + (pos % BLOCK_SIZE) * stride_cs  # [KEYS]
            k = tl.load(k_ptr + kv_rows[:, None] + d[None, :], mask=in_ctx[:, None], other=0.0)
            v = tl.load(v_ptr + kv_rows[:, None] + d[None, :], mask=in_ctx[:, None], other=0.0)
            scores = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
            allowed = (pos[None, :] <= q_pos[:, None]) & in_ctx[None, :]
            if WINDOW:
                allowed = allowed & (pos[None, :] > q_pos[:, None] - window)
            scores = tl.where(allowed, scores, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, 1))
            base = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that saw no key yet: no NaN
            p = tl.exp(scores - base[:, None])
            alpha = tl.exp(m - base)
            total = total * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
            m = m_new
        out = acc / tl.where(total == 0.0, 1.0, total)[:, None]
        out_rows = (first + query) * stride_ot + head * HEAD_DIM
        tl.store(out_ptr + out_rows[:, None] + d[None, :], out.to(out_ptr.dtype.element_ty), mask=live[:, None])


def short_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                    seqs: torch.Tensor, block_tables: torch.Tensor, scale: float, sliding_window: int | None,
                    qmax: int) -> None:
    """Writes the attention output of every listed sequence's query rows into `out` (rows of other tokens are
    left as they are). q: [T, H, D] (stride(2) == 1); k_cache, v_cache: [num_blocks, Hkv, block_size, D];
    out: [T, H * D] contiguous; seqs: [3, S] integer (first query row, query count, context length incl. the
    queries; a padding sequence has 0 queries); block_tables: [S, max_blocks] integer; qmax: the most queries
    any sequence has (at most 32)."""
    num_blocks, num_kv_heads, block_size, head_dim = k_cache.shape
    assert q.stride(2) == 1 and out.is_contiguous() and k_cache.is_contiguous() and v_cache.is_contiguous()
    assert seqs.is_contiguous() and block_tables.is_contiguous() and qmax <= 32
    per_kv = q.shape[1] // num_kv_heads
    rows_max = next(n for n in QMAX_VARIANTS if n >= qmax)
    rows = max(16, triton.next_power_of_2(rows_max * per_kv))
    num_seqs = seqs.shape[1]
    _short_attention_kernel[(num_seqs, num_kv_heads)](
        q, k_cache, v_cache, out, seqs, block_tables, scale, sliding_window or 0, num_seqs,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), out.stride(0),
        block_tables.stride(0), PER_KV=per_kv, QMAX=rows_max, ROWS=rows, BLOCK_SIZE=block_size,
        HEAD_DIM=head_dim, KEYS=KEYS, WINDOW=bool(sliding_window),
        # float32 models: exact float32 products, as the reference computes (Triton's default is TF32)
        PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=4 if rows <= 64 else 8)
