"""The GPU step's fused kernels (model/gpu_fused.py) against the torch ops they replace, and a decoder layer's
fused forward against its torch-ops forward: on a GPU, or on the CPU under Triton's interpreter (float32;
skipped where Triton is not installed, as on the CPU CI)."""
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from specserve.model import gpu_fused  # noqa: E402
from specserve.model.attention import AttentionMetadata  # noqa: E402
from specserve.model.config import ModelConfig  # noqa: E402
from specserve.model.llama import DecoderLayer  # noqa: E402
from specserve.model.rope import rope_table  # noqa: E402

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def rotate(x, cos, sin):
    """The torch ops' rope (rope.apply_rope's fallback), x: [T, heads, D]."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


@pytest.mark.parametrize("rows,width", [(1, 64), (5, 576), (3, 100)])
def test_rms_norm_matches_torch(rows, width):
    torch.manual_seed(rows)
    x = torch.randn(rows, width, device=DEVICE) * 3
    w = torch.randn(width, device=DEVICE)
    want = w * F.rms_norm(x, (width,), eps=1e-5)
    torch.testing.assert_close(gpu_fused.rms_norm(x, w, 1e-5), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim", [(9, 3, 64), (4, 2, 16), (2, 2, 32)])
def test_rope_and_cache_rotates_and_writes_each_token_at_its_slot(num_heads, num_kv_heads, head_dim):
    torch.manual_seed(head_dim)
    tokens, block_size, num_blocks = 7, 4, 6
    qkv = torch.randn(tokens, (num_heads + 2 * num_kv_heads) * head_dim, device=DEVICE)
    config = ModelConfig(vocab_size=8, hidden_size=num_heads * head_dim, intermediate_size=8, num_hidden_layers=1,
                         num_attention_heads=num_heads, head_dim=head_dim, num_key_value_heads=num_kv_heads,
                         rope_theta=10000.0)
    positions = torch.tensor([0, 1, 2, 9, 10, 5, 17], device=DEVICE)
    cos_sin = rope_table(config, 32).to(DEVICE)[positions]
    cos, sin = cos_sin[:, 0, None], cos_sin[:, 1, None]
    slots = torch.randperm(num_blocks * block_size, device=DEVICE)[:tokens]
    k_cache = torch.zeros(num_blocks, num_kv_heads, block_size, head_dim, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    q = gpu_fused.rope_and_cache(qkv, cos, sin, slots, k_cache, v_cache, num_heads, num_kv_heads)

    heads = qkv.view(tokens, num_heads + 2 * num_kv_heads, head_dim)
    qk = rotate(heads[:, :num_heads + num_kv_heads], cos, sin)
    torch.testing.assert_close(q, qk[:, :num_heads], rtol=1e-6, atol=1e-6)
    want_k, want_v = torch.zeros_like(k_cache), torch.zeros_like(v_cache)
    block, offset = slots // block_size, slots % block_size
    want_k[block, :, offset] = qk[:, num_heads:]
    want_v[block, :, offset] = heads[:, num_heads + num_kv_heads:]
    torch.testing.assert_close(k_cache, want_k, rtol=1e-6, atol=1e-6)  # other slots untouched (zero)
    torch.testing.assert_close(v_cache, want_v, rtol=0, atol=0)


@pytest.mark.parametrize("rows,width", [(1, 128), (4, 1536), (2, 3000)])
def test_swiglu_matches_torch(rows, width):
    torch.manual_seed(width)
    gate_up = torch.randn(rows, 2 * width, device=DEVICE) * 4
    gate, up = gate_up.chunk(2, dim=-1)
    torch.testing.assert_close(gpu_fused.swiglu(gate_up), F.silu(gate) * up, rtol=1e-5, atol=1e-5)


def test_fused_layer_matches_the_torch_ops_layer():
    """A decoder layer's fused forward (9 kernels) computes what its torch-ops forward does: same output,
    same cache, over a step of a prefill piece, a verify and a decode."""
    torch.manual_seed(0)
    config = ModelConfig(vocab_size=8, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, rope_theta=10000.0,
                         attention_bias=True)
    layer = DecoderLayer(config, DEVICE)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.2)
    block_size = 4
    q_lens, ctx_lens, tables = [6, 3, 1], [6, 11, 9], [[0, 1], [2, 3, 4], [5, 6, 7]]
    num_tokens = sum(q_lens)
    x = torch.randn(num_tokens, 64, device=DEVICE)
    caches = [torch.randn(2, 8, 2, block_size, 16, device=DEVICE) for _ in range(2)]
    caches[1].copy_(caches[0])
    out = []
    for fused, kv in zip((False, True), caches):
        meta = AttentionMetadata.build(q_lens, ctx_lens, tables, block_size, DEVICE, short_kernel=True)
        cos_sin = rope_table(config, 32).to(DEVICE)[meta.positions]
        cos, sin = cos_sin[:, 0, None], cos_sin[:, 1, None]
        with torch.inference_mode():
            run = layer.forward_fused if fused else layer.forward
            out.append(run(x.clone(), cos, sin, kv, meta))
    torch.testing.assert_close(out[1], out[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(caches[1], caches[0], rtol=1e-6, atol=1e-6)
