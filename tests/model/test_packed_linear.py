import pytest
import torch
from torch import nn

from specserve.model.cpu_linear import KernelLinear, kernel_can_run
from specserve.model.packed_linear import PackedLinear, can_pack, pack_linears
from specserve.settings import settings

pytestmark = pytest.mark.skipif(not can_pack(torch.zeros(1)), reason="no oneDNN linear packing in this torch build")
# oneDNN packs bf16 weights only on CPUs with AVX-512 (or AVX-NE-CONVERT): those tests need one.
needs_bf16_packing = pytest.mark.skipif(not can_pack(torch.zeros(1, dtype=torch.bfloat16)),
                                        reason="oneDNN cannot pack bf16 on this CPU")


@pytest.mark.parametrize("dtype,tol", [pytest.param(torch.bfloat16, 0.0, marks=needs_bf16_packing),
                                       (torch.float32, 1e-4)])
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 32, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(dtype, tol, rows, bias):
    torch.manual_seed(0)
    linear = nn.Linear(96, 200, bias=bias).to(dtype)
    x = torch.randn(rows, 96, dtype=dtype)
    expected = linear(x)
    got = PackedLinear(linear)(x)
    assert got.dtype == dtype and got.shape == expected.shape
    assert (got.float() - expected.float()).abs().max().item() <= tol


@needs_bf16_packing
@pytest.mark.parametrize("rows", [1, 2])
def test_padding_small_inputs_keeps_each_row(rows):
    # The padded rows must not leak into the result, and a row's output must not depend on the padding.
    torch.manual_seed(0)
    packed = PackedLinear(nn.Linear(96, 200, bias=True).to(torch.bfloat16))
    x = torch.randn(rows, 96, dtype=torch.bfloat16)
    got = packed(x)
    assert got.shape == (rows, 200)
    together = packed(torch.cat([x, torch.randn(4, 96, dtype=torch.bfloat16)]))[:rows]
    assert torch.equal(got, together)


def test_pack_linears_replaces_every_linear_and_keeps_outputs():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.SiLU(), nn.Sequential(nn.Linear(32, 8, bias=False))).to(torch.bfloat16)
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    expected = model(x)
    assert pack_linears(model) == 2
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    if kernel_can_run(torch.zeros(1, dtype=torch.bfloat16)):  # our kernel: accumulation order differs
        assert all(isinstance(m, KernelLinear) for m in (model[0], model[2][0]))
        assert torch.allclose(model(x).float(), expected.float(), rtol=2 ** -7, atol=2 ** -7)
    else:
        assert torch.equal(model(x), expected)


def test_pack_linears_leaves_unsupported_dtypes_alone():
    model = nn.Sequential(nn.Linear(16, 8)).to(torch.float16)
    assert pack_linears(model) == 0
    assert isinstance(model[0], nn.Linear)


@pytest.mark.skipif(not kernel_can_run(torch.zeros(1)), reason="no C compiler: no kernel here")
def test_without_batch_invariance_large_inputs_take_onednn(monkeypatch):
    monkeypatch.setattr(settings, "batch_invariant", False)
    torch.manual_seed(0)
    gate_up = nn.Linear(64, 128)
    holder = nn.Module()
    holder.gate_up_proj = gate_up
    pack_linears(holder)
    k = holder.gate_up_proj
    assert isinstance(k, KernelLinear) and isinstance(k.large, PackedLinear) and k.interleaved
    for rows in (4, 40):
        x = torch.randn(rows, 64)
        with torch.no_grad():
            want = gate_up(x)
            assert torch.allclose(k(x), want, atol=1e-5)  # the kernel (4 rows) or oneDNN (40)
            gate, up = want.chunk(2, dim=-1)
            assert torch.allclose(k.swiglu(x), torch.nn.functional.silu(gate) * up, atol=1e-5)
            residual = torch.randn(rows, 128)
            assert torch.allclose(k.add_into(x, residual.clone()), residual + want, atol=1e-5)
