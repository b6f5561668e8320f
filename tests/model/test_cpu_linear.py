"""kernels/linear.c (through KernelLinear) against references, for every weight format and input dtype:
the exact path (GGUF blocks expanded to float32); test_int8_dot.py checks the integer one.

Tolerances: the kernel equals the exact product of x and the dequantized float32 weights up to float32
accumulation over K terms, so |got - exact| <= K * 2^-24 * sum|w x| (float32 output); a bf16 output adds
its one rounding, 2^-8 |exact|. The dequantized weights themselves must equal gguf-py's bit for bit, and a
row's output must be bit-identical whatever the number of rows around it (batch invariance).
"""
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from specserve.model import kernels
from specserve.model.cpu_linear import KernelLinear, dequantize_gguf, kernel_can_run, quantize
from specserve.settings import settings
from tests.model.gguf_fixtures import random_q4_k, random_q6_k

pytestmark = pytest.mark.skipif(not kernel_can_run(torch.zeros(1)), reason="no C compiler: no kernel here")

FORMATS = ["f32", "bf16", "q8_0", "q4_0", "q4_1", "q4_k", "q6_k"]
SUPER_BLOCKS = {"q4_k": random_q4_k, "q6_k": random_q6_k}  # 256 inputs a block; gguf-py cannot quantize them


def make(fmt: str, n: int, k: int, bias: bool = False, interleave: bool = False, seed: int = 0,
         int8_dot: bool = False):
    """(KernelLinear, its exact float32 weights [n, k] in the usual row order, float32 bias or None);
    GGUF formats on the exact path unless int8_dot."""
    torch.manual_seed(seed)
    b = torch.randn(n) if bias else None
    if fmt in ("f32", "bf16"):
        lin = nn.Linear(k, n, bias=bias).to(torch.float32 if fmt == "f32" else torch.bfloat16)
        if bias:
            lin.bias.data.copy_(b)
            b = lin.bias.detach().float()
        return KernelLinear.from_linear(lin, interleave), lin.weight.detach().float(), b
    blocks = torch.from_numpy(SUPER_BLOCKS[fmt]((n, k), seed)) if fmt in SUPER_BLOCKS else quantize(
        torch.randn(n, k), fmt)
    return (KernelLinear.from_gguf_blocks(blocks, fmt, k, b, interleave, int8_dot=int8_dot),
            dequantize_gguf(blocks, fmt, k), b)


