"""What sets one model family's decoder apart from Llama's: a few switches the shared decoder (llama.py),
the checkpoint loader (weights.py) and the GGUF reader (gguf_convert.py) read.

A family is one file in this folder defining a `Family`, plus its row in `families.py`. The decoder layer
is one code path: attention (q/k norms, window, rope kind, scale), norms (RMSNorm, Gemma's 1 + w) and
the MLP (dense SwiGLU/GeGLU or a mixture of experts, `moe.py`) are chosen by these switches and the
config's numbers, never by a per-family copy of the layer.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

# Our per-layer module names (after "layers.N.") -> the Hugging Face names (after "model.layers.N.") of
# Llama-layout checkpoints; a family's `hf_names` overrides some.
LLAMA_HF_NAMES = {
    "input_layernorm": "input_layernorm",
    "post_attention_layernorm": "post_attention_layernorm",  # the norm in front of the MLP
    "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm",
    "q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
    "o_proj": "self_attn.o_proj",
    "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj", "down_proj": "mlp.down_proj",
    # mixture of experts: the router, expert e's matrices, a shared expert and its sigmoid gate
    "router": "mlp.gate",
    "expert_gate": "mlp.experts.{e}.gate_proj", "expert_up": "mlp.experts.{e}.up_proj",
    "expert_down": "mlp.experts.{e}.down_proj",
    "shared_gate_proj": "mlp.shared_expert.gate_proj", "shared_up_proj": "mlp.shared_expert.up_proj",
    "shared_down_proj": "mlp.shared_expert.down_proj", "shared_expert_gate": "mlp.shared_expert_gate",
}


@dataclass(frozen=True, slots=True)
class Family:
    architecture: str                 # config.json's architectures[0]
    model_type: str                   # config.json's model_type
    gguf_arch: str | None = None      # general.architecture of its GGUF files (None: not read from GGUF)
    moe: bool = False                 # its MLPs are mixtures of experts (tells GGUF "llama" Mixtral from Llama)
    qk_norm: bool = False             # RMSNorm over each query and key head before rope (Qwen3, Gemma 3)
    sandwich_norms: bool = False      # RMSNorm on the attention and the MLP outputs too (Gemma)
    norm_offset: float = 0.0          # norms scale by (norm_offset + w): Gemma's 1 + w, added to w at load
    scale_embeddings: bool = False    # embeddings times sqrt(hidden) (Gemma)
    attention_bias: bool = False      # q/k/v biases unless config.json says (Qwen2)
    permuted_qk_in_gguf: bool = False  # llama.cpp's converter interleaves Q/K rows for its "llama" arch
    hf_names: dict[str, str] = field(default_factory=dict)  # overrides of LLAMA_HF_NAMES
    # config.json -> ModelConfig fields this family reads its own way (after the common ones, config.py)
    from_hf: Callable[[dict], dict] | None = None
    # GGUF metadata (a GGUFFile, its arch prefix) -> the same, for the GGUF reader
    from_gguf: Callable[..., dict] | None = None

    def hf_name(self, ours: str) -> str:
        return self.hf_names.get(ours) or LLAMA_HF_NAMES[ours]
