"""Linear layers run by our C kernel (`kernels/linear.c`): float32, bf16 or GGUF-quantized weights.

`KernelLinear` replaces an nn.Linear for inference on the CPU. Its weight is held in the layout the kernel
reads, chosen at load: float32/bf16 rows padded with zeros to a multiple of 32 inputs; GGUF blocks
(Q8_0, Q4_0, Q4_1, Q4_K, Q6_K) either for **integer dot products** (the default: formats "i4", "i8",
"i4w" and "i6", `kernels/int8_dot.h`), where each input row is quantized to int8 blocks and multiplied in int32, or
for the **exact path** (SPECSERVE_INT8_DOT=0: the blocks as the file has them, the nibbles of the 4-bit
formats reordered inside each run of 32 weights by `repack_q4`, expanded to float32). The exact path
equals the dequantized float32 matrix times x up to the order of accumulation; the integer path adds
the activations' 8-bit rounding (as llama.cpp's q8 activations; bench/quality.py measures what it
costs) and runs a whole forward 1.5-2.3x faster (docs/cpu-kernels.md). Both compute every output
element the same way whatever the number of rows (batch invariant; tests/model/test_cpu_linear.py,
test_int8_dot.py).

A fused gate/up projection can keep its rows interleaved (gate_0, up_0, gate_1, ...): `swiglu` then
returns silu(gate) * up straight from the kernel, with no [rows, 2 * intermediate] tensor in between;
`forward` still returns the usual [gate | up] layout.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from specserve.model import kernels
from specserve.settings import settings

QUANT_FORMATS = ("q8_0", "q4_0", "q4_1", "q4_k", "q6_k")  # what KernelLinear reads (gguf-py quantizes the first 3)
DENSE_FORMATS = {torch.float32: "f32", torch.bfloat16: "bf16"}
SMALL_ROWS = 16  # with batch invariance off, larger inputs take `KernelLinear.large` where there is one
PAD = 32  # float32/bf16 rows are padded to a multiple of this many inputs (the kernel's block)
# Offset of the nibbles in a block of each 4-bit format, and how many runs of 32 weights a block holds.
Q4_LAYOUT = {"q4_0": (2, 1), "q4_1": (4, 1), "q4_k": (16, 8)}


def int8_dot_default() -> bool:
    """Whether GGUF blocks load for integer dot products (SPECSERVE_INT8_DOT, default 1) or exact (0)."""
    return settings.int8_dot


def invariant_linears(dtype: torch.dtype) -> bool:
    """Whether linear layers of this weight dtype take our kernel for every row count (batch invariant)
    rather than oneDNN's packed weight above SMALL_ROWS rows. SPECSERVE_BATCH_INVARIANT=1: always;
    =0: never; unset: all but float32, where oneDNN's prefill GEMM is fast enough that invariance cost
    +32% of a 256-token prefill here (bf16: oneDNN cannot pack it without AVX-512, ours is 5x F.linear)."""
    return dtype != torch.float32 if settings.batch_invariant is None else settings.batch_invariant


def kernel_can_run(weight: torch.Tensor) -> bool:
    """Whether a KernelLinear can replace a linear layer with this weight (CPU, float32/bf16, built)."""
    return (weight.device.type == "cpu" and weight.dtype in DENSE_FORMATS
            and kernels.linear_supported(torch.empty(1, 1, dtype=weight.dtype)))


def gguf_name(fmt: str):
    from gguf import GGMLQuantizationType
    return GGMLQuantizationType[fmt.upper()]


def repack_q4(blocks: torch.Tensor, fmt: str) -> torch.Tensor:
    """GGUF 4-bit blocks [N, row bytes] (uint8) -> the same blocks with each run of 32 weights' 16 bytes
    reordered as the kernel reads them: byte l < 8 holds weights l (low nibble) and 8 + l (high), byte
    8 + l weights 16 + l and 24 + l. GGUF has weight j and 16 + j in byte j (Q4_0/Q4_1), and for Q4_K
    32 bytes per pair of runs, the first run in the low nibbles and the second in the high ones."""
    offset, runs = Q4_LAYOUT[fmt]
    nbytes = {"q4_0": 18, "q4_1": 20, "q4_k": 144}[fmt]
    b = blocks.reshape(-1, nbytes).clone()
    qs = b[:, offset:offset + 16 * runs]
    if fmt == "q4_k":  # [pairs, 32 bytes] -> weights of run 2p: low nibbles, run 2p + 1: high nibbles
        pairs = qs.reshape(-1, runs // 2, 32)
        weights = torch.stack([pairs & 0x0F, pairs >> 4], dim=2)  # [blocks, pair, run in pair, 32]
    else:
        weights = torch.stack([qs & 0x0F, qs >> 4], dim=1)  # [blocks, 2, 16]: weights 0-15, 16-31
    weights = weights.reshape(-1, 4, 8)  # per run: weights 0-7, 8-15, 16-23, 24-31
    packed = torch.cat([weights[:, 0] | (weights[:, 1] << 4), weights[:, 2] | (weights[:, 3] << 4)], dim=1)
    b[:, offset:offset + 16 * runs] = packed.reshape(b.shape[0], 16 * runs)
    return b.reshape(blocks.shape)


def quantize(weight: torch.Tensor, fmt: str) -> torch.Tensor:
    """A float matrix [N, K] -> GGUF blocks [N, row bytes] (uint8), quantized by gguf-py (llama.cpp's
    reference quantizers). K must be a multiple of the format's block (32)."""
    if fmt == "q8_0":
        return _quantize_q8_0(weight)
    from gguf import quants
    blocks = quants.quantize(weight.detach().float().cpu().numpy(), gguf_name(fmt))
    return torch.from_numpy(np.ascontiguousarray(blocks))


