"""Gemma 3 (text): RMSNorms that scale by (1 + w), on the attention and MLP outputs too (four per layer),
q/k norms, embeddings times sqrt(hidden), a GeGLU MLP (gelu_pytorch_tanh), attention scaled by
query_pre_attn_scalar^-1/2, and sliding-window layers interleaved with global ones (5 to 1), each kind
with its own rope: the sliding layers' base 10k unscaled, the global layers' 1M with the model's scaling.
llama.cpp stores the norms as 1 + w already and derives the attention scale from the model size."""
from specserve.errors import ModelLoadError
from specserve.model.family import Family

PATTERN = 6  # every 6th layer global (sliding_window_pattern, llama.cpp's fixed value for gemma3)


def _layer_types(layers: int, pattern: int) -> list[str]:
    return ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]


def _from_hf(d: dict) -> dict:
    if d.get("attn_logit_softcapping") is not None:
        raise ModelLoadError("attention logit softcapping (Gemma 2) is not supported")
    if d.get("use_bidirectional_attention"):
        raise ModelLoadError("bidirectional attention (an embedding model) is not supported")
    rope = d.get("rope_parameters") or {}
    full, sliding = rope.get("full_attention") or {}, rope.get("sliding_attention") or {}
    scaling = d.get("rope_scaling")
    if scaling is None and full.get("rope_type", "default") != "default":
        scaling = {k: v for k, v in full.items() if k != "rope_theta"}
    pattern = d.get("sliding_window_pattern") or d.get("_sliding_window_pattern") or PATTERN
    return dict(
        hidden_act=d.get("hidden_activation") or d.get("hidden_act") or "gelu_pytorch_tanh",
        rope_theta=float(full.get("rope_theta", d.get("rope_theta", 1_000_000.0))),
        rope_scaling=scaling,
        rope_local_base_freq=float(sliding.get("rope_theta", d.get("rope_local_base_freq", 10_000.0))),
        layer_types=d.get("layer_types") or _layer_types(d["num_hidden_layers"], pattern),
        query_pre_attn_scalar=d.get("query_pre_attn_scalar", 256),
        tie_word_embeddings=bool(d.get("tie_word_embeddings", True)),
        sliding_window=d.get("sliding_window", 4096))


def _from_gguf(g, arch: str) -> dict:
    layers, hidden = g.require(f"{arch}.block_count"), g.require(f"{arch}.embedding_length")
    heads = g.require(f"{arch}.attention.head_count")
    head_dim = g.get(f"{arch}.attention.key_length") or hidden // heads
    pattern = g.get(f"{arch}.attention.sliding_window_pattern")
    if isinstance(pattern, list):  # newer files: one flag per layer, true where it slides
        types = ["sliding_attention" if p else "full_attention" for p in pattern]
    else:
        types = _layer_types(layers, pattern or PATTERN)
    return dict(
        hidden_act="gelu_pytorch_tanh",
        layer_types=types,
        rope_local_base_freq=float(g.get(f"{arch}.rope.freq_base_swa", 10_000.0)),
        query_pre_attn_scalar=_query_pre_attn_scalar(g, arch, layers, hidden // heads, head_dim),
        sliding_window=g.require(f"{arch}.attention.sliding_window"))


def _query_pre_attn_scalar(g, arch: str, layers: int, width: int, head_dim: int) -> float:
    """From the file's attention scale where it has one, else as llama.cpp derives it: hidden / heads for the
    27B (62 layers), head_dim for the others."""
    scale = g.get(f"{arch}.attention.scale")
    if scale:
        return scale ** -2
    return width if layers == 62 else head_dim


FAMILY = Family("Gemma3ForCausalLM", "gemma3_text", gguf_arch="gemma3", qk_norm=True, sandwich_norms=True,
                norm_offset=1.0, scale_embeddings=True,
                hf_names={"post_attention_layernorm": "pre_feedforward_layernorm",
                          "attention_output_norm": "post_attention_layernorm",
                          "mlp_output_norm": "post_feedforward_layernorm"},
                from_hf=_from_hf, from_gguf=_from_gguf)
