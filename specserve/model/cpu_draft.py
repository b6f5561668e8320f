"""A draft model's whole chain of greedy draft steps in one call into the C kernels (`kernels/draft_chain.c`).

Why: from Python each draft step is a forward, an argmax and the next step's inputs, ~30 torch and ctypes
calls; on a one-layer EAGLE draft that overhead was as large as the step's arithmetic. The chain runs the
same kernels as `cpu_forward.run_layers` and `KernelLinear` (the draft's layers, its input projection and
head), so the drafted tokens are the same as drafted step by step (tests/model/test_cpu_draft.py).
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from specserve.model import cpu_forward, kernels
from specserve.model.cpu_linear import KernelLinear
from specserve.model.cpu_forward import LinearArgs


class DraftArgs(ctypes.Structure):  # kernels/draft_chain.c's DraftArgs
    _fields_ = [("embed", ctypes.c_void_p), ("fc", LinearArgs), ("layers", ctypes.c_void_p),
                ("num_layers", ctypes.c_int32), ("norm", ctypes.c_void_p), ("norm_eps", ctypes.c_float),
                ("head", LinearArgs), ("vocab_map", ctypes.c_void_p), ("rope", ctypes.c_void_p),
                ("hidden", ctypes.c_int32), ("H", ctypes.c_int32), ("Hkv", ctypes.c_int32), ("D", ctypes.c_int32),
                ("inter", ctypes.c_int32), ("block_size", ctypes.c_int32), ("window", ctypes.c_int32),
                ("kv_base", ctypes.c_void_p), ("cache_bytes", ctypes.c_int64)]


@dataclass(slots=True)
class Chain:
    """What the chain needs of one draft model and its cache, made once (the pointers stay valid while the
    model's weights and the cache live: `keep` holds what they point into)."""
    args: DraftArgs
    keep: list


def _linear(m) -> LinearArgs:
    w, fmt, row_bytes, n, k, kp = m.c_args
    return LinearArgs(w, row_bytes, m.bias_ptr, fmt, n, k, kp, None)


def chain_for(model, kv_cache: torch.Tensor, block_size: int, vocab_map: torch.Tensor | None) -> Chain | None:
    """The model's chain, or None where it cannot run: every projection on the kernels (the layers as the
    one-call forward takes them, the head and an EAGLE input projection KernelLinear), a dense token
    embedding of the activations' dtype, no low-rank or scaled embedding, no logit softcapping (Llama's
    layout, which every EAGLE draft has), CPU tensors, the kernels built."""
    embed = model.embed_tokens.weight
    entry = cpu_forward._entry(model)
    if not (kernels.available() and embed.device.type == "cpu" and embed.dtype in kernels.DTYPES
            and kv_cache.dtype == embed.dtype and entry.plan is not None and model.embed_proj is None
            and model.embed_scale is None and not model.config.final_logit_softcapping
            and isinstance(model.lm_head, KernelLinear) and (model.fc is None or isinstance(model.fc, KernelLinear))
            and model.lm_head.bias_ptr is None and embed.is_contiguous() and kv_cache.is_contiguous()):
        return None
    cached = model.__dict__.get("_cpu_draft")
    key = (id(entry), kv_cache.data_ptr(), None if vocab_map is None else vocab_map.data_ptr())
    if cached is not None and cached[0] == key:
        return cached[1]
    first, c = model.layers[0], model.config
    vmap = None if vocab_map is None else vocab_map.to(torch.int64).contiguous()
    rope = model.ropes[0].contiguous()  # one table: the layers share one window (cpu_forward checks it)
    args = DraftArgs(embed.data_ptr(), _linear(model.fc) if model.fc is not None else LinearArgs(),
                     ctypes.addressof(entry.plan), len(entry.plan), model.norm.weight.data_ptr(), model.norm.eps,
                     _linear(model.lm_head), None if vmap is None else vmap.data_ptr(), rope.data_ptr(),
                     c.hidden_size, first.num_heads, first.num_kv_heads, first.head_dim,
                     first.gate_up_proj.out_features // 2, block_size, first.sliding_window or 0,
                     kv_cache.data_ptr(), kv_cache[0, 0].numel() * kv_cache.element_size())
    chain = Chain(args, [entry, vmap, rope])
    model._cpu_draft = (key, chain)
    return chain


def run_chain(chain: Chain, dtype: torch.dtype, ids: torch.Tensor, features: torch.Tensor | None, meta,
              last_rows: list[int], tables: list[list[int]], steps: list[int]) -> torch.Tensor:
    """Every draft step of a batch in one call. Step 0's rows: ids [T] (each sequence's new tokens, in order),
    features [T, hidden] (an EAGLE draft's; None for a standalone draft), meta (their AttentionMetadata,
    with every row in the C kernel's short queries); per sequence, the row whose head output is its first
    draft (last_rows), its block table (holding every drafted position) and how many it drafts (steps, 0:
    its rows only fill the cache). Returns [S, max(steps)] int64: the target ids drafted (-1 past steps[i])."""
    S, k = len(steps), max(steps, default=0)
    width = max(map(len, tables), default=1) or 1
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    out = torch.empty(S, k, dtype=torch.long)
    as_int32 = lambda values: torch.tensor(values, dtype=torch.int32)  # noqa: E731
    rows_at, wanted = as_int32(last_rows), as_int32(steps)
    short = meta.short
    feats = None if features is None else features.to(dtype).contiguous()
    status = kernels.function("draft_chain", dtype)(
        ctypes.addressof(chain.args), ids.shape[0], ids.data_ptr(), None if feats is None else feats.data_ptr(),
        meta.positions.data_ptr(), meta.slot_mapping.data_ptr(), short.seqs.shape[1], short.seqs.data_ptr(),
        short.block_tables.data_ptr(), short.block_tables.shape[1], S, rows_at.data_ptr(), table.data_ptr(),
        width, wanted.data_ptr(), k, out.data_ptr(), torch.get_num_threads())
    if status:
        raise MemoryError("CPU kernels: out of memory for the draft chain's buffers")
    return out
