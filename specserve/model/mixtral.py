"""Mixtral (8x7B, 8x22B): Mistral's attention, every MLP a mixture of 8 experts, 2 per token, weighted by the
softmax over the two chosen router logits (= the softmax over all, top 2, renormalised). Its checkpoints name
the experts w1 (gate), w3 (up), w2 (down); llama.cpp writes it as a "llama" GGUF with expert tensors."""
from specserve.model.family import Family


def _experts_are_the_mlp(d: dict) -> dict:
    return {"moe_intermediate_size": d.get("intermediate_size") or 0, "norm_topk_prob": True}


def _from_gguf(g, arch: str) -> dict:
    return {"moe_intermediate_size": g.require(f"{arch}.feed_forward_length"), "norm_topk_prob": True}


FAMILY = Family("MixtralForCausalLM", "mixtral", gguf_arch="llama", moe=True, permuted_qk_in_gguf=True,
                hf_names={"router": "block_sparse_moe.gate", "expert_gate": "block_sparse_moe.experts.{e}.w1",
                          "expert_up": "block_sparse_moe.experts.{e}.w3",
                          "expert_down": "block_sparse_moe.experts.{e}.w2"},
                from_hf=_experts_are_the_mlp, from_gguf=_from_gguf)
