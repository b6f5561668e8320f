"""The model families we serve: architecture name (config.json's architectures[0]) -> its Family.

Llama, Mistral and Qwen2 are the plain decoder (their rows are all it takes); each other family is one
file here. Adding one: a file defining its Family (model/family.py says what the switches mean), a row
below, and a test against transformers (tests/model/test_families.py).
"""
from __future__ import annotations

from specserve.model import gemma3, mixtral, qwen2_moe, qwen3, qwen3_moe
from specserve.model.family import Family

FAMILIES: dict[str, Family] = {f.architecture: f for f in (
    Family("LlamaForCausalLM", "llama", gguf_arch="llama", permuted_qk_in_gguf=True),
    Family("MistralForCausalLM", "mistral"),
    Family("Qwen2ForCausalLM", "qwen2", gguf_arch="qwen2", attention_bias=True),
    qwen3.FAMILY,
    qwen3_moe.FAMILY,
    qwen2_moe.FAMILY,
    mixtral.FAMILY,
    gemma3.FAMILY,
)}
MODEL_TYPES = {f.model_type: f.architecture for f in FAMILIES.values()}  # for a config.json without architectures
