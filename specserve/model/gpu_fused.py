"""The decoder layer's small ops fused into three Triton kernels on a GPU: RMSNorm, rope + KV-cache write, SwiGLU.

Why: inside a CUDA graph a step costs what its kernels cost, and the GPU runs a tiny kernel no faster than
~2-3 us. A 135M model's layer was ~30 kernels (RMSNorm's reductions and casts, rope's ~10 slices, multiplies
and a concatenation, the cache write's index arithmetic and two copies, SiLU then a multiply, two residual
adds): ~900 a step, most of a batch-1 step's GPU time (issue 64's profile). With these three kernels and the
residual adds folded into the output projections' GEMMs (`addmm_`, beta = 1), a layer is 9 kernels: norm,
QKV GEMM, rope + cache write, attention, O GEMM + add, norm, gate/up GEMM, SwiGLU, down GEMM + add.

Each kernel's arithmetic is per row (per token), in float32, rounding where the torch ops it replaces round:
a row's result never depends on the other rows of the step, so verify rows round as the decodes of the same
tokens do (greedy identity with and without speculation). `SPECSERVE_GPU_FUSED=0` keeps the torch ops.
The tests run these kernels on the CPU under Triton's interpreter against the torch ops they replace.
"""
from __future__ import annotations

import torch

from specserve.model.gpu_attention import triton
from specserve.settings import settings

if triton is not None:
    import triton.language as tl


def supported(x: torch.Tensor, head_dim: int | None = None) -> bool:
    """Whether the layer of input `x` takes the fused kernels: a CUDA tensor, Triton installed, inference
    (no autograd: the residual stream is updated in place), not switched off; with `head_dim`, also rope's
    (a power of two: Triton's tiles). The tests also call the kernels on the CPU under Triton's interpreter."""
    return (triton is not None and x.device.type == "cuda" and not torch.is_grad_enabled()
            and settings.gpu_fused
            and (head_dim is None or (head_dim >= 2 and head_dim & (head_dim - 1) == 0)))


if triton is not None:
    @triton.jit
    def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, stride_out, n, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        inside = cols < n
        x = tl.load(x_ptr + row * stride_x + cols, mask=inside, other=0.0).to(tl.float32)
        normed = x * tl.rsqrt(tl.sum(x * x, 0) / n + eps)
        dtype = out_ptr.dtype.element_ty
        w = tl.load(w_ptr + cols, mask=inside, other=0.0).to(tl.float32)
        # normalised, rounded to the input's dtype, then scaled and rounded again: weight * F.rms_norm(x)
        tl.store(out_ptr + row * stride_out + cols, (normed.to(dtype).to(tl.float32) * w).to(dtype), mask=inside)

    @triton.jit
    def _rope_cache_kernel(qkv_ptr, cos_ptr, sin_ptr, slots_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
                           stride_qkv, stride_cos, stride_sin, stride_cb, stride_ch, stride_cs,
                           HEADS: tl.constexpr, BLOCK_SIZE: tl.constexpr, HALF: tl.constexpr):
        token = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)  # query heads, then KV heads (key rotated and value copied by one program)
        d = tl.arange(0, HALF)
        row = qkv_ptr + token * stride_qkv + head * 2 * HALF
        x1 = tl.load(row + d).to(tl.float32)
        x2 = tl.load(row + HALF + d).to(tl.float32)
        cos = tl.load(cos_ptr + token * stride_cos + d)
        sin = tl.load(sin_ptr + token * stride_sin + d)
        dtype = q_ptr.dtype.element_ty
        r1 = (x1 * cos - x2 * sin).to(dtype)
        r2 = (x2 * cos + x1 * sin).to(dtype)
        if head < HEADS:
            out = q_ptr + (token * HEADS + head) * 2 * HALF
            tl.store(out + d, r1)
            tl.store(out + HALF + d, r2)
        else:
            kv_head = head - HEADS
            slot = tl.load(slots_ptr + token)
            at = (slot // BLOCK_SIZE) * stride_cb + kv_head * stride_ch + (slot % BLOCK_SIZE) * stride_cs
            tl.store(k_cache_ptr + at + d, r1)
            tl.store(k_cache_ptr + at + HALF + d, r2)
            num_kv = tl.num_programs(1) - HEADS
            value = qkv_ptr + token * stride_qkv + (HEADS + num_kv + kv_head) * 2 * HALF
            tl.store(v_cache_ptr + at + d, tl.load(value + d))
            tl.store(v_cache_ptr + at + HALF + d, tl.load(value + HALF + d))

    @triton.jit
    def _swiglu_kernel(gate_up_ptr, out_ptr, stride_in, stride_out, n, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        inside = cols < n
        gate = tl.load(gate_up_ptr + row * stride_in + cols, mask=inside, other=0.0).to(tl.float32)
        up = tl.load(gate_up_ptr + row * stride_in + n + cols, mask=inside, other=0.0).to(tl.float32)
        dtype = out_ptr.dtype.element_ty
        silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)  # F.silu(gate) rounds, then * up
        tl.store(out_ptr + row * stride_out + cols, (silu * up).to(dtype), mask=inside)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight * rms_norm(x) over the last dim: x [T, n] (unit stride in n) -> new [T, n] of x's dtype."""
    n = x.shape[-1]
    x2 = x.reshape(-1, n)
    assert x2.stride(1) == 1
    out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
    block = triton.next_power_of_2(n)
    _rms_norm_kernel[(x2.shape[0],)](x2, weight, out, x2.stride(0), out.stride(0), n, eps, BLOCK=block,
                                     num_warps=4 if block <= 2048 else 8)
    return out.view(x.shape)


def rope_and_cache(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, slots: torch.Tensor,
                   k_cache: torch.Tensor, v_cache: torch.Tensor, num_heads: int, num_kv_heads: int) -> torch.Tensor:
    """Rotates queries and keys (rotate-half layout), writes each token's key and value into the paged cache at
    its slot, returns the rotated queries. qkv: [T, (H + 2 Hkv) * D], unit stride along a row (the fused
    projection's output); cos, sin: [T, ..., D / 2] float32, unit stride along the last dim; slots: [T]
    integer (block * block_size + offset); k_cache, v_cache: [num_blocks, Hkv, block_size, D], contiguous.
    Returns q: [T, H, D]."""
    num_tokens = qkv.shape[0]
    num_blocks, _, block_size, head_dim = k_cache.shape
    assert qkv.stride(1) == 1 and qkv.shape[1] == (num_heads + 2 * num_kv_heads) * head_dim
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and cos.stride(-1) == 1 and sin.stride(-1) == 1
    q = torch.empty(num_tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if num_tokens:
        _rope_cache_kernel[(num_tokens, num_heads + num_kv_heads)](
            qkv, cos, sin, slots, q, k_cache, v_cache, qkv.stride(0), cos.stride(0), sin.stride(0),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), HEADS=num_heads, BLOCK_SIZE=block_size,
            HALF=head_dim // 2, num_warps=1)
    return q


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up from the fused projection's output [T, 2 I] (gate first) -> [T, I]."""
    num_tokens, width = gate_up.shape
    n = width // 2
    assert gate_up.stride(1) == 1
    out = torch.empty(num_tokens, n, dtype=gate_up.dtype, device=gate_up.device)
    block = min(1024, triton.next_power_of_2(n))
    if num_tokens:
        _swiglu_kernel[(num_tokens, triton.cdiv(n, block))](gate_up, out, gate_up.stride(0), out.stride(0), n,
                                                           BLOCK=block, num_warps=4)
    return out
