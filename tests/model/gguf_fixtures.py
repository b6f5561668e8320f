"""Write small GGUF files the way llama.cpp's converter does (permuted Q/K, quantized matrices)."""
import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter, quants

from tests.byte_vocab import MERGES, TOKENS, TYPES


def _permute(w, n_heads):
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def add_byte_tokenizer(w: GGUFWriter, template: str):
    """The byte-level vocabulary of the tiny models (tests/byte_vocab.py) as GGUF tokenizer metadata."""
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(TOKENS)
    w.add_token_merges(MERGES)
    w.add_token_types(TYPES)
    w.add_bos_token_id(258)
    w.add_eos_token_id(259)
    w.add_chat_template(template)


def write_gguf(path, hf_state_dict, cfg, qtype="Q8_0", arch="llama"):
    """cfg: dict with hidden, ffn, layers, heads, kv_heads. Returns the dequantized HF state dict that a
    correct loader must reproduce."""
    qt = GGMLQuantizationType["Q4_K" if qtype == "Q4_K_M" else qtype]  # Q4_K_M: Q4_K with some Q6_K matrices
    w = GGUFWriter(str(path), arch)
    w.add_block_count(cfg["layers"])
    w.add_context_length(256)
    w.add_embedding_length(cfg["hidden"])
    w.add_feed_forward_length(cfg["ffn"])
    w.add_head_count(cfg["heads"])
    w.add_head_count_kv(cfg["kv_heads"])
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    add_byte_tokenizer(w, "{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}")
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
             "lm_head.weight": "output.weight"}
    block = {"input_layernorm.weight": "attn_norm.weight", "post_attention_layernorm.weight": "ffn_norm.weight",
             "self_attn.q_proj.weight": "attn_q.weight", "self_attn.k_proj.weight": "attn_k.weight",
             "self_attn.v_proj.weight": "attn_v.weight", "self_attn.o_proj.weight": "attn_output.weight",
             "mlp.gate_proj.weight": "ffn_gate.weight", "mlp.up_proj.weight": "ffn_up.weight",
             "mlp.down_proj.weight": "ffn_down.weight"}
    expected = {}
    for name, t in hf_state_dict.items():
        a = t.float().numpy()
        if name.startswith("model.layers."):
            _, _, i, rest = name.split(".", 3)
            gname = f"blk.{i}.{block[rest]}"
        else:
            gname = names[name]
        if a.ndim == 1:
            w.add_tensor(gname, a)
            expected[name] = torch.from_numpy(a.copy())
            continue
        stored = a
        if "q_proj" in name:
            stored = _permute(a, cfg["heads"])
        elif "k_proj" in name:
            stored = _permute(a, cfg["kv_heads"])
        tq = qt
        if qtype == "Q4_K_M" and (gname.endswith(("attn_v.weight", "ffn_down.weight")) or gname == "output.weight"):
            tq = GGMLQuantizationType.Q6_K  # as llama.cpp's _M mixes do
        q = random_q6_k(stored.shape) if tq == GGMLQuantizationType.Q6_K else \
            random_q4_k(stored.shape) if tq == GGMLQuantizationType.Q4_K else quants.quantize(stored, tq)
        w.add_tensor(gname, q, raw_dtype=tq)
        deq = quants.dequantize(q, tq).reshape(a.shape)
        if "q_proj" in name:  # what the loader must give back: the un-permuted dequantized matrix
            deq = _permute_back(deq, cfg["heads"])
        elif "k_proj" in name:
            deq = _permute_back(deq, cfg["kv_heads"])
        expected[name] = torch.from_numpy(np.ascontiguousarray(deq, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


def random_q4_k(shape, seed=0):
    """Q4_K blocks for a matrix of `shape` (inner dim a multiple of 256): gguf-py cannot quantize to Q4_K,
    so random nibbles and 6-bit scales under small f16 super-scales; the loader must reproduce whatever
    they dequantize to."""
    rng = np.random.default_rng(seed + shape[0])
    rows, blocks = shape[0], shape[1] // 256
    b = rng.integers(0, 256, size=(rows, blocks, 144), dtype=np.uint8)
    b[..., 0:4] = np.frombuffer(rng.uniform(1e-3, 0.02, rows * blocks * 2).astype(np.float16).tobytes(),
                                np.uint8).reshape(rows, blocks, 4)
    return b.reshape(rows, blocks * 144)


def random_q6_k(shape, seed=0):
    """Q6_K blocks (ql[128], qh[64], int8 scales[16], f16 d: 210 bytes a 256 inputs), random like
    random_q4_k's: gguf-py cannot quantize to Q6_K either."""
    rng = np.random.default_rng(seed + 7 * shape[0])
    rows, blocks = shape[0], shape[1] // 256
    b = rng.integers(0, 256, size=(rows, blocks, 210), dtype=np.uint8)
    b[..., 208:210] = np.frombuffer(rng.uniform(1e-5, 1e-4, rows * blocks).astype(np.float16).tobytes(),
                                    np.uint8).reshape(rows, blocks, 2)
    return b.reshape(rows, blocks * 210)


def _permute_back(w, n_heads):
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
