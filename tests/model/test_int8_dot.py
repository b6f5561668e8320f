"""The integer path of kernels/linear.c (kernels/int8_dot.h): GGUF weights against int8-quantized rows.

What must hold: the repacked weights are gguf-py's values bit for bit; the product is within the error of
quantizing each block of 32 inputs to int8 (|x - da a| <= da / 2 per input, da = max|x| / 127) plus float32
rounding; a row's output is the same bits whatever rows come with it; and every instruction-set path
(VNNI, AVX2 maddubs, portable C) gives the same bits, each built in a fresh process here.
"""
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from specserve.model.cpu_linear import KernelLinear, dequantize_gguf, int8_dot_default, kernel_can_run, quantize
from specserve.settings import settings

sys.path.insert(0, os.path.dirname(__file__))
from test_cpu_linear import SUPER_BLOCKS, make  # noqa: E402

pytestmark = pytest.mark.skipif(not kernel_can_run(torch.zeros(1)), reason="no C compiler: no kernel here")

FORMATS = ["q8_0", "q4_0", "q4_1", "q4_k", "q6_k"]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


# Inputs -> the group layout: 96 = a tail of 3 blocks (S = 4), 160 = 5 blocks (a padded whole group),
# 576 = 2 groups and a tail of 2 (S = 2, SmolLM2's hidden size), 512 = 2 whole groups.
WIDTHS = [(fmt, k) for fmt in FORMATS for k in ([512] if fmt in SUPER_BLOCKS else [96, 160, 576])]


