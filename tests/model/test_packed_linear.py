import pytest
import torch
from torch import nn

import torch.nn.functional as F

from specserve.model.packed_linear import PackedGatedLinear, PackedLinear, can_pack, linear_add, pack_linears

pytestmark = pytest.mark.skipif(not can_pack(torch.zeros(1, dtype=torch.bfloat16)),
                                reason="no oneDNN linear packing in this torch build")


@pytest.mark.parametrize("dtype,tol", [(torch.bfloat16, 0.0), (torch.float32, 1e-4)])
@pytest.mark.parametrize("rows", [1, 5, 32, 300])
@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear(dtype, tol, rows, bias):
    torch.manual_seed(0)
    linear = nn.Linear(96, 200, bias=bias).to(dtype)
    x = torch.randn(rows, 96, dtype=dtype)
    expected = linear(x)
    got = PackedLinear(linear)(x)
    assert got.dtype == dtype and got.shape == expected.shape
    assert (got.float() - expected.float()).abs().max().item() <= tol


def _close_to(got: torch.Tensor, exact: torch.Tensor, dtype: torch.dtype) -> None:
    """got within one rounding of `dtype` of the float64 result (bf16: 8 mantissa bits)."""
    rel = 2 ** -7 if dtype == torch.bfloat16 else 1e-5
    assert got.dtype == dtype
    assert ((got.double() - exact).abs() <= rel * exact.abs() + rel).all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 32, 300])
def test_fused_epilogues_match_the_unfused_math(dtype, rows):
    torch.manual_seed(0)
    x, residual = torch.randn(rows, 64, dtype=dtype), torch.randn(rows, 48, dtype=dtype)
    o_proj = nn.Linear(64, 48, bias=False).to(dtype)
    gate_up = nn.Linear(64, 2 * 40, bias=False).to(dtype)
    w_o, (w_g, w_u) = o_proj.weight.double(), gate_up.weight.double().chunk(2)
    _close_to(linear_add(PackedLinear(o_proj), x, residual), residual.double() + x.double() @ w_o.T, dtype)
    _close_to(PackedGatedLinear(gate_up)(x), F.silu(x.double() @ w_g.T) * (x.double() @ w_u.T), dtype)
    assert torch.equal(linear_add(o_proj, x, residual), residual + o_proj(x))  # unpacked: plain ops


def test_gated_linear_rejects_a_bias_or_odd_rows():
    with pytest.raises(ValueError, match="gated"):
        PackedGatedLinear(nn.Linear(8, 6, bias=True))
    with pytest.raises(ValueError, match="gated"):
        PackedGatedLinear(nn.Linear(8, 7, bias=False))


def test_pack_linears_packs_named_gated_projections_as_two_halves():
    model = nn.Module()
    model.gate_up_proj, model.down_proj = nn.Linear(16, 32, bias=False), nn.Linear(16, 16, bias=False)
    assert pack_linears(model.to(torch.bfloat16), gated=("gate_up_proj",)) == 2
    assert isinstance(model.gate_up_proj, PackedGatedLinear) and isinstance(model.down_proj, PackedLinear)
    assert model.gate_up_proj(torch.randn(3, 16, dtype=torch.bfloat16)).shape == (3, 16)


def test_pack_linears_replaces_every_linear_and_keeps_outputs():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.SiLU(), nn.Sequential(nn.Linear(32, 8, bias=False))).to(torch.bfloat16)
    x = torch.randn(4, 16, dtype=torch.bfloat16)
    expected = model(x)
    assert pack_linears(model) == 2
    assert not any(isinstance(m, nn.Linear) for m in model.modules())
    assert torch.equal(model(x), expected)


def test_pack_linears_leaves_unsupported_dtypes_alone():
    model = nn.Sequential(nn.Linear(16, 8)).to(torch.float16)
    assert pack_linears(model) == 0
    assert isinstance(model[0], nn.Linear)
