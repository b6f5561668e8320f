"""Qwen2-MoE (Qwen1.5-MoE-A2.7B): Qwen2's attention (q/k/v biases); each MLP a mixture of experts plus a
shared expert that every token takes, scaled by sigmoid(shared_expert_gate . x)."""
from specserve.model.family import Family

FAMILY = Family("Qwen2MoeForCausalLM", "qwen2_moe", gguf_arch="qwen2moe", moe=True, attention_bias=True)