def quantization_bound(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """[rows, n]: the activations' rounding, sum over blocks of da/2 * sum|w|, plus float32 rounding."""
    rows, k = x.shape
    xd, wd = x.double(), w.double().abs()
    da = xd.abs().reshape(rows, k // 32, 32).amax(-1) / 127  # [rows, blocks]
    wsum = wd.reshape(w.shape[0], k // 32, 32).sum(-1)  # [n, blocks]
    exact = xd @ w.double().T + (0 if b is None else b.double())
    return 0.5 * (1 + 1e-6) * da @ wsum.T + k * 2.0 ** -22 * (xd.abs() @ wd.T) + 1e-6 * exact.abs() + 1e-30


@pytest.mark.parametrize("fmt, k", WIDTHS)
def test_repacked_weights_are_gguf_py_values_bit_for_bit(fmt, k):
    lin, w, _ = make(fmt, 45, k, int8_dot=True)
    assert lin.fmt == {"q8_0": "i8", "q4_k": "i4w", "q6_k": "i6"}.get(fmt, "i4") and lin.source_fmt == fmt
    assert torch.equal(lin.dense_weight(), w)


@pytest.mark.parametrize("fmt, k", WIDTHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_within_the_activations_quantization_error(fmt, k, dtype):
    lin, w, b = make(fmt, 45, k, bias=True, int8_dot=True)
    exact_path = make(fmt, 45, k, bias=True)[0]
    for rows in (1, 2, 5, 8, 9, 17, 50, 97):  # tiles of 8 (4 without AVX-512) rows, blocks of 48 rows
        x = (torch.randn(rows, k) * torch.rand(rows, 1) * 4).to(dtype)
        with torch.no_grad():
            got = lin(x)
        exact = x.double() @ w.double().T + b.double()
        bound = quantization_bound(x.float(), w, b)
        if dtype == torch.bfloat16:
            bound = bound + 2.0 ** -8 * exact.abs()
        err = (got.double() - exact).abs()
        assert (err <= bound).all(), f"rows {rows}: max excess {(err - bound).max().item()}"
        # and it is not the exact path: the int8 rounding shows
        assert not torch.equal(got, exact_path(x))


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_gets_the_same_bits_whatever_rows_come_with_it(fmt, dtype):
    k = 512 if fmt in SUPER_BLOCKS else 96  # 96: a tail group of 3 blocks (and one zero block)
    lin, _, _ = make(fmt, 37, k, bias=True, int8_dot=True)
    torch.manual_seed(1)
    x = torch.randn(100, k).to(dtype)
    with torch.no_grad():
        batch = lin(x)
        for r in (0, 1, 7, 8, 47, 48, 99):
            for start in {r, max(0, r - 1), max(0, r - 5), max(0, r - 9)}:
                for rows in (1, 2, 3, 8, 9, 17):
                    if start + rows > r:
                        assert torch.equal(lin(x[start:start + rows])[r - start], batch[r]), (r, start, rows)


@pytest.mark.parametrize("fmt", ["q8_0", "q4_1"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_into_and_swiglu_round_as_torch_does(fmt, dtype):
    k = 288  # two groups, the second padded
    plain, w, b = make(fmt, 64, k, bias=True, int8_dot=True)
    fused, _, _ = make(fmt, 64, k, bias=True, interleave=True, int8_dot=True)
    x, residual = torch.randn(5, k).to(dtype), torch.randn(5, 64).to(dtype)
    with torch.no_grad():
        y = plain(x)
        assert torch.equal(plain.add_into(x, residual.clone()), residual + y)
        assert torch.equal(fused(x), y) and torch.equal(fused.dense_weight(), w)
        gate, up = y.chunk(2, dim=-1)
        want, got = F.silu(gate) * up, fused.swiglu(x)
    ulp = 2.0 ** (-8 if dtype == torch.bfloat16 else -22)  # libm's exp against torch's: an ulp or so
    assert ((got.float() - want.float()).abs() <= ulp * want.float().abs() + 1e-6).all()


def test_scales_beyond_the_f16_layout_keep_the_exact_path():
    """Q8_0 stores -128 d beside d as f16: a block scale d above 512 overflows it, so that matrix stays exact."""
    blocks = quantize(torch.randn(4, 64) * 1e5, "q8_0")
    assert dequantize_gguf(blocks, "q8_0", 64).abs().max() > 65504  # d > 512
    lin = KernelLinear.from_gguf_blocks(blocks, "q8_0", 64, int8_dot=True)
    assert lin.fmt == "q8_0" and torch.equal(lin.dense_weight(), dequantize_gguf(blocks, "q8_0", 64))


def test_the_environment_chooses_the_path(monkeypatch):
    monkeypatch.setattr(settings, "int8_dot", True)
    assert int8_dot_default()
    assert make("q4_1", 8, 64, int8_dot=None)[0].fmt == "i4"
    monkeypatch.setattr(settings, "int8_dot", False)
    assert not int8_dot_default() and make("q4_1", 8, 64, int8_dot=None)[0].fmt == "q4_1"


OUTPUTS = """
import sys, torch
sys.path.insert(0, 'tests/model')
from test_cpu_linear import make
out = {}
for fmt in ('q8_0', 'q4_0', 'q4_1', 'q4_k', 'q6_k'):
    k = 512 if fmt in ('q4_k', 'q6_k') else 352
    lin, _, _ = make(fmt, 29, k, bias=True, int8_dot=True)
    torch.manual_seed(3)
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(21, k) * 3).to(dtype)
        with torch.no_grad():
            out[fmt, str(dtype)] = torch.cat([lin(x), lin(x[:1]), lin(x[5:14])])
fused, _, _ = make('q4_1', 64, 352, bias=True, interleave=True, int8_dot=True)
for dtype in (torch.float32, torch.bfloat16):
    x = (torch.randn(21, 352) * 3).to(dtype)
    with torch.no_grad():
        out['swiglu', str(dtype)] = torch.cat([fused.swiglu(x), fused.swiglu(x[:1])])
torch.save(out, sys.argv[1])
"""


# -march -> the CPU flags it needs: AVX2 without VNNI (maddubs, tiles of 4 rows), AVX-512 without VNNI
# (maddubs, tiles of 8 rows), AVX-VNNI on 256-bit vectors only, the portable C.
MARCHES = {"x86-64-v3": ["avx2"], "x86-64-v4": ["avx512f", "avx512bw", "avx512vl"], "alderlake": ["avx_vnni"],
           "x86-64": []}


@pytest.mark.parametrize("march", MARCHES)
def test_every_instruction_set_gives_the_same_bits(march, tmp_path):
    """Each other code path this CPU can run, compiled in a fresh process, against this machine's build
    (AVX-512 VNNI's two-row 512-bit tiles where it has them): equal outputs, bit for bit."""
    flags = next((line.split() for line in open("/proc/cpuinfo") if line.startswith("flags")), [])
    if not all(flag in flags for flag in MARCHES[march]):
        pytest.skip(f"this CPU cannot run the {march} build")
    files = {}
    for name, env_march in (("native", None), (march, march)):
        env = dict(os.environ)
        env.pop("SPECSERVE_CPU_KERNELS_MARCH", None)
        if env_march:
            env["SPECSERVE_CPU_KERNELS_MARCH"] = env_march
        files[name] = tmp_path / f"{name}.pt"
        proc = subprocess.run([sys.executable, "-c", OUTPUTS, str(files[name])], env=env, cwd=ROOT,
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, proc.stderr[-2000:]
    native, other = torch.load(files["native"]), torch.load(files[march])
    assert native.keys() == other.keys()
    for key in native:
        assert torch.equal(native[key], other[key]), key
