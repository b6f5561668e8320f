"""Hugging Face checkpoint names <-> our fused parameters, and safetensors I/O."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from specserve.errors import ModelLoadError
from specserve.model.llama import LlamaModel

# Each layer's norms (our names), where the family has them.
NORMS = ("input_layernorm", "post_attention_layernorm", "q_norm", "k_norm", "attention_output_norm", "mlp_output_norm")


def read_safetensors(model_dir: Path) -> dict[str, torch.Tensor]:
    """model.safetensors, or the shards listed in model.safetensors.index.json."""
    single, index = model_dir / "model.safetensors", model_dir / "model.safetensors.index.json"
    if single.exists():
        files = [single]
    elif index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise ModelLoadError(f"corrupt shard index {index}: {e}") from None
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
    else:
        raise ModelLoadError(f"no model.safetensors or model.safetensors.index.json in {model_dir}")
    tensors = {}
    for f in files:
        if not f.exists():
            raise ModelLoadError(f"missing weights file {f}")
        try:
            tensors.update(load_file(str(f)))
        except (SafetensorError, OSError) as e:
            raise ModelLoadError(f"corrupt safetensors file {f}: {e}") from None
    return tensors


def load_hf_state_dict(model: LlamaModel, hf: dict[str, torch.Tensor]) -> None:
    """Copy HF-named tensors into the model, fusing q/k/v, gate/up and stacking experts; the family names
    them (model/family.py) and its norm offset is added here (Gemma's 1 + w, in float32 as the reference
    computes it). Missing or misshaped -> error."""
    cfg, family = model.config, model.config.family
    hf = {k.removeprefix("model."): v for k, v in hf.items()}

    def take(name: str) -> torch.Tensor:
        if name not in hf:
            raise ModelLoadError(f"checkpoint has no tensor {name!r}")
        return hf[name]

    def norm(name: str) -> torch.Tensor:
        return take(name).float() + family.norm_offset if family.norm_offset else take(name)

    ours: dict[str, torch.Tensor] = {"norm.weight": norm("norm.weight")}
    if not cfg.eagle or "embed_tokens.weight" in hf:  # an EAGLE draft reads the target's embedding
        ours["embed_tokens.weight"] = take("embed_tokens.weight")
    if cfg.eagle:
        ours["fc.weight"] = take("fc.weight")
    if cfg.embedding_rank:
        ours["embed_proj.weight"] = take("embed_proj.weight")
    if cfg.tie_word_embeddings and "lm_head.weight" not in hf:
        ours["lm_head.weight"] = ours["embed_tokens.weight"]
    else:
        ours["lm_head.weight"] = take("lm_head.weight")
    for i, layer in enumerate(model.layers):
        p = f"layers.{i}."

        def w(name: str, expert: int | None = None, kind: str = "weight") -> torch.Tensor:
            return take(p + family.hf_name(name).format(e=expert) + "." + kind)

        for name in NORMS:
            if getattr(layer, name) is not None:
                ours[p + name + ".weight"] = norm(p + family.hf_name(name) + ".weight")
        ours[p + "qkv_proj.weight"] = torch.cat([w(n) for n in ("q_proj", "k_proj", "v_proj")])
        if cfg.attention_bias:
            ours[p + "qkv_proj.bias"] = torch.cat([w(n, kind="bias") for n in ("q_proj", "k_proj", "v_proj")])
        ours[p + "o_proj.weight"] = w("o_proj")
        if layer.moe is None:
            ours[p + "gate_up_proj.weight"] = torch.cat([w("gate_proj"), w("up_proj")])
            ours[p + "down_proj.weight"] = w("down_proj")
            continue
        experts = range(cfg.num_experts)
        ours[p + "moe.router.weight"] = w("router")
        ours[p + "moe.gate_up"] = torch.stack([torch.cat([w("expert_gate", e), w("expert_up", e)]) for e in experts])
        ours[p + "moe.down"] = torch.stack([w("expert_down", e) for e in experts])
        if layer.moe.shared_expert is not None:
            ours[p + "moe.shared_expert.gate_up_proj.weight"] = torch.cat([w("shared_gate_proj"), w("shared_up_proj")])
            ours[p + "moe.shared_expert.down_proj.weight"] = w("shared_down_proj")
            ours[p + "moe.shared_expert_gate.weight"] = w("shared_expert_gate")
    params = dict(model.named_parameters(remove_duplicate=False))
    for name, tensor in ours.items():
        if name not in params:
            continue
        if params[name].shape != tensor.shape:
            raise ModelLoadError(f"tensor {name} has shape {tuple(tensor.shape)}, "
                                 f"config expects {tuple(params[name].shape)}")
        with torch.no_grad():
            params[name].copy_(tensor)


def hf_state_dict(model: LlamaModel) -> dict[str, torch.Tensor]:
    """Our parameters under Hugging Face names (un-fused), for saving a checkpoint transformers reads: a
    Llama-layout model (the tiny test models, drafts), not the other families' layers."""
    cfg = model.config
    if not all(layer.plain for layer in model.layers):
        raise ValueError(f"saving a {cfg.architecture} checkpoint is not supported (Llama-layout models only)")
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    out = {"model.norm.weight": sd["norm.weight"]}
    if cfg.eagle:
        out["model.fc.weight"] = sd["fc.weight"]
    else:
        out["model.embed_tokens.weight"] = sd["embed_tokens.weight"]
    if cfg.embedding_rank:
        out["model.embed_proj.weight"] = sd["embed_proj.weight"]
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = sd["lm_head.weight"]
    q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
    for i in range(cfg.num_hidden_layers):
        p, hp = f"layers.{i}.", f"model.layers.{i}."
        out[hp + "input_layernorm.weight"] = sd[p + "input_layernorm.weight"]
        out[hp + "post_attention_layernorm.weight"] = sd[p + "post_attention_layernorm.weight"]
        for n, w in zip("qkv", sd[p + "qkv_proj.weight"].split([q, kv, kv])):
            out[hp + f"self_attn.{n}_proj.weight"] = w
        if cfg.attention_bias:
            for n, b in zip("qkv", sd[p + "qkv_proj.bias"].split([q, kv, kv])):
                out[hp + f"self_attn.{n}_proj.bias"] = b
        out[hp + "self_attn.o_proj.weight"] = sd[p + "o_proj.weight"]
        gate, up = sd[p + "gate_up_proj.weight"].chunk(2)
        out[hp + "mlp.gate_proj.weight"], out[hp + "mlp.up_proj.weight"] = gate, up
        out[hp + "mlp.down_proj.weight"] = sd[p + "down_proj.weight"]
    return {k: v.contiguous() for k, v in out.items()}


def save_hf_weights(tensors: dict[str, torch.Tensor], model_dir: Path) -> None:
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(model_dir / "model.safetensors"),
              metadata={"format": "pt"})
