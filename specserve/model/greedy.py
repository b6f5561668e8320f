"""Minimal single-sequence greedy decoding, for checking a model end to end (the engine does the rest)."""
from __future__ import annotations

import torch

from specserve.model.attention import AttentionMetadata, allocate_kv_cache
from specserve.model.llama import LlamaModel


@torch.inference_mode()
def greedy_decode(model: LlamaModel, prompt_ids: list[int], max_new_tokens: int, block_size: int = 16,
                  stop_token_ids: list[int] | None = None) -> list[int]:
    cfg = model.config
    device = model.embed_tokens.weight.device
    num_blocks = -(-(len(prompt_ids) + max_new_tokens) // block_size)
    cache = allocate_kv_cache(cfg.num_hidden_layers, num_blocks, block_size, cfg.num_key_value_heads,
                              cfg.head_dim, model.embed_tokens.weight.dtype, device)
    table = [list(range(num_blocks))]
    tokens, out = list(prompt_ids), []
    new = tokens
    while len(out) < max_new_tokens:
        meta = AttentionMetadata.build([len(new)], [len(tokens)], table, block_size, device)
        hidden = model(torch.tensor(new, device=device), meta, cache)
        next_id = int(model.compute_logits(hidden[-1:]).argmax(-1))
        out.append(next_id)
        tokens.append(next_id)
        new = [next_id]
        if stop_token_ids and next_id in stop_token_ids:
            break
    return out