def _quantize_q8_0(weight: torch.Tensor) -> torch.Tensor:
    """gguf-py's Q8_0 (per 32 weights: d = max|w|/127 as float16, then round(w/d) half away from zero) in torch,
    bit for bit (tests/model/test_cpu_linear.py): numpy's version makes a temporary per step over every
    block, and the drafts' matrices are quantized at every start."""
    w = weight.detach().float().cpu().reshape(-1, 32)
    d = w.abs().amax(dim=1, keepdim=True) / 127
    x = w * torch.where(d == 0, torch.zeros_like(d), 1 / d)
    a = x.abs()
    whole = a.floor()
    q = torch.sign(x) * (whole + torch.floor(2 * (a - whole)))
    blocks = torch.cat([d.half().view(torch.uint8), q.to(torch.int8).view(torch.uint8)], dim=1)
    return blocks.reshape(weight.shape[0], -1).contiguous()


def dequantize_gguf(blocks: torch.Tensor, fmt: str, in_features: int) -> torch.Tensor:
    """GGUF-layout blocks -> float32 [N, in_features], by gguf-py (the reference the kernel must match)."""
    from gguf import quants
    w = quants.dequantize(blocks.numpy(), gguf_name(fmt))
    return torch.from_numpy(np.ascontiguousarray(w.reshape(blocks.shape[0], in_features)))


def interleave_rows(w: torch.Tensor) -> torch.Tensor:
    """[gate; up] rows -> gate_0, up_0, gate_1, up_1, ... (any trailing shape)."""
    gate, up = w.chunk(2)
    return torch.stack([gate, up], dim=1).reshape(w.shape)


