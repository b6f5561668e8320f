"""Llama-family decoder written for serving: one forward over a ragged batch, paged KV cache.

Differences from the Hugging Face reference are layout only: q/k/v and gate/up projections are fused
into one matmul each (fewer kernel launches per layer); the math is the same.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specserve.model import cpu_forward, gpu_fused, kernels
from specserve.model.attention import AttentionMetadata, paged_attention
from specserve.model.config import ModelConfig
from specserve.model.cpu_linear import KernelLinear
from specserve.model.rope import apply_rope, rope_table


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, device=None):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim, device=device))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if kernels.rms_norm_supported(x, self.weight):  # the same arithmetic in one C call (CPU, no autograd)
            return kernels.rms_norm(x, self.weight, self.eps)
        if gpu_fused.supported(x):  # one Triton kernel instead of ~5 (GPU, inference)
            return gpu_fused.rms_norm(x, self.weight, self.eps)
        # One fused op that normalises in float32 and rounds once to x's dtype, as the reference's
        # x.float() * rsqrt(mean(x^2) + eps) then .to(dtype) does (bf16 variance loses too much precision).
        return self.weight * F.rms_norm(x, self.weight.shape, eps=self.eps)


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, device=None):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim ** -0.5
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, device)
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size,
                                  bias=config.attention_bias, device=device)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False, device=device)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, device)
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False, device=device)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False, device=device)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """x: [T, hidden]; kv: [2, num_blocks, Hkv, block_size, D] (this layer's cache). With KernelLinear
        projections (inference on the CPU), or on a GPU, x is updated in place and returned."""
        if gpu_fused.supported(x, self.head_dim):
            return self.forward_fused(x, cos, sin, kv, meta)
        h = self.input_layernorm(x)
        qk, v = self.qkv_proj(h).split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        # Queries and keys rotate together: one rope call per layer (its ~10 small ops are per call).
        qk = apply_rope(qk.reshape(-1, self.num_heads + self.num_kv_heads, self.head_dim), cos, sin)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        x = _add_linear(self.o_proj, paged_attention(q, k, v, kv[0], kv[1], meta, self.scale), x)
        return _add_linear(self.down_proj, self.swiglu(self.post_attention_layernorm(x)), x)

    def forward_fused(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: torch.Tensor,
                      meta: AttentionMetadata) -> torch.Tensor:
        """The same layer in 9 kernels on a GPU (`gpu_fused`): rope and the cache write in one, the residual
        adds inside the output projections' GEMMs (x += h W^T, in place)."""
        qkv = self.qkv_proj(self.input_layernorm(x))
        q = gpu_fused.rope_and_cache(qkv, cos, sin, meta.slot_mapping, kv[0], kv[1], self.num_heads,
                                     self.num_kv_heads)
        x.addmm_(paged_attention(q, None, None, kv[0], kv[1], meta, self.scale), self.o_proj.weight.t())
        h = gpu_fused.swiglu(self.gate_up_proj(self.post_attention_layernorm(x)))
        return x.addmm_(h, self.down_proj.weight.t())

    def swiglu(self, h: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up [T, intermediate] from the fused [gate; up] projection."""
        if isinstance(self.gate_up_proj, KernelLinear):  # straight from the kernel, no [T, 2 I] in between
            return self.gate_up_proj.swiglu(h)
        gate, up = self.gate_up_proj(h).chunk(2, dim=-1)
        return F.silu(gate) * up


def _add_linear(linear: nn.Module, h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """x + linear(h); with our kernel, added into x in place (x is the residual stream the layer owns)."""
    if isinstance(linear, KernelLinear) and not (torch.is_grad_enabled() and x.requires_grad):
        return linear.add_into(h, x)
    return x + linear(h)


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, device=None):
        """device="meta" builds the structure without memory (the loader then fills in the weights). Passed
        to each layer rather than set by `with torch.device(...)`, whose mode keeps the constructing frames
        (and through them the whole engine) alive until a garbage-collection pass (torch 2.13)."""
        super().__init__()
        self.config = config
        rank = config.embedding_rank
        self.embed_tokens = nn.Embedding(config.vocab_size, rank or config.hidden_size, device=device)
        self.embed_proj = nn.Linear(rank, config.hidden_size, bias=False, device=device) if rank else None
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False, device=device) \
            if config.eagle else None
        self.layers = nn.ModuleList(DecoderLayer(config, device) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, device)
        head_rows = config.draft_vocab_size or config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, head_rows, bias=False, device=device)
        if config.tie_word_embeddings:
            if config.draft_vocab_size or config.embedding_rank:
                raise ValueError("a reduced-vocabulary head or low-rank embedding cannot be tied")
            self.lm_head.weight = self.embed_tokens.weight
        # Not a buffer: `.to(bfloat16)` must not round the cos/sin table; it follows the input's device.
        self.rope = rope_table(config, config.max_position_embeddings)

    def embed(self, input_ids: torch.Tensor, features: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [...] -> layer input [..., hidden]. An EAGLE draft also takes `features` [..., hidden]:
        the target's final hidden state at each token's previous position."""
        x = self.embed_tokens(input_ids)
        if self.embed_proj is not None:
            x = self.embed_proj(x)
        if self.fc is not None:
            x = self.fc(torch.cat([x, features.to(x.dtype)], dim=-1))
        return x

    def forward(self, input_ids: torch.Tensor, meta: AttentionMetadata, kv_cache: torch.Tensor,
                features: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids: [T] new tokens of all sequences, flattened; kv_cache: [layers, 2, num_blocks,
        block_size, Hkv, D]; features: [T, hidden] for an EAGLE draft. Returns the final hidden states
        [T, hidden] (call `compute_logits` on the rows that need them)."""
        if self.rope.device != input_ids.device:
            self.rope = self.rope.to(input_ids.device)
        cos_sin = self.rope[meta.positions]  # [T, 2, D/2]
        cos, sin = cos_sin[:, 0, None], cos_sin[:, 1, None]
        x = self.embed(input_ids, features)
        if cpu_forward.can_run(self, x, kv_cache, meta):  # the same arithmetic without per-op overhead
            return self.norm(cpu_forward.run_layers(self, x, cos, sin, kv_cache, meta))
        for layer, kv in zip(self.layers, kv_cache):
            x = layer(x, cos, sin, kv, meta)
        return self.norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] -> float32 logits [N, vocab] (or [N, draft_vocab_size] for a reduced head)."""
        return self.lm_head(hidden).float()
