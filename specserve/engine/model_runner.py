"""Runs one batched forward of a model over its paged KV cache. Used for the target and the draft."""
from __future__ import annotations

import logging
import os
import time

import torch

from specserve.step_types import ForwardItem
from specserve.model import cpu_draft, gpu_attention
from specserve.model.attention import AttentionMetadata, allocate_kv_cache
from specserve.model.kernels import short_attention_supported
from specserve.model.llama import LlamaModel
from specserve.model.mlp import MoE
from specserve.model.packed_linear import pack_linears

log = logging.getLogger("specserve.engine")


def kv_bytes_per_block(model: LlamaModel, block_size: int, dtype: torch.dtype) -> int:
    c = model.config
    return c.num_hidden_layers * 2 * block_size * c.num_key_value_heads * c.head_dim * dtype.itemsize


def available_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


class ModelRunner:
    def __init__(self, model: LlamaModel, num_blocks: int, block_size: int, max_model_len: int | None = None,
                 enforce_eager: bool = False, max_graph_tokens: int = 512, max_num_seqs: int = 64):
        """On a CUDA GPU with Triton, steps of short queries replay CUDA graphs (`cuda_graphs.py`) unless
        `enforce_eager`; the graphs need `max_model_len` (their block tables' width), cover steps of up to
        `max_graph_tokens` tokens and are captured here (decodes of up to `max_num_seqs` sequences, verifies)."""
        self.model = model  # owned by the runner: its linear layers are packed for inference in place
        pack_linears(model)
        self.config = model.config
        self.block_size, self.num_blocks = block_size, num_blocks
        weight = model.embed_tokens.weight
        self.device, self.dtype = weight.device, weight.dtype
        c = self.config
        on_gpu = gpu_attention.supported(self.dtype, self.device, c.head_dim)
        self.short_kernel = on_gpu or short_attention_supported(self.dtype, self.device)
        # EAGLE drafts take features per token, experts that read their routing on the host cannot be
        # captured: they run eagerly.
        graphs = (on_gpu and not enforce_eager and max_model_len is not None and model.fc is None
                  and all(m.runs_in_cuda_graphs(self.dtype) for m in model.modules() if isinstance(m, MoE)))
        # With graphs, one block more: padding tokens write their keys there (the sink).
        self.kv_cache = allocate_kv_cache(c.num_hidden_layers, num_blocks + graphs, block_size,
                                          c.num_key_value_heads, c.head_dim, self.dtype, self.device)
        self.graphs = None
        if graphs:
            from specserve.engine.cuda_graphs import CudaGraphRunner
            self.graphs = CudaGraphRunner(model, self.kv_cache, block_size, num_blocks,
                                          -(-max_model_len // block_size) + 1, max_graph_tokens)
            t0 = time.perf_counter()
            with torch.inference_mode():  # as forward() runs them
                self.graphs.capture_all(max_num_seqs)
            log.info("CUDA graphs: %d captured in %.1f s (--enforce-eager: none)", len(self.graphs.graphs),
                     time.perf_counter() - t0)

    @torch.inference_mode()
    def draft_chain(self, items: list[ForwardItem], features: torch.Tensor | None, steps: list[int],
                    vocab_map: torch.Tensor | None) -> torch.Tensor | None:
        """A draft model's greedy chain in one call (model/cpu_draft.py): items' rows as in `forward` (host
        tokens only), item i then drafting steps[i] tokens from the argmax at its last row. Returns [items,
        max(steps)] target ids (-1 past steps[i]), or None where the chain cannot run (then use `forward`)."""
        chain = cpu_draft.chain_for(self.model, self.kv_cache, self.block_size, vocab_map)
        if chain is None or any(it.num_device_tokens for it in items):
            return None
        meta = AttentionMetadata.build([it.num_tokens for it in items], [it.ctx_len for it in items],
                                       [it.block_table for it in items], self.block_size, self.device,
                                       self.short_kernel)
        if meta.short is None or meta.short.num_tokens != sum(it.num_tokens for it in items):
            return None
        ids = torch.tensor([t for it in items for t in it.token_ids], dtype=torch.long)
        last, end = [], 0
        for it in items:
            end += it.num_tokens
            last.append(end - 1)
        return cpu_draft.run_chain(chain, self.dtype, ids, features, meta, last, [it.block_table for it in items],
                                   steps)

    @torch.inference_mode()
    def forward(self, items: list[ForwardItem], features: torch.Tensor | None = None,
                all_hidden: bool = False, device_ids: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns (logits [R, vocab] float32, hidden [R, hidden]) for the requested rows, in item order;
        with `all_hidden`, hidden is [T, hidden] for every new token instead. features: [T, hidden], the
        per-token input of an EAGLE draft. device_ids: [sum of num_device_tokens] token ids already on the
        device (drafts), placed after each item's host tokens."""
        if self.graphs is not None and self.graphs.can_run(items, features):
            return self.graphs.forward(items, all_hidden, device_ids)
        meta = AttentionMetadata.build([it.num_tokens for it in items], [it.ctx_len for it in items],
                                       [it.block_table for it in items], self.block_size, self.device,
                                       self.short_kernel)
        ids = torch.tensor([t for it in items for t in it.token_ids + [0] * it.num_device_tokens],
                           dtype=torch.long, device=self.device)
        if device_ids is not None and len(device_ids):
            slots, start = [], 0
            for it in items:
                slots.extend(range(start + len(it.token_ids), start + it.num_tokens))
                start += it.num_tokens
            ids[torch.tensor(slots, dtype=torch.long, device=self.device)] = device_ids
        hidden = self.model(ids, meta, self.kv_cache, features)
        rows, end = [], 0
        for it in items:
            end += it.num_tokens
            rows.extend(range(end - it.num_logits, end))
        if len(rows) == hidden.shape[0]:
            selected = hidden
        else:
            selected = hidden[torch.tensor(rows, dtype=torch.long, device=self.device)]
        return self.model.compute_logits(selected), hidden if all_hidden else selected
