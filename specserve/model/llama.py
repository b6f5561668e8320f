"""The decoder of every family we serve, written for serving: one forward over a ragged batch, paged KV cache.

Llama's layer plus the pieces other families switch on (model/family.py). Differences from the Hugging Face
references are layout only: q/k/v and gate/up projections are fused into one matmul each (fewer kernel
launches per layer), Gemma's (1 + w) norm weights are stored as 1 + w (weights.py); the math is the same.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from specserve.model import cpu_forward, gpu_fused, kernels
from specserve.model.attention import AttentionMetadata, paged_attention
from specserve.model.config import ModelConfig
from specserve.model.cpu_linear import KernelLinear
from specserve.model.mlp import MoE, gated
from specserve.model.rope import apply_rope, has_local_rope, rope_table


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
    """One decoder layer of any family: the family (model/family.py) and the config choose the pieces --
    q/k norms, norms on the attention and MLP outputs, the window and rope of this layer, a dense MLP
    (gate_up_proj, down_proj) or a mixture of experts (`moe`, mlp.py). `plain` layers (Llama's) are what
    the one-call CPU path (cpu_forward.py) and the fused GPU path (`forward_fused`) implement."""

    def __init__(self, config: ModelConfig, index: int, device=None):
        super().__init__()
        family = config.family
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = (config.query_pre_attn_scalar or self.head_dim) ** -0.5
        self.sliding_window = config.sliding_window if config.is_sliding(index) else None
        self.rope_index = int(config.is_sliding(index) and has_local_rope(config))  # into LlamaModel.ropes
        self.act = config.hidden_act
        dim, eps = config.hidden_size, config.rms_norm_eps
        norm = lambda size: RMSNorm(size, eps, device)  # noqa: E731
        self.input_layernorm = norm(dim)
        self.qkv_proj = nn.Linear(dim, self.q_size + 2 * self.kv_size, bias=config.attention_bias, device=device)
        self.o_proj = nn.Linear(self.q_size, dim, bias=False, device=device)
        self.q_norm = norm(self.head_dim) if family.qk_norm else None
        self.k_norm = norm(self.head_dim) if family.qk_norm else None
        self.attention_output_norm = norm(dim) if family.sandwich_norms else None
        self.post_attention_layernorm = norm(dim)  # in front of the MLP
        self.mlp_output_norm = norm(dim) if family.sandwich_norms else None
        self.moe = MoE(config, device) if config.is_moe(index) else None
        if self.moe is None:
            self.gate_up_proj = nn.Linear(dim, 2 * config.intermediate_size, bias=False, device=device)
            self.down_proj = nn.Linear(config.intermediate_size, dim, bias=False, device=device)
        self.plain = not (family.qk_norm or family.sandwich_norms or self.moe or self.act != "silu")

    def forward(self, x: torch.Tensor, ropes: list, kv: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """x: [T, hidden]; ropes: the model's (cos, sin) pairs, each [T, 1, D/2]; kv: [2, num_blocks, Hkv,
        block_size, D] (this layer's cache). With KernelLinear projections (inference on the CPU), or on a
        GPU, x is updated in place and returned."""
        cos, sin = ropes[self.rope_index]
        if self.plain and gpu_fused.supported(x, self.head_dim):
            return self.forward_fused(x, cos, sin, kv, meta)
        q, k, v = self.attention_inputs(x, cos, sin)
        return self.finish(x, paged_attention(q, k, v, kv[0], kv[1], meta, self.scale, self.sliding_window))

    def attention_inputs(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [N, hidden] -> q [N, H, D], k and v [N, Hkv, D]: normed, projected, q/k normed per head, rotated."""
        qk, v = self.qkv_proj(self.input_layernorm(x)).split([self.q_size + self.kv_size, self.kv_size], dim=-1)
        qk = qk.reshape(-1, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat([self.q_norm(q.reshape(-1, self.head_dim)).view(q.shape),
                            self.k_norm(k.reshape(-1, self.head_dim)).view(k.shape)], dim=1)
        # Queries and keys rotate together: one rope call per layer (its ~10 small ops are per call).
        q, k = apply_rope(qk, cos, sin).split([self.num_heads, self.num_kv_heads], dim=1)
        return q, k, v.reshape(-1, self.num_kv_heads, self.head_dim)

    def finish(self, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        """x [N, hidden] plus the attention output attn [N, H * D] through o_proj, then plus the MLP's output,
        each normed first where the family says."""
        x = _add_output(self.o_proj, attn, x, self.attention_output_norm)
        h = self.post_attention_layernorm(x)
        if self.moe is not None:
            out = self.moe(h)
            return x + (out if self.mlp_output_norm is None else self.mlp_output_norm(out))
        return _add_output(self.down_proj, gated(self.gate_up_proj, h, self.act), x, self.mlp_output_norm)

    def forward_fused(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv: torch.Tensor,
                      meta: AttentionMetadata) -> torch.Tensor:
        """The same layer in 9 kernels on a GPU (`gpu_fused`): rope and the cache write in one, the residual
        adds inside the output projections' GEMMs (x += h W^T, in place)."""
        qkv = self.qkv_proj(self.input_layernorm(x))
        q = gpu_fused.rope_and_cache(qkv, cos, sin, meta.slot_mapping, kv[0], kv[1], self.num_heads,
                                     self.num_kv_heads)
        x.addmm_(paged_attention(q, None, None, kv[0], kv[1], meta, self.scale, self.sliding_window),
                 self.o_proj.weight.t())
        h = gpu_fused.swiglu(self.gate_up_proj(self.post_attention_layernorm(x)))
        return x.addmm_(h, self.down_proj.weight.t())


def _add_output(linear: nn.Module, h: torch.Tensor, x: torch.Tensor, norm: nn.Module | None) -> torch.Tensor:
    """x + norm(linear(h)) (no norm: x + linear(h), with our kernel added into x in place: x is the residual
    stream the layer owns)."""
    if norm is not None:
        return x + norm(linear(h))
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
        shape = (config.vocab_size, rank or config.hidden_size)
        # On the meta device its weight is given, so nn.Embedding skips its random init: normal_ there imports
        # torch._dynamo, ~0.8 s of every startup. Elsewhere (a draft trained from scratch) it keeps the init.
        self.embed_tokens = nn.Embedding(*shape, device=device,
                                         _weight=torch.empty(shape, device="meta") if str(device) == "meta" else None)
        self.embed_proj = nn.Linear(rank, config.hidden_size, bias=False, device=device) if rank else None
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False, device=device) \
            if config.eagle else None
        self.layers = nn.ModuleList(DecoderLayer(config, i, device) for i in range(config.num_hidden_layers))
        self.embed_scale = config.hidden_size ** 0.5 if config.family.scale_embeddings else None
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, device)
        head_rows = config.draft_vocab_size or config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, head_rows, bias=False, device=device)
        if config.tie_word_embeddings:
            if config.draft_vocab_size or config.embedding_rank:
                raise ValueError("a reduced-vocabulary head or low-rank embedding cannot be tied")
            self.lm_head.weight = self.embed_tokens.weight
        # Not buffers: `.to(bfloat16)` must not round the cos/sin tables; they follow the input's device.
        # [global] or [global, local] (Gemma 3's sliding layers rotate by a rope of their own).
        self.ropes = [rope_table(config, config.max_position_embeddings, local=local)
                      for local in (False, True)[:1 + has_local_rope(config)]]

    def embed(self, input_ids: torch.Tensor, features: torch.Tensor | None = None) -> torch.Tensor:
        """input_ids [...] -> layer input [..., hidden]. An EAGLE draft also takes `features` [..., hidden]:
        the target's final hidden state at each token's previous position."""
        x = self.embed_tokens(input_ids)
        if self.embed_scale is not None:  # Gemma: the scale rounded to the table's dtype, as the reference
            x = x * torch.tensor(self.embed_scale, dtype=x.dtype)
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
        ropes = [(cos_sin[:, 0, None], cos_sin[:, 1, None]) for cos_sin in self.rope_rows(meta.positions)]
        x = self.embed(input_ids, features)
        if cpu_forward.can_run(self, x, kv_cache, meta):  # the same arithmetic without per-op overhead
            return self.norm(cpu_forward.run_layers(self, x, *ropes[0], kv_cache, meta))
        for layer, kv in zip(self.layers, kv_cache):
            x = layer(x, ropes, kv, meta)
        return self.norm(x)

    def rope_rows(self, positions: torch.Tensor) -> list[torch.Tensor]:
        """Each rope table's rows [..., 2, D/2] (cos, sin) at `positions`, on their device."""
        if self.ropes[0].device != positions.device:
            self.ropes = [table.to(positions.device) for table in self.ropes]
        return [table[positions] for table in self.ropes]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [N, hidden] -> float32 logits [N, vocab] (or [N, draft_vocab_size] for a reduced head),
        soft-capped where the config says (Gemma: cap * tanh(logits / cap))."""
        return self.softcap(self.lm_head(hidden)).float()

    def softcap(self, logits: torch.Tensor) -> torch.Tensor:
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap
