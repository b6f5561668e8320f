"""Quantized weights at load: a GGUF file's own blocks ("gguf"), or a checkpoint quantized to Q8_0/Q4_0/Q4_1.

The linear layers of the decoder (fused q/k/v, o, fused gate/up, down; a mixture's experts, one pair each,
and its shared expert), the LM head and an EAGLE draft's input projection become KernelLinear modules that
read the blocks directly (`cpu_linear.py`); a router stays dense (llama.cpp keeps it in float too); the
embedding stays a dense table in the model's dtype (a step reads only a few of its rows). Where the kernel
cannot run (no C compiler, SPECSERVE_CPU_KERNELS=0, a GPU), the layers stay nn.Linear holding the
dequantized values, so a model computes the same function either way, up to accumulation order.
"""
from __future__ import annotations

import logging
from collections import Counter

import numpy as np
import torch
from torch import nn

from specserve.errors import ModelLoadError
from specserve.model.cpu_linear import (QUANT_FORMATS, KernelLinear, StackedKernelLinear, dequantize_gguf,
                                        kernel_can_run, quantize)
from specserve.model.mlp import MoE, set_experts

log = logging.getLogger("specserve.quantize")

QUANTIZATIONS = ("gguf", "q8_0", "q4_0", "q4_1")  # what --quantization accepts
LAYER_LINEARS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


def _targets(model: nn.Module) -> dict[str, nn.Linear]:
    """Our module path -> nn.Linear, for every matrix that quantization replaces (but a mixture's experts,
    which are not modules: quantize_model takes them one by one)."""
    out = {}
    for i, layer in enumerate(model.layers):
        modules = {name: layer._modules.get(name) for name in LAYER_LINEARS}
        if layer.moe is not None and layer.moe.shared_expert is not None:
            modules |= {f"moe.shared_expert.{name}": getattr(layer.moe.shared_expert, name)
                        for name in ("gate_up_proj", "down_proj")}
        out |= {f"layers.{i}.{name}": m for name, m in modules.items()}
    out["lm_head"] = model.lm_head
    out["fc"] = getattr(model, "fc", None)  # an EAGLE draft's input projection (GGUF files hold none: dense)
    return {path: m for path, m in out.items() if isinstance(m, nn.Linear)}


def _gguf_groups(g, config) -> dict[str, list[tuple[str, int | None]]]:
    """Our module path -> the GGUF tensors its rows come from, in order, each with the head count that
    undoes llama.cpp's Q/K permutation (None: none). A layer's stacked experts are one group under
    "layers.i.moe.experts" (gate, up, down: [experts, rows, bytes] each)."""
    out = {}
    for i in range(config.num_hidden_layers):
        b, p = f"blk.{i}.", f"layers.{i}."
        groups = {"qkv_proj": [(b + "attn_q.weight", config.num_attention_heads),
                               (b + "attn_k.weight", config.num_key_value_heads), (b + "attn_v.weight", None)],
                  "o_proj": [(b + "attn_output.weight", None)], "down_proj": [(b + "ffn_down.weight", None)],
                  "gate_up_proj": [(b + "ffn_gate.weight", None), (b + "ffn_up.weight", None)],
                  "moe.shared_expert.gate_up_proj": [(b + "ffn_gate_shexp.weight", None),
                                                     (b + "ffn_up_shexp.weight", None)],
                  "moe.shared_expert.down_proj": [(b + "ffn_down_shexp.weight", None)],
                  "moe.experts": [(b + f"ffn_{n}_exps.weight", None) for n in ("gate", "up", "down")]}
        out |= {p + name: parts for name, parts in groups.items()}
    out["lm_head"] = [("output.weight" if any(t.name == "output.weight" for t in g.tensors)
                       else "token_embd.weight", None)]
    return out


def _in_kernel_format(tensors: dict, names: list[tuple[str, int | None]]) -> bool:
    return all(name in tensors and tensors[name].tensor_type.name.lower() in QUANT_FORMATS for name, _ in names)


def gguf_kernel_tensors(g, config) -> set[str]:
    """The GGUF tensors that quantize_model(..., "gguf") takes as blocks (the loader need not dequantize
    them: their values never reach the model); the token embedding, a dense table, is not one of them."""
    tensors = {t.name: t for t in g.tensors}
    return {name for names in _gguf_groups(g, config).values() if _in_kernel_format(tensors, names)
            for name, _ in names} - {"token_embd.weight"}


def _gguf_blocks(g, config) -> dict[str, list[tuple[str, np.ndarray]]]:
    """GGUF tensors in our fused layout, as parts [(format, blocks [rows, bytes])] in row order, consecutive
    tensors of one format merged (a _M file's q/k/v: [("q4_k", q and k), ("q6_k", v)]), where every tensor is
    in a format the kernel reads; other matrices (float, other formats) are absent (they load dense). Expert
    e of layer i's MoE: "layers.i.moe.experts.e.gate_up" and ".down"."""
    from specserve.model.gguf_convert import _unpermute
    tensors = {t.name: t for t in g.tensors}
    unpermute = config.family.permuted_qk_in_gguf

    def part(name: str, heads: int | None):
        t = tensors[name]
        data = np.asarray(t.data)
        return t.tensor_type.name.lower(), (_unpermute(data, heads) if unpermute and heads else data)

    def merged(parts: list) -> list:
        out = []
        for fmt, data in parts:
            if out and out[-1][0] == fmt:
                out[-1] = (fmt, np.concatenate([out[-1][1], data]))
            else:
                out.append((fmt, data))
        return out

    out = {}
    for path, names in _gguf_groups(g, config).items():
        if not _in_kernel_format(tensors, names):
            continue
        parts = [part(name, heads) for name, heads in names]
        if not path.endswith("moe.experts"):
            out[path] = merged(parts)
            continue
        (gate_fmt, gate), (up_fmt, up), (down_fmt, down) = parts
        for e in range(config.num_experts):
            out[f"{path}.{e}.gate_up"] = merged([(gate_fmt, gate[e]), (up_fmt, up[e])])
            out[f"{path}.{e}.down"] = [(down_fmt, down[e])]
    return out


def quantize_model(model: nn.Module, quantization: str, gguf_file=None) -> Counter:
    """Replace the model's matrices (in place) by quantized ones. quantization: "gguf" (the blocks of
    `gguf_file`, a GGUFFile the model was loaded from) or a format to quantize the loaded weights to.
    Returns how many matrices took each format."""
    if quantization not in QUANTIZATIONS:
        raise ModelLoadError(f"unknown quantization {quantization!r} (choose from {', '.join(QUANTIZATIONS)})")
    if quantization == "gguf" and gguf_file is None:
        raise ModelLoadError("quantization 'gguf' needs a .gguf model (or an alias of one)")
    targets = _targets(model)
    moes = {f"layers.{i}.moe": layer.moe for i, layer in enumerate(model.layers)
            if layer.moe is not None and layer.moe.experts is None}
    use_kernel = (all(kernel_can_run(m.weight) for m in targets.values())
                  and all(kernel_can_run(moe.gate_up) for moe in moes.values()))
    if not use_kernel:
        log.warning("CPU linear kernel unavailable: %s weights are dequantized (same values, dense speed)",
                    quantization)
    blocks = _gguf_blocks(gguf_file, model.config) if quantization == "gguf" else {}
    formats = Counter()
    for path, linear in targets.items():
        parts = _parts(path, linear.weight, quantization, blocks)
        fmt = "dense" if parts is None else "+".join(part_fmt for part_fmt, _ in parts)
        formats[fmt] += 1
        if parts is None:
            continue
        if use_kernel:
            name = path.rsplit(".", 1)[-1]
            module = _kernel_linear(parts, linear.in_features, linear.bias, interleave=name == "gate_up_proj")
            parent = model.get_submodule(path.rsplit(".", 1)[0]) if "." in path else model
            setattr(parent, name, module)
        elif linear.weight is getattr(model.embed_tokens, "weight", None):  # tied: untie, the table stays
            linear.weight = nn.Parameter(_dequantized(parts, linear.in_features).to(linear.weight.dtype),
                                         requires_grad=False)
        else:
            with torch.no_grad():
                linear.weight.copy_(_dequantized(parts, linear.in_features))
    for path, moe in moes.items():
        experts = []
        for e in range(moe.num_experts):
            pair = []
            for name, weight in (("gate_up", moe.gate_up[e]), ("down", moe.down[e])):
                parts = _parts(f"{path}.experts.{e}.{name}", weight, quantization, blocks)
                formats["dense" if parts is None else "+".join(part_fmt for part_fmt, _ in parts)] += 1
                if not use_kernel:
                    if parts is not None:
                        with torch.no_grad():
                            weight.copy_(_dequantized(parts, weight.shape[1]))
                elif parts is None:
                    pair.append(KernelLinear.from_weight(weight.detach(), interleave=name == "gate_up"))
                else:
                    pair.append(_kernel_linear(parts, weight.shape[1], None, interleave=name == "gate_up"))
            experts.append(pair)
        if use_kernel:
            set_experts(moe, experts)
    return formats


