"""Hugging Face checkpoint names <-> our fused parameters, and safetensors I/O."""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from specserve.errors import ModelLoadError
from specserve.model.llama import LlamaModel


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
    """Copy HF-named tensors into the model, fusing q/k/v and gate/up. Missing or misshaped -> error."""
    cfg = model.config
    hf = {k.removeprefix("model."): v for k, v in hf.items()}

    def take(name: str) -> torch.Tensor:
        if name not in hf:
            raise ModelLoadError(f"checkpoint has no tensor {name!r}")
        return hf[name]

    ours: dict[str, torch.Tensor] = {"norm.weight": take("norm.weight")}
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
    for i in range(cfg.num_hidden_layers):
        p = f"layers.{i}."
        ours[p + "input_layernorm.weight"] = take(p + "input_layernorm.weight")
        ours[p + "post_attention_layernorm.weight"] = take(p + "post_attention_layernorm.weight")
        ours[p + "qkv_proj.weight"] = torch.cat(
            [take(p + f"self_attn.{n}_proj.weight") for n in "qkv"])
        if cfg.attention_bias:
            ours[p + "qkv_proj.bias"] = torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"])
        ours[p + "o_proj.weight"] = take(p + "self_attn.o_proj.weight")
        ours[p + "gate_up_proj.weight"] = torch.cat(
            [take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")])
        ours[p + "down_proj.weight"] = take(p + "mlp.down_proj.weight")
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
    """Our parameters under Hugging Face names (un-fused), for saving a checkpoint transformers reads."""
    cfg = model.config
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
