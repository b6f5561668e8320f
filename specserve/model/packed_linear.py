"""Linear layers with weights pre-packed for oneDNN, for inference on the CPU.

`F.linear` on a plain [out, in] bf16 weight lets oneDNN reorder the weight into its blocked layout on
every call: a decode step then streams every weight matrix through memory twice. Packing once at load
time (the same op torch.compile's CPU backend uses when it freezes weights) made this machine's
SmolLM2-135M linears 1.6x faster at 32 decoding rows and the 49k-row head 1.8x faster; bf16 outputs are
bit-identical to `F.linear`'s (float32 differs in accumulation order, ~1e-5).
"""
from __future__ import annotations

import torch
from torch import nn

PACKABLE_DTYPES = (torch.float32, torch.bfloat16)


def can_pack(weight: torch.Tensor) -> bool:
    return (weight.device.type == "cpu" and weight.dtype in PACKABLE_DTYPES
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise"))


class PackedLinear(nn.Module):
    """Inference-only replacement of an nn.Linear (no autograd through the packed weight)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # The batch-size hint only tunes the blocking; packs made for 1 row served 1..512 rows as fast.
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), 1)
        self.bias = None if linear.bias is None else linear.bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def pack_linears(model: nn.Module) -> int:
    """Replace every nn.Linear of `model` (in place) by a PackedLinear where oneDNN supports it.
    Returns how many were replaced; 0 on other devices, dtypes or builds (plain F.linear stays)."""
    targets = [(parent, name, child) for parent in model.modules()
               for name, child in parent.named_children() if isinstance(child, nn.Linear)]
    count = 0
    for parent, name, linear in targets:
        if not can_pack(linear.weight):
            continue
        try:
            packed = PackedLinear(linear)
        except RuntimeError:  # oneDNN lacks a kernel for this dtype on this CPU: keep F.linear
            continue
        setattr(parent, name, packed)
        count += 1
    return count
