"""The draft ("student"): its config, its initialisation from the target, and a dense causal forward.

Training and teacher forcing run whole windows [B, T] at once, so they use `causal_forward` (one SDPA call
per layer with a causal mask) over the same modules the engine runs with its paged KV cache; the weights
and the math are shared, only the attention plumbing differs.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from specserve.model.config import ModelConfig
from specserve.model.llama import LlamaModel


def causal_forward(model: LlamaModel, ids: torch.Tensor, features: torch.Tensor | None = None,
                   prefix: list | None = None, kv_out: list | None = None) -> torch.Tensor:
    """ids [B, T] (each row a window starting at position 0) -> final hidden states [B, T, hidden].

    EAGLE drafts also take `features` [B, T, hidden] (see LlamaModel.embed). `prefix`: the earlier passes
    over the same positions, each a per-layer list of keys and values [B, T, Hkv, D]; this pass is then draft
    step len(prefix) + 1 at every position, attending to what that step's cache holds at inference
    (`unrolled_mask`). `kv_out` collects this pass's per-layer (keys, values). The layers' own pieces
    (DecoderLayer.attention_inputs, .finish) do everything but attention, so any family's target teaches."""
    b, t = ids.shape
    ropes = [(rows[:, 0, None].repeat(b, 1, 1), rows[:, 1, None].repeat(b, 1, 1))  # [B * T, 1, D/2]
             for rows in model.rope_rows(torch.arange(t, device=ids.device))]
    x = model.embed(ids, features).reshape(b * t, -1)
    causal = unrolled_mask(t, len(prefix), ids.device) if prefix else None
    for i, layer in enumerate(model.layers):
        q, k, v = layer.attention_inputs(x, *ropes[layer.rope_index])
        q = q.reshape(b, t, layer.num_heads, layer.head_dim)
        k, v = (a.reshape(b, t, layer.num_kv_heads, layer.head_dim) for a in (k, v))
        if kv_out is not None:
            kv_out.append((k, v))
        keys = torch.cat([*(kv[i][0] for kv in prefix or ()), k], 1)
        values = torch.cat([*(kv[i][1] for kv in prefix or ()), v], 1)
        mask = causal
        if layer.sliding_window is not None:  # a target's sliding layer (drafts have none, nor a prefix then)
            pos = torch.arange(t, device=ids.device)
            mask = (pos[None] <= pos[:, None]) & (pos[None] > pos[:, None] - layer.sliding_window)
        att = F.scaled_dot_product_attention(q.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                             attn_mask=mask, is_causal=mask is None, scale=layer.scale,
                                             enable_gqa=layer.num_heads != layer.num_kv_heads)
        x = layer.finish(x, att.transpose(1, 2).reshape(b * t, layer.q_size))
    return model.norm(x).reshape(b, t, -1)


def bf16_autocast(t: torch.Tensor):
    """bf16 autocast on t's device: the fast path on CPU and GPU alike (the engine serves drafts in bf16 too)."""
    return torch.autocast(t.device.type, dtype=torch.bfloat16)


def unrolled_mask(t: int, earlier: int, device=None) -> torch.Tensor:
    """[T, (earlier + 1) * T] keys visible to draft step s = earlier + 1 at position j, over the keys of
    passes 1..s (pass i holds step i at every position). At inference step s's row j sees the rows made
    from the target's features up to j - s + 1 (pass 1), then the rows of steps 2..s-1 at j - s + 2 ..
    j - 1 (pass i at j - s + i), then itself."""
    s = earlier + 1
    q = torch.arange(t, device=device)[:, None]
    k = torch.arange(t, device=device)[None, :]
    if s == 1:
        return k <= q
    blocks = [k <= q - s + 1] + [k == q - s + i for i in range(2, s)] + [k == q]
    return torch.cat(blocks, 1)


def draft_config(target: ModelConfig, layers: int, hidden: int, draft_vocab: int | None,
                 embedding_rank: int | None) -> ModelConfig:
    head_dim = 64 if hidden % 64 == 0 else hidden // max(1, hidden // 64)
    heads = hidden // head_dim
    # SwiGLU width ~8/3 of hidden (as Llama and SmolLM2 use), rounded to a multiple of 32 for the GEMMs.
    intermediate = max(32, round(hidden * 8 / 3 / 32) * 32)
    return ModelConfig(
        vocab_size=target.vocab_size, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads, head_dim=head_dim,
        rms_norm_eps=target.rms_norm_eps, rope_theta=target.rope_theta, rope_scaling=target.rope_scaling,
        max_position_embeddings=target.max_position_embeddings, tie_word_embeddings=False,
        architecture="LlamaForCausalLM", bos_token_id=target.bos_token_id,
        eos_token_id=list(target.eos_token_id), draft_vocab_size=draft_vocab,
        embedding_rank=embedding_rank if embedding_rank and embedding_rank < hidden else None)


@torch.no_grad()
def init_small(model: LlamaModel) -> None:
    """Every matrix small and random (std 0.02); residual outputs (o_proj, down_proj) scaled by
    1/sqrt(2 * layers) so a fresh stack starts near the identity."""
    for name, p in model.named_parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.02)
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.mul_((2 * model.config.num_hidden_layers) ** -0.5)


def init_student(target: LlamaModel, config: ModelConfig, vocab_map: torch.Tensor | None,
                 seed: int) -> LlamaModel:
    """Embeddings: the target's input embedding projected onto its top `hidden` singular directions
    (low-rank table = the top `embedding_rank` of them); head rows: the same projection of the target's
    output rows for the kept tokens, so the draft starts out speaking the target's geometry. Layers:
    small random weights, residual outputs scaled by 1/sqrt(2 * layers) so the stack starts near identity."""
    torch.manual_seed(seed)
    model = LlamaModel(config)
    h = config.hidden_size
    emb = target.embed_tokens.weight.detach().float()
    u, s, vh = torch.linalg.svd(emb, full_matrices=False)
    projected = u[:, :h] * s[:h]  # [vocab, hidden]: emb @ vh[:h].T
    out_rows = target.lm_head.weight.detach().float() @ vh[:h].T
    with torch.no_grad():
        init_small(model)
        rank = config.embedding_rank
        if rank:
            model.embed_tokens.weight.copy_(projected[:, :rank])
            model.embed_proj.weight.copy_(torch.eye(h, rank))
        else:
            model.embed_tokens.weight.copy_(projected)
        head = out_rows if vocab_map is None else out_rows[vocab_map]
        # The final RMSNorm output has norm ~sqrt(hidden) and, through near-identity layers, points along
        # the input token's embedding, i.e. along that token's own head row: rows of norm 3/sqrt(hidden)
        # keep the first logits within ~3 instead of a confident "repeat the input" (initial loss ~20).
        model.lm_head.weight.copy_(head / head.norm(dim=-1).mean() * 3 / h ** 0.5)
    return model