def check_close(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> None:
    exact = x.double() @ w.double().T + (0 if b is None else b.double())
    bound = x.shape[1] * 2.0 ** -24 * (x.double().abs() @ w.double().abs().T) + 1e-30
    if got.dtype == torch.bfloat16:
        bound = bound + 2.0 ** -8 * exact.abs()
    err = (got.double() - exact).abs()
    assert (err <= bound).all(), f"max excess {(err - bound).max().item()}"


@pytest.mark.parametrize("fmt", FORMATS)
def test_weights_expand_to_gguf_py_values_bit_for_bit(fmt):
    k = 512
    lin, w, _ = make(fmt, 45, k)
    assert torch.equal(lin.dense_weight(), w)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_the_dequantized_product(fmt, dtype):
    # n = 45: a partial group of outputs; dense k = 200: padded inputs (not a multiple of 32).
    n, k = 45, 512 if fmt in SUPER_BLOCKS else (200 if fmt in ("f32", "bf16") else 96)
    lin, w, b = make(fmt, n, k, bias=True)
    for rows in list(range(1, 18)) + [50, 97]:  # 50, 97: more than one block of 48 rows
        x = torch.randn(rows, k).to(dtype)
        with torch.no_grad():
            got = lin(x)
        assert got.dtype == dtype and got.shape == (rows, n)
        check_close(got, x, w, b)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_gets_the_same_bits_whatever_rows_come_with_it(fmt, dtype):
    k = 512 if fmt in SUPER_BLOCKS else 160
    lin, _, _ = make(fmt, 37, k, bias=True)
    torch.manual_seed(1)
    x = torch.randn(100, k).to(dtype)
    with torch.no_grad():
        batch = lin(x)
        for r in (0, 1, 2, 47, 48, 99):
            for start in {r, max(0, r - 1), max(0, r - 2), max(0, r - 8)}:
                for rows in (1, 2, 3, 9, 17):
                    if start + rows > r:
                        assert torch.equal(lin(x[start:start + rows])[r - start], batch[r]), (r, start, rows)


@pytest.mark.parametrize("fmt, int8_dot", [("bf16", False), ("q4_1", False), ("q4_1", True), ("q6_k", True)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_swiglu_of_a_row_is_the_same_bits_whatever_rows_come_with_it(fmt, int8_dot, dtype):
    """The SwiGLU epilogue takes a tile's exponentials in one vector loop (its tail in scalar code): an
    output's bits must not depend on where its row falls."""
    k = 512 if fmt in SUPER_BLOCKS else 160
    fused, _, _ = make(fmt, 64, k, bias=True, interleave=True, int8_dot=int8_dot)
    torch.manual_seed(2)
    x = (torch.randn(60, k) * 2).to(dtype)
    with torch.no_grad():
        batch = fused.swiglu(x)
        for rows in (1, 2, 3, 5, 7, 8, 9, 17, 48, 49):
            for start in (0, 1, 60 - rows):
                assert torch.equal(fused.swiglu(x[start:start + rows]), batch[start:start + rows]), (start, rows)


@pytest.mark.parametrize("fmt", ["bf16", "q4_1"])
def test_strided_rows_and_3d_inputs(fmt):
    lin, w, _ = make(fmt, 40, 256)
    x = torch.randn(6, 512).bfloat16()[:, :256]  # rows with a stride, as a split hands them over
    with torch.no_grad():
        flat = lin(x)
        assert torch.equal(lin(x.reshape(2, 3, 256)).reshape(6, 40), flat)
        assert torch.equal(flat, lin(x.contiguous()))


@pytest.mark.parametrize("fmt", ["f32", "bf16", "q8_0", "q4_1"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_into_rounds_as_residual_plus_output(fmt, dtype):
    lin, _, _ = make(fmt, 64, 128, bias=True)
    x, residual = torch.randn(5, 128).to(dtype), torch.randn(5, 64).to(dtype)
    with torch.no_grad():
        want = residual + lin(x)
        got = lin.add_into(x, residual.clone())
    assert torch.equal(got, want)


@pytest.mark.parametrize("fmt", ["bf16", "q4_0", "q4_k", "q6_k"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_interleaved_gate_up_gives_swiglu_and_the_usual_outputs(fmt, dtype):
    k = 256
    plain, w, b = make(fmt, 64, k, bias=True)
    fused, w2, _ = make(fmt, 64, k, bias=True, interleave=True)
    assert torch.equal(w, w2) and torch.equal(fused.dense_weight(), w)
    x = torch.randn(7, k).to(dtype)
    with torch.no_grad():
        y = plain(x)
        assert torch.equal(fused(x), y)  # forward undoes the interleaving
        gate, up = y.chunk(2, dim=-1)
        want = F.silu(gate) * up
        got = fused.swiglu(x)
    # silu's exp differs between libm and torch's vector code by an ulp or so: one ulp of the output.
    ulp = 2.0 ** (-8 if dtype == torch.bfloat16 else -22)
    assert got.shape == (7, 32) and ((got.float() - want.float()).abs() <= ulp * want.float().abs() + 1e-6).all()


def test_autograd_and_other_dtypes_take_torch_with_the_same_weights():
    lin, w, b = make("q4_1", 16, 64, bias=True)
    x = torch.randn(3, 64, requires_grad=True)
    y = lin(x)  # no kernel while autograd records: F.linear on the dequantized matrix
    y.sum().backward()
    assert torch.allclose(y, x @ w.T + b, atol=1e-5) and x.grad is not None
    half = lin(x.detach().half())
    assert half.dtype == torch.float16


def test_portable_build_matches_too():
    """The C without AVX2 (SPECSERVE_CPU_KERNELS_MARCH=x86-64), in a fresh process: the same references."""
    code = ("import sys; sys.path.insert(0, 'tests/model'); import test_cpu_linear as t, torch\n"
            "from specserve.model import kernels\n"
            "for fmt in t.FORMATS:\n"
            "    for dtype in (torch.float32, torch.bfloat16):\n"
            "        t.test_matches_the_dequantized_product(fmt, dtype)\n"
            "        t.test_a_row_gets_the_same_bits_whatever_rows_come_with_it(fmt, dtype)\n"
            "    t.test_weights_expand_to_gguf_py_values_bit_for_bit(fmt)\n"
            "print('ok')\n")
    env = dict(os.environ, SPECSERVE_CPU_KERNELS_MARCH="x86-64")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-2000:]


def test_can_be_turned_off(monkeypatch):
    monkeypatch.setattr(settings, "cpu_kernels", False)
    kernels._library.cache_clear()
    try:
        assert not kernel_can_run(torch.zeros(1))
    finally:
        monkeypatch.setattr(settings, "cpu_kernels", True)
        kernels._library.cache_clear()
    assert kernel_can_run(torch.zeros(1)) and not kernel_can_run(torch.zeros(1).half())


def test_q8_0_quantizer_writes_gguf_py_bytes():
    """Our torch Q8_0 quantizer against gguf-py's (llama.cpp's reference), on the cases its rounding meets:
    all-zero blocks, halves (x.5 rounds away from zero), negative maxima, and ordinary weights."""
    import numpy as np
    from gguf import GGMLQuantizationType, quants
    g = torch.Generator().manual_seed(0)
    w = torch.randn(64, 96, generator=g)
    w[0] = 0.0
    w[1, :32] = torch.arange(32) - 15.5          # halves after scaling by 127/max
    w[2, :32] = -torch.linspace(0, 3, 32)        # the maximum magnitude negative
    w[3] *= 1e-30                                # tiny, not zero
    expected = quants.quantize(w.numpy(), GGMLQuantizationType.Q8_0)
    assert np.array_equal(quantize(w, "q8_0").numpy(), expected)
