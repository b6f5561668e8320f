"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention, every MLP a mixture of experts
(128 experts, 8 per token). The router takes the softmax over all experts, keeps the top k and, with
norm_topk_prob, rescales those k to sum to 1."""
from specserve.model.family import Family


def _from_gguf(g, arch: str) -> dict:
    return {"norm_topk_prob": True}  # llama.cpp always renormalises qwen3moe's top-k weights (no key for it)


FAMILY = Family("Qwen3MoeForCausalLM", "qwen3_moe", gguf_arch="qwen3moe", moe=True, qk_norm=True,
                from_gguf=_from_gguf)
