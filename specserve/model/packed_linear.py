"""Linear layers with weights pre-packed for oneDNN, for inference on the CPU.

`F.linear` on a plain [out, in] weight leaves oneDNN to prepare the weight for its kernels on every
call. Packing it once at load time (the same op torch.compile's CPU backend uses when it freezes
weights) removes that per-call work; in `bench/engine_throughput.py` it took specserve from 171.9 to
233.3 output tok/s (one run when packing was added). bf16 outputs are bit-identical to `F.linear`'s; float32 outputs differ
in accumulation order only (tests/model/test_packed_linear.py).
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from specserve.model.cpu_linear import KernelLinear

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)
# oneDNN picks a slower kernel for 1-2 input rows than for 3, and these shapes are memory-bound, so padding
# rows cost almost nothing; the logits stay bit-identical (`python bench/forward_cost.py --compare-unpadded`).
MIN_ROWS = 3


def can_pack(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype in PACKABLE_DTYPES
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
            and _cpu_packs(weight.dtype))


@functools.cache
def _cpu_packs(dtype: torch.dtype) -> bool:
    """oneDNN's bf16 packing needs AVX-512 (bw/vl/dq) or AVX-NE-CONVERT: ask it once per dtype."""
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(8, 8, dtype=dtype), 1)
        return True
    except RuntimeError:
        return False


class PackedLinear(nn.Module):
    """Inference-only replacement of an nn.Linear (no autograd through the packed weight)."""

    min_rows = MIN_ROWS  # a class attribute, so bench/forward_cost.py can compare against 1 (no padding)

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # The second argument is a batch-size hint for the blocking; the packed weight serves any row count.
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 1)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [..., in_features] -> [..., out_features]; a 2-D x of fewer than min_rows rows is padded."""
        rows = x.shape[0]
        if x.dim() == 2 and rows < self.min_rows:
            padded = torch.cat([x, x.new_zeros(self.min_rows - rows, x.shape[1])])
            return torch.ops.mkldnn._linear_pointwise(padded, self.packed, self.bias, "none", [], "")[:rows]
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def pack_linears(model: nn.Module) -> int:
    """Replace every nn.Linear of `model` (in place) for inference: by a KernelLinear (our C kernel,
    `cpu_linear.py`) where it can run, else by a PackedLinear where oneDNN supports it. A decoder layer's
    gate/up projection keeps its rows interleaved so that the kernel returns silu(gate) * up directly.
    Where `cpu_linear.invariant_linears` says so (float32 weights by default), a KernelLinear also keeps
    a PackedLinear for inputs of more than 16 rows where oneDNN packs the dtype.
    A mixture of experts' stacked experts become one KernelLinear pair per expert (`mlp.pack_experts`).
    Returns how many were replaced; 0 on other devices, dtypes or builds (plain F.linear stays)."""
    from specserve.model.cpu_linear import invariant_linears, kernel_can_run
    from specserve.model.mlp import MoE, pack_experts
    count = sum(pack_experts(m) for m in list(model.modules()) if isinstance(m, MoE))
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children() if isinstance(child, nn.Linear)]
    for parent, name, linear in targets:
        if kernel_can_run(linear.weight):
            large = None
            if not invariant_linears(linear.weight.dtype) and can_pack(linear.weight):  # prefill-sized
                try:
                    large = PackedLinear(linear)
                except RuntimeError:
                    pass
            setattr(parent, name, KernelLinear.from_linear(linear, interleave=name == "gate_up_proj", large=large))
            count += 1
            continue
        if not can_pack(linear.weight):
            continue
        try:
            packed = PackedLinear(linear)
        except RuntimeError:  # oneDNN lacks a kernel for this dtype on this CPU: keep F.linear
            continue
        setattr(parent, name, packed)
        count += 1
    return count
