"""Qwen3 (dense): Qwen2's decoder without q/k/v biases, an RMSNorm over each query and key head before rope,
and a head_dim of its own (Qwen3-0.6B: 16 heads of 128 in a hidden size of 1024)."""
from specserve.model.family import Family

FAMILY = Family("Qwen3ForCausalLM", "qwen3", gguf_arch="qwen3", qk_norm=True)
