"""The GPU short-query attention kernel against a dense reference (on a GPU, or on the CPU under Triton's
interpreter; skipped where Triton is not installed, as on the CPU CI)."""
import math

import pytest
import torch

triton = pytest.importorskip("triton")

if not torch.cuda.is_available():
    # Triton 3.6's interpreter reads a loop bound with int() of a 1-element array, an error since numpy 2.4.
    from triton.runtime import interpreter

    _patch = interpreter._patch_lang_tensor

    def _patch_lang_tensor(tensor, scope):
        _patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    interpreter._patch_lang_tensor = _patch_lang_tensor


@pytest.fixture(scope="module")
def kernel():
    """The module and where it runs: the GPU, or the CPU under Triton's interpreter (tests/conftest.py)."""
    from specserve.model import gpu_attention
    return gpu_attention, torch.device("cuda" if torch.cuda.is_available() else "cpu")


def reference(q, k_cache, v_cache, seqs, tables, scale, window):
    """{(row, head): softmax(q k^T) v} over the keys each query may see, in float64."""
    num_heads = q.shape[1]
    per_kv = num_heads // k_cache.shape[1]
    block_size = k_cache.shape[2]
    out = {}
    for (first, q_len, ctx), table in zip(seqs.T.tolist(), tables):
        pos = torch.arange(ctx)
        keys = k_cache[table[pos // block_size], :, pos % block_size].double()  # [ctx, Hkv, D]
        values = v_cache[table[pos // block_size], :, pos % block_size].double()
        for i in range(q_len):
            qpos = ctx - q_len + i
            seen = (pos <= qpos) & ((pos > qpos - window) if window else True)
            for h in range(num_heads):
                s = keys[seen, h // per_kv] @ q[first + i, h].double() * scale
                out[first + i, h] = torch.softmax(s, 0) @ values[seen, h // per_kv]
    return out


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), pytest.param(torch.bfloat16, 2e-2, marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="Triton's interpreter multiplies bf16 tiles as integers"))])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(9, 3), (4, 4)])
@pytest.mark.parametrize("shape", [
    # (q_lens, ctx_lens, window): decodes, a verify, a prefill piece of 32, a padding sequence (0 queries)
    ([1, 1, 1], [1, 17, 130], None),
    ([5, 1, 32, 0], [5, 70, 100, 0], None),
    ([3, 1], [90, 40], 24),
])
def test_matches_dense_reference(kernel, dtype, tol, num_heads, num_kv_heads, shape):
    module, device = kernel
    q_lens, ctx_lens, window = shape
    torch.manual_seed(len(q_lens) * num_heads)
    head_dim, block_size, num_blocks = 16, 16, 40
    k_cache = torch.randn(num_blocks, num_kv_heads, block_size, head_dim, dtype=dtype, device=device)
    v_cache = torch.randn_like(k_cache)
    firsts = [sum(q_lens[:i]) for i in range(len(q_lens))]
    tokens = sum(q_lens) + 1  # one row no sequence owns: the kernel must leave it alone
    q = torch.randn(tokens, num_heads, head_dim, dtype=dtype, device=device)
    width = max(1, max(math.ceil(c / block_size) for c in ctx_lens))
    tables = torch.stack([torch.randperm(num_blocks)[:width] for _ in q_lens]).to(device)
    seqs = torch.tensor([firsts, q_lens, ctx_lens], dtype=torch.int32, device=device)
    out = torch.full((tokens, num_heads * head_dim), float("nan"), dtype=dtype, device=device)
    scale = head_dim ** -0.5
    module.short_attention(q, k_cache, v_cache, out, seqs, tables.int(), scale, window, max(q_lens))
    expected = reference(q.cpu(), k_cache.cpu(), v_cache.cpu(), seqs.cpu(), tables.cpu(), scale, window)
    got = out.view(tokens, num_heads, head_dim).cpu().double()
    for (row, h), want in expected.items():
        err = (got[row, h] - want).norm() / want.norm()
        assert err < tol, (row, h, err.item())
    assert torch.isnan(got[tokens - 1]).all()  # untouched