class KernelLinear(nn.Module):
    """Inference-only linear layer on the C kernel. Build with `from_linear` or `from_gguf_blocks`.

    The weight is a plain attribute, not a parameter: `.to(dtype)` must not cast it (the kernel takes
    activations of either dtype against any weight format)."""

    def __init__(self, weight: torch.Tensor, fmt: str, in_features: int, bias: torch.Tensor | None,
                 interleaved: bool = False):
        super().__init__()
        self.weight_data, self.fmt = weight.contiguous(), fmt
        self.in_features, self.out_features = in_features, weight.shape[0]
        self.source_fmt = fmt  # what the weights were (weight_summary); from_gguf_blocks sets it for i4/i8
        self.padded = in_features
        if fmt in ("f32", "bf16"):
            self.padded = -(-in_features // PAD) * PAD
        elif fmt in kernels.INT8_FORMATS:
            self.padded = kernels.int8_layout(fmt, in_features)[0]
        self.bias_f32 = None if bias is None else bias.detach().float().contiguous()
        self.interleaved = interleaved  # rows (and bias) in gate/up pairs: `swiglu` works, see forward
        # The kernel's leading arguments, for callers that go straight to C (cpu_forward.py).
        self.c_args = (self.weight_data.data_ptr(), kernels.WEIGHT_FORMATS[fmt],
                       self.weight_data.stride(0) * self.weight_data.element_size(), self.out_features,
                       in_features, self.padded)
        self.bias_ptr = None if self.bias_f32 is None else self.bias_f32.data_ptr()
        # With batch invariance off: oneDNN's packed weight (PackedLinear) for more than SMALL_ROWS rows,
        # where it beats the kernel (float32 prefill: ~14.5 vs ~9 multiply-adds per cycle here).
        self.large: nn.Module | None = None

    @classmethod
    def from_linear(cls, linear: nn.Module, interleave: bool = False, large: nn.Module | None = None) -> "KernelLinear":
        """A dense copy of an nn.Linear's float32/bf16 weight (rows padded), optionally gate/up interleaved;
        `large`: a module computing the same layer (usual row order) for inputs of more than SMALL_ROWS rows."""
        return cls.from_weight(linear.weight.detach(), linear.bias, interleave, large)

    @classmethod
    def from_weight(cls, w: torch.Tensor, bias: torch.Tensor | None = None, interleave: bool = False,
                    large: nn.Module | None = None) -> "KernelLinear":
        """The same from a float32/bf16 matrix [out, in] (a mixture of experts' stacked ones, `mlp.py`)."""
        fmt = DENSE_FORMATS[w.dtype]
        pad = -w.shape[1] % PAD
        packed = F.pad(w, (0, pad)) if pad else w.clone()
        if interleave:
            packed = interleave_rows(packed)
            bias = None if bias is None else interleave_rows(bias.detach())
        module = cls(packed, fmt, w.shape[1], bias, interleave)
        module.large = large
        return module

    @classmethod
    def from_gguf_blocks(cls, blocks: torch.Tensor, fmt: str, in_features: int, bias: torch.Tensor | None = None,
                         interleave: bool = False, int8_dot: bool | None = None) -> "KernelLinear":
        """GGUF blocks [N, row bytes] as the file stores them (rows in our output order); int8_dot: the
        integer path or the exact one (None: `int8_dot_default()`)."""
        if fmt not in QUANT_FORMATS:
            raise ValueError(f"unsupported weight format {fmt!r}")
        block, nbytes = kernels.GGUF_BLOCKS[fmt]
        if in_features % block or blocks.shape[1] != in_features // block * nbytes:
            raise ValueError(f"{fmt} blocks of shape {tuple(blocks.shape)} cannot hold {in_features} inputs")
        integer = kernels.pack_int8(blocks, fmt, in_features) if (
            int8_dot if int8_dot is not None else int8_dot_default()) else None
        if integer is not None:
            packed, kernel_fmt = integer
        else:  # the exact path (asked for, or scales the integer layout cannot hold)
            packed, kernel_fmt = repack_q4(blocks, fmt) if fmt in Q4_LAYOUT else blocks.contiguous(), fmt
        if interleave:
            packed = interleave_rows(packed)
            bias = None if bias is None else interleave_rows(bias.detach())
        module = cls(packed, kernel_fmt, in_features, bias, interleave)
        module.source_fmt = fmt
        return module

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, format={self.fmt}, "
                f"bias={self.bias_f32 is not None}, interleaved={self.interleaved}")

    @property
    def weight_bytes(self) -> int:
        return self.weight_data.numel() * self.weight_data.element_size()

    def dense_weight(self) -> torch.Tensor:
        """The float32 [out, in] matrix in the usual row order (for tests and for the torch fallback)."""
        if self.fmt in ("f32", "bf16"):
            w = self.weight_data[:, :self.in_features].float()
        else:
            w = kernels.dequantize(self.weight_data, self.fmt, self.in_features)
        return self._usual_order(w)

    def _usual_order(self, y: torch.Tensor) -> torch.Tensor:
        """Undo the gate/up interleaving along the first (weights) or last (outputs) dim."""
        if not self.interleaved:
            return y
        if y.dim() == 2 and y.shape[0] == self.out_features and y.shape[1] == self.in_features:
            return torch.cat([y[0::2], y[1::2]])
        return torch.cat([y[..., 0::2], y[..., 1::2]], dim=-1)

    def _run(self, x: torch.Tensor, out: torch.Tensor | None, mode: str) -> torch.Tensor:
        return kernels.linear(x, self.weight_data, self.fmt, self.in_features, self.padded, self.bias_f32,
                              out, mode)

    def _kernel_takes(self, x: torch.Tensor) -> bool:
        """The kernel, unless autograd, another dtype or device (torch on the dequantized weights), or
        a `large` path for this many rows (batch invariance off)."""
        return kernels.linear_supported(x) and (self.large is None or x.shape[0] <= SMALL_ROWS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        if self._kernel_takes(flat):
            y = self._usual_order(self._run(flat, None, "store"))
            return y.reshape(*x.shape[:-1], self.out_features)
        if self.large is not None and kernels.linear_supported(flat):
            return self.large(x)
        bias = None if self.bias_f32 is None else self._usual_order(self.bias_f32).to(x.dtype)
        return F.linear(x, self.dense_weight().to(x.device, x.dtype), bias)

    def add_into(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual += self(x), in place, rounded as `residual + self(x)` is; returns residual."""
        if self._kernel_takes(x) and residual.is_contiguous() and not self.interleaved:
            self._run(x, residual, "add")
            return residual
        return residual.add_(self(x))

    def swiglu(self, x: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for a fused [gate; up] projection: [rows, out_features / 2]."""
        if self.interleaved and self._kernel_takes(x):
            return self._run(x, None, "swiglu")
        gate, up = self(x).chunk(2, dim=-1)
        return F.silu(gate) * up


class StackedKernelLinear(nn.Module):
    """A projection whose output rows come in parts of different formats, each a KernelLinear: a fused q/k/v
    whose v a GGUF `_M` file keeps in Q6_K beside Q4_K q and k. One kernel call per part, each writing its
    own columns of the output (the one-call forward chains them the same way, kernels/decoder.c). Its gate/up
    pairs are never interleaved (a pair would straddle two parts), so SwiGLU takes torch's ops after it."""

    interleaved = False
    large = None

    def __init__(self, parts: list[KernelLinear]):
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(part.out_features for part in parts)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}"

    @property
    def weight_bytes(self) -> int:
        return sum(part.weight_bytes for part in self.parts)

    def dense_weight(self) -> torch.Tensor:
        return torch.cat([part.dense_weight() for part in self.parts])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        if not kernels.linear_supported(flat):
            return torch.cat([part(x) for part in self.parts], dim=-1)
        out, first = flat.new_empty(flat.shape[0], self.out_features), 0
        for part in self.parts:
            part._run(flat, out[:, first:first + part.out_features], "store")
            first += part.out_features
        return out.reshape(*x.shape[:-1], self.out_features)
