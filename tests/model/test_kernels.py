"""The C kernels (attention of short queries, RMSNorm) against references, and their side effects."""
import math

import pytest
import torch
import torch.nn.functional as F

from specserve.model import kernels
from specserve.model.kernels import (argmax_rows, rms_norm, rms_norm_supported, short_attention,
                                     short_attention_supported)
from specserve.settings import settings

CPU = torch.device("cpu")
pytestmark = pytest.mark.skipif(not short_attention_supported(torch.float32, CPU),
                                reason="no C compiler: the kernel cannot be built here")


def reference(q, kc, vc, seqs, tables, starts, scale, window):
    """Per query, per head: softmax over the keys it may see, in float64. [T, H * D]."""
    T, H, D = q.shape
    Hkv = kc.shape[1]
    out = torch.zeros(T, H * D, dtype=torch.float64)
    for (ql, ctx), table, start in zip(seqs, tables, starts):
        keys = torch.cat([kc[b] for b in table], dim=1)[:, :ctx].double()  # [Hkv, ctx, D]
        values = torch.cat([vc[b] for b in table], dim=1)[:, :ctx].double()
        for i in range(ql):
            pos = ctx - ql + i
            visible = torch.arange(ctx) <= pos
            if window:
                visible &= torch.arange(ctx) > pos - window
            for h in range(H):
                g = h // (H // Hkv)
                scores = (keys[g] @ q[start + i, h].double()) * scale
                scores[~visible] = -math.inf
                out[start + i, h * D:(h + 1) * D] = torch.softmax(scores, 0) @ values[g]
    return out


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.bfloat16, 1.6e-2)])
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("heads,kv_heads", [(6, 2), (4, 4), (4, 1)])
@pytest.mark.parametrize("block_size", [4, 6])  # bf16: 4 takes the AVX512-BF16 path where the CPU has it
def test_matches_float64_reference(dtype, tol, window, heads, kv_heads, block_size):
    torch.manual_seed(0)
    D, num_blocks = 64, 40
    kc = torch.randn(num_blocks, kv_heads, block_size, D).to(dtype)
    vc = torch.randn(num_blocks, kv_heads, block_size, D).to(dtype)
    seqs = [(1, 9), (3, 3), (5, 20), (2, 17), (1, 1)]  # (new queries, context incl. them): decodes, verifies
    T = sum(q for q, _ in seqs)
    # Queries as the model hands them over: a view into the fused [q; k] rope output (row stride > H * D).
    q = torch.randn(T, heads + kv_heads, D).to(dtype)[:, :heads]
    free = torch.randperm(num_blocks).tolist()
    tables, starts, start = [], [], 0
    for ql, ctx in seqs:
        tables.append([free.pop() for _ in range(-(-ctx // block_size))])
        starts.append(start)
        start += ql
    width = max(map(len, tables))
    padded = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    meta = torch.tensor([starts, [q for q, _ in seqs], [c for _, c in seqs]], dtype=torch.int32)
    out = torch.full((T, heads * D), float("nan"), dtype=dtype)
    short_attention(q, kc, vc, out, meta, padded, 0.125, window)
    want = reference(q, kc, vc, seqs, tables, starts, 0.125, window)
    assert (out.double() - want).abs().max().item() <= tol


def test_loading_leaves_denormals_alone():
    """Linked with -ffast-math, gcc adds a constructor that sets flush-to-zero for the whole process."""
    kernels.available()
    tiny = torch.tensor([1e-39], dtype=torch.float32) / 10
    assert tiny.item() != 0.0


def test_can_be_turned_off(monkeypatch):
    monkeypatch.setattr(settings, "cpu_kernels", False)
    kernels._library.cache_clear()
    try:
        assert not short_attention_supported(torch.float32, CPU)
    finally:
        monkeypatch.setattr(settings, "cpu_kernels", True)
        kernels._library.cache_clear()
    assert short_attention_supported(torch.float32, CPU)
    assert not short_attention_supported(torch.float16, CPU)  # other dtypes take the torch path


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-6), (torch.bfloat16, 0.0)])
@pytest.mark.parametrize("rows,dim", [(1, 576), (37, 576), (300, 100)])  # 300 rows: the threaded branch
def test_rms_norm_matches_torch(dtype, tol, rows, dim):
    """The reference is what the model runs without the kernel: w * F.rms_norm(x) (float32 inside)."""
    torch.manual_seed(0)
    x = (3 * torch.randn(rows, 2 * dim)).to(dtype)[:, :dim]  # rows with a stride, as a split hands them over
    weight = (1 + 0.5 * torch.randn(dim)).to(dtype)
    with torch.no_grad():
        assert rms_norm_supported(x, weight)
        want = weight * F.rms_norm(x, (dim,), eps=1e-5)
        got = rms_norm(x, weight, 1e-5)
    assert got.dtype == dtype and got.shape == (rows, dim)
    assert (got.float() - want.float()).abs().max().item() <= tol


def test_rms_norm_gives_a_row_the_same_bits_alone_and_in_a_batch():
    torch.manual_seed(0)
    x, weight = torch.randn(300, 576).bfloat16(), torch.randn(576).bfloat16()
    batch = rms_norm(x, weight, 1e-5)
    for r in (0, 150, 299):
        assert torch.equal(rms_norm(x[r:r + 1], weight, 1e-5)[0], batch[r])


def test_rms_norm_leaves_autograd_to_torch():
    x, weight = torch.randn(4, 8), torch.ones(8, requires_grad=True)
    assert not rms_norm_supported(x, weight)  # no backward in C: training takes F.rms_norm
    with torch.no_grad():
        assert rms_norm_supported(x, weight)
    assert not rms_norm_supported(x.bfloat16(), weight.detach())  # dtypes must agree


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size,window", [(16, None), (4, None), (16, 7), (6, None)])
def test_a_query_gets_the_same_bits_in_a_decode_and_in_a_verify(dtype, block_size, window):
    """Lossless greedy SD needs this: the verify pass scores draft positions with more keys cached behind
    them (and more rows beside them) than the plain decode of the same position had, and a last-bit
    difference can flip an argmax between near-tied tokens."""
    torch.manual_seed(1)
    H, Hkv, D, verify = 6, 2, 64, 5
    context = 41
    num_blocks = -(-(context + verify) // block_size)
    kc = torch.randn(num_blocks, Hkv, block_size, D).to(dtype)
    vc = torch.randn(num_blocks, Hkv, block_size, D).to(dtype)
    table = torch.arange(num_blocks, dtype=torch.int32)[None]
    q = torch.randn(verify, H, D).to(dtype)
    # One verify: queries at positions context .. context + verify - 1.
    verified = torch.empty(verify, H * D, dtype=dtype)
    short_attention(q, kc, vc, verified, torch.tensor([[0], [verify], [context + verify]], dtype=torch.int32),
                    table, 0.125, window)
    for i in range(verify):  # the same queries as decodes, each with only its own keys cached
        decoded = torch.empty(1, H * D, dtype=dtype)
        short_attention(q[i:i + 1], kc, vc, decoded, torch.tensor([[0], [1], [context + i + 1]], dtype=torch.int32),
                        table, 0.125, window)
        assert torch.equal(decoded[0], verified[i]), f"position {context + i}"


@pytest.mark.parametrize("rows,cols", [(1, 49152), (32, 49152), (3, 5)])
def test_argmax_rows_matches_torch_first_index_on_ties(rows, cols):
    torch.manual_seed(0)
    logits = torch.randn(rows, 2 * cols)[:, :cols]  # rows with a stride
    logits[0, cols // 2] = logits[0, -1] = logits[0].max() + 1  # a tie: the first index wins, as in torch
    assert torch.equal(argmax_rows(logits), logits.argmax(dim=-1))
    assert argmax_rows(logits)[0].item() == cols // 2
    assert torch.equal(argmax_rows(logits.bfloat16()), logits.bfloat16().argmax(dim=-1))  # torch path


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 300])  # 300: the threaded branch
def test_rope_matches_the_torch_ops(dtype, tokens):
    from specserve.model import rope as rope_module
    torch.manual_seed(0)
    heads, kv_heads, D = 6, 2, 64
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * D).to(dtype)
    x = qkv[:, :(heads + kv_heads) * D].reshape(tokens, heads + kv_heads, D)  # as the layer hands it over
    cos_sin = torch.randn(tokens, 2, D // 2)
    cos, sin = cos_sin[:, 0, None], cos_sin[:, 1, None]
    with torch.no_grad():
        assert kernels.rope_supported(x, cos, sin)
        got = kernels.rope(x, cos, sin)
        half = D // 2
        x1, x2 = x[..., :half].float(), x[..., half:].float()
        want = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(dtype)
        assert torch.equal(rope_module.apply_rope(x, cos, sin), got)  # apply_rope takes the kernel
    assert got.is_contiguous() and got.shape == x.shape
    # Within a few units in the last place of the products' size (the kernel may fuse a multiply-add).
    ulp = 2.0 ** (-23 if dtype == torch.float32 else -8)
    scale = torch.cat([(x1 * cos).abs() + (x2 * sin).abs(), (x2 * cos).abs() + (x1 * sin).abs()], dim=-1)
    assert ((got.float() - want.float()).abs() <= 2 * ulp * scale).all()
    assert not kernels.rope_supported(x.detach().requires_grad_(), cos, sin)  # autograd: the torch ops
