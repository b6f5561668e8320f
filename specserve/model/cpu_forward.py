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
from dataclasses import dataclass

import torch

from specserve.model import kernels
from specserve.model.cpu_linear import SMALL_ROWS, KernelLinear, StackedKernelLinear

PROJECTIONS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def can_run(model, x: torch.Tensor, kv_cache: torch.Tensor, meta) -> bool:
    """All of a step's tokens in the attention kernel, every projection a KernelLinear (gate/up
    interleaved) that takes this many rows itself, CPU tensors of one kernel dtype, nothing for
    autograd or the profiler to record."""
    if not (x.is_cpu and x.dtype in kernels.DTYPES and kv_cache.dtype == x.dtype and kv_cache.is_cpu
            and x.is_contiguous() and kv_cache.is_contiguous() and meta.short is not None
            and meta.short.num_tokens == x.shape[0] and not torch.is_grad_enabled()
            and not torch.autograd._profiler_enabled() and kernels.available()):
        return False
    entry = _entry(model)
    return entry.plan is not None and (x.shape[0] <= SMALL_ROWS or not entry.has_large)


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
    with unit inner stride; kv_cache [layers, 2, num_blocks, Hkv, block_size, D]. Returns x. Call it where
    can_run said yes."""
    first = model.layers[0]
    T, hidden = x.shape
    H, Hkv, D = first.num_heads, first.num_kv_heads, first.head_dim
    inter = first.gate_up_proj.out_features // 2
    # The per-forward buffers, reused by every layer.
    h, qkv = x.new_empty(T, hidden), x.new_empty(T, (H + 2 * Hkv) * D)
    qk, attn, act = x.new_empty(T, H + Hkv, D), x.new_empty(T, H * D), x.new_empty(T, inter)
    short = meta.short
    # The entry can_run refreshed for this model in this forward (made here if it was skipped).
    layers = (model.__dict__.get("_cpu_forward") or _entry(model)).plan
    status = kernels.function("decoder_layers", x.dtype)(
        ctypes.addressof(layers), len(layers), x.data_ptr(), T, hidden, h.data_ptr(), qkv.data_ptr(),
        qk.data_ptr(), attn.data_ptr(), act.data_ptr(), H, Hkv, D, inter, cos.data_ptr(), sin.data_ptr(),
        cos.stride(0), kv_cache.data_ptr(), kv_cache[0, 0].numel() * x.element_size(), meta.slot_mapping.data_ptr(),
        kv_cache.shape[4], short.seqs.data_ptr(), short.seqs.shape[1], short.block_tables.data_ptr(),
        short.block_tables.shape[1], first.sliding_window or 0, torch.get_num_threads())
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


@dataclass(slots=True)
class _Entry:
    """What the one-call forward knows of a model, kept with it: `plan` None where some layer's projection
    is not on the kernels (a GGUF file may leave matrices dense: any layer's, not only the first's), or some
    layer is not a plain Llama layer (q/k norms, sandwich norms, GeGLU, a mixture of experts: they run layer
    by layer), or the layers' windows differ (the kernel takes one)."""
    key: tuple
    plan: ctypes.Array | None
    has_large: bool  # some projection hands inputs of more than SMALL_ROWS rows to oneDNN
    keep: list  # the stacked projections' chained LinearArgs, which `plan` points to


def _entry(model) -> _Entry:
    """The model's entry, remade when any layer's projection module or the first layer's norm weights change
    (the plan points into them). The key is module identities read through `_modules`, which skips
    nn.Module's attribute lookup: the check runs every step, for every layer."""
    layers = list(model.layers._modules.values())
    key = (tuple(id(layer._modules.get(name)) for layer in layers for name in PROJECTIONS),
           layers[0].input_layernorm.weight.data_ptr(), layers[0].post_attention_layernorm.weight.data_ptr())
    cached = model.__dict__.get("_cpu_forward")
    if cached is not None and cached.key == key:
        return cached
    linears = [layer._modules.get(name) for layer in layers for name in PROJECTIONS]
    on_kernels = (all(layer.plain and layer.sliding_window == layers[0].sliding_window for layer in layers)
                  and all(isinstance(m, (KernelLinear, StackedKernelLinear)) for m in linears)
                  and all(layer.gate_up_proj.interleaved for layer in layers))
    keep = []
    entry = _Entry(key, _plan(layers, keep) if on_kernels else None,
                   on_kernels and any(m.large is not None for m in linears), keep)
    model._cpu_forward = entry
    return entry


def _plan(layers: list, keep: list) -> ctypes.Array:
    """Each layer's constant kernel arguments (weight pointers, eps, scale)."""
    plan = (LayerArgs * len(layers))()
    for i, layer in enumerate(layers):
        n1, n2 = layer.input_layernorm, layer.post_attention_layernorm
        plan[i] = LayerArgs(n1.weight.data_ptr(), n2.weight.data_ptr(), n1.eps, n2.eps, layer.scale,
                            *(_linear_args(getattr(layer, name), keep) for name in PROJECTIONS))
    return plan