def _parts(path: str, weight: torch.Tensor, quantization: str, blocks: dict) -> list[tuple[str, torch.Tensor]] | None:
    """The blocks a matrix [out, in] takes: the GGUF file's (writable copies: the file is mapped read-only), or
    the weight quantized; None where it stays dense (not in the file's kernel formats; inputs not a multiple
    of the 32-weight block)."""
    if quantization == "gguf":
        if path not in blocks:
            return None
        parts = [(fmt, torch.from_numpy(np.array(raw))) for fmt, raw in blocks[path]]
    elif weight.shape[1] % 32:
        return None
    else:
        parts = [(quantization, quantize(weight, quantization))]
    rows = sum(data.shape[0] for _, data in parts)
    if rows != weight.shape[0]:
        fmt = "+".join(part_fmt for part_fmt, _ in parts)
        raise ModelLoadError(f"{path}: {fmt} blocks hold {rows} rows, the model expects {weight.shape[0]}")
    return parts


def _dequantized(parts: list[tuple[str, torch.Tensor]], in_features: int) -> torch.Tensor:
    return torch.cat([dequantize_gguf(data, fmt, in_features) for fmt, data in parts])


def _kernel_linear(parts: list[tuple[str, torch.Tensor]], in_features: int, bias: torch.Tensor | None,
                   interleave: bool) -> nn.Module:
    """One KernelLinear, or a StackedKernelLinear of one per part (rows of different formats: never interleaved,
    a gate/up pair would straddle two parts)."""
    if len(parts) == 1:
        (fmt, data), = parts
        return KernelLinear.from_gguf_blocks(data, fmt, in_features, bias, interleave=interleave)
    modules, row = [], 0
    for fmt, data in parts:
        part_bias = None if bias is None else bias[row:row + data.shape[0]]
        modules.append(KernelLinear.from_gguf_blocks(data, fmt, in_features, part_bias))
        row += data.shape[0]
    return StackedKernelLinear(modules)


def weight_summary(model: nn.Module) -> str:
    """e.g. "q4_1 x 120, q8_0 x 1: 70.3 MB of matrices" (what a token's forward reads, but for the experts
    of a mixture, of which a token reads its own)."""
    formats, nbytes = Counter(), 0
    for m in model.modules():
        if isinstance(m, MoE) and m.experts is None:  # stacked experts, not modules
            formats[str(m.down.dtype).removeprefix("torch.")] += 2 * m.num_experts
            nbytes += sum(w.numel() * w.element_size() for w in (m.gate_up, m.down))
        if isinstance(m, KernelLinear):
            formats[m.source_fmt + (" (int8 dot)" if m.fmt != m.source_fmt else "")] += 1
            nbytes += m.weight_bytes
        elif isinstance(m, nn.Linear):
            formats[str(m.weight.dtype).removeprefix("torch.")] += 1
            nbytes += m.weight.numel() * m.weight.element_size()
    kinds = ", ".join(f"{k} x {n}" for k, n in formats.most_common())
    return f"{kinds}: {nbytes / 1e6:.1f} MB of matrices"
