"""Build small random models (ours and the transformers reference with identical weights)."""
import torch

from specserve.model.attention import AttentionMetadata, allocate_kv_cache
from specserve.model.config import ModelConfig
from specserve.model.loader import build_model


def reference_pair(hf_config, seed=0):
    import transformers
    torch.manual_seed(seed)
    arch = hf_config.architectures[0] if hf_config.architectures else "LlamaForCausalLM"
    ref = getattr(transformers, arch)(hf_config).eval()
    with torch.no_grad():  # random norms and biases so that every weight matters
        for name, p in ref.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    d = hf_config.to_dict() | {"architectures": [arch]}
    ours = build_model(ModelConfig.from_hf(d), ref.state_dict(), torch.float32, "cpu")
    return ref, ours


def run_step(model, cache, seqs, tables, block_size, short_kernel=False):
    """seqs: list of (cached_len, new_ids, total_len). Returns logits of every new token: [T, vocab].
    `short_kernel`: decodes and verifies through the C kernel instead of torch ops."""
    meta = AttentionMetadata.build([len(n) for _, n, _ in seqs], [t for _, _, t in seqs], tables, block_size,
                                  short_kernel=short_kernel)
    ids = torch.tensor([i for _, n, _ in seqs for i in n])
    with torch.no_grad():
        return model.compute_logits(model(ids, meta, cache))


def new_cache(model, num_blocks, block_size):
    c = model.config
    return allocate_kv_cache(c.num_hidden_layers, num_blocks, block_size, c.num_key_value_heads, c.head_dim,
                             torch.float32)
