"""All decoder layers of a step in one call into the C kernels (`kernels/decoder.c`), on the CPU.

Why: DecoderLayer.forward costs ~10 torch ops and Python wrappers per layer whatever the work: on a
30-layer model with tiny matrices (so that only this overhead is left) a 1-row forward took 8.4 ms of
CPU on this machine, more than a third of a whole SmolLM2 Q4_1 decode (24 ms with this path). Here the
layers' arguments are prepared once per model, buffers allocated once per forward (none per layer), the
residual add fused into the o and down projections, and all layers run in one ctypes call: 0.7 ms.
The arithmetic is exactly that of DecoderLayer.forward on the same kernels (RMSNorm, rope, the cache
write, attention, KernelLinear), so both give the same bits (tests/model/test_batch_invariance.py).
"""
from __future__ import annotations

import ctypes

import torch

from specserve.model import kernels
from specserve.model.cpu_linear import SMALL_ROWS, KernelLinear, StackedKernelLinear


def can_run(model, x: torch.Tensor, kv_cache: torch.Tensor, meta) -> bool:
    """All of a step's tokens in the attention kernel, every projection a KernelLinear (gate/up
    interleaved) that takes this many rows itself, CPU tensors of one kernel dtype, nothing for
    autograd or the profiler to record."""
    if not (x.is_cpu and x.dtype in kernels.DTYPES and kv_cache.dtype == x.dtype and kv_cache.is_cpu
            and x.is_contiguous() and kv_cache.is_contiguous() and meta.short is not None
            and meta.short.num_tokens == x.shape[0] and not torch.is_grad_enabled()
            and not torch.autograd._profiler_enabled() and kernels.available()):
        return False
    # Every layer's, not only the first's: a GGUF file may leave some layers' matrices dense (a fused group
    # of mixed formats). ~120 isinstance checks, a few microseconds a step.
    linears = [m for layer in model.layers
               for m in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)]
    return (all(isinstance(m, (KernelLinear, StackedKernelLinear)) for m in linears)
            and all(layer.gate_up_proj.interleaved for layer in model.layers)
            and (x.shape[0] <= SMALL_ROWS or all(m.large is None for m in linears)))


class LinearArgs(ctypes.Structure):  # kernels/decoder.c's LinearArgs
    _fields_ = [("w", ctypes.c_void_p), ("row_bytes", ctypes.c_int64), ("bias", ctypes.c_void_p),
                ("fmt", ctypes.c_int32), ("n", ctypes.c_int32), ("k", ctypes.c_int32), ("kp", ctypes.c_int32),
                ("next", ctypes.c_void_p)]


class LayerArgs(ctypes.Structure):  # kernels/decoder.c's LayerArgs
    _fields_ = [("norm1", ctypes.c_void_p), ("norm2", ctypes.c_void_p), ("eps1", ctypes.c_float),
                ("eps2", ctypes.c_float), ("scale", ctypes.c_float), ("qkv", LinearArgs), ("o", LinearArgs),
                ("gate_up", LinearArgs), ("down", LinearArgs)]


def run_layers(model, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
               meta) -> torch.Tensor:
    """x [T, hidden] (updated in place) through every decoder layer; cos, sin [T, 1, D/2] float32 views
    with unit inner stride; kv_cache [layers, 2, num_blocks, Hkv, block_size, D]. Returns x."""
    first = model.layers[0]
    T, hidden = x.shape
    H, Hkv, D = first.num_heads, first.num_kv_heads, first.head_dim
    inter = first.gate_up_proj.out_features // 2
    # The per-forward buffers, reused by every layer.
    h, qkv = x.new_empty(T, hidden), x.new_empty(T, (H + 2 * Hkv) * D)
    qk, attn, act = x.new_empty(T, H + Hkv, D), x.new_empty(T, H * D), x.new_empty(T, inter)
    short = meta.short
    layers = _plan(model)
    status = kernels.function("decoder_layers", x.dtype)(
        ctypes.addressof(layers), len(layers), x.data_ptr(), T, hidden, h.data_ptr(), qkv.data_ptr(),
        qk.data_ptr(), attn.data_ptr(), act.data_ptr(), H, Hkv, D, inter, cos.data_ptr(), sin.data_ptr(),
        cos.stride(0), kv_cache.data_ptr(), kv_cache[0, 0].numel() * x.element_size(), meta.slot_mapping.data_ptr(),
        kv_cache.shape[4], short.seqs.data_ptr(), short.seqs.shape[1], short.block_tables.data_ptr(),
        short.block_tables.shape[1], meta.sliding_window or 0, torch.get_num_threads())
    if status:
        raise MemoryError("CPU kernels: out of memory for their scratch buffers")
    return x


def _linear_args(m: KernelLinear | StackedKernelLinear, keep: list) -> LinearArgs:
    """m's kernel arguments; a stacked projection's later parts chained by `next` (held alive in `keep`)."""
    parts = list(m.parts) if isinstance(m, StackedKernelLinear) else [m]
    following = None
    for part in reversed(parts):
        w, fmt, row_bytes, n, k, kp = part.c_args
        args = LinearArgs(w, row_bytes, part.bias_ptr, fmt, n, k, kp, following)
        keep.append(args)
        following = ctypes.addressof(args)
    return args


def _plan(model) -> ctypes.Array:
    """Each layer's constant kernel arguments (weight pointers, eps, scale), made on first use and kept
    with the model; remade when the first layer's modules or norm weights change (they point into them)."""
    first = model.layers[0]
    key = (id(first.qkv_proj), id(first.o_proj), id(first.gate_up_proj), id(first.down_proj),
           first.input_layernorm.weight.data_ptr(), first.post_attention_layernorm.weight.data_ptr(),
           len(model.layers))
    cached = getattr(model, "_cpu_forward_plan", None)
    if cached is not None and cached[0] == key:
        return cached[1]
    plan, keep = (LayerArgs * len(model.layers))(), []
    for i, layer in enumerate(model.layers):
        n1, n2 = layer.input_layernorm, layer.post_attention_layernorm
        plan[i] = LayerArgs(n1.weight.data_ptr(), n2.weight.data_ptr(), n1.eps, n2.eps, layer.scale,
                            *(_linear_args(m, keep) for m in (layer.qkv_proj, layer.o_proj, layer.gate_up_proj,
                                                              layer.down_proj)))
    model._cpu_forward_plan = (key, plan, keep)
    return plan
