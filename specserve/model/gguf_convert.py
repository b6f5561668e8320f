"""GGUF (llama.cpp) -> Hugging Face layout: config, dequantized weights, tokenizer, chat template."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from specserve.errors import ModelLoadError
from specserve.model.config import ModelConfig

# Dequantized at load (gguf-py); Q8_0, Q4_0, Q4_1 and Q4_K can also stay quantized (model/quantize.py).
# Q6_K (the attn_v / ffn_down / output matrices of llama.cpp's _M mixes) loads dense: those matrices, and the
# fused groups they belong to, run as float matrices beside the quantized rest.
SUPPORTED_QUANTS = {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"}
ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}

# GGUF tensor name (per block: after "blk.N.") -> HF name (after "model.layers.N.").
BLOCK_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight", "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.weight": "self_attn.k_proj.weight", "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}
GLOBAL_TENSORS = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                  "output.weight": "lm_head.weight"}

# llama.cpp pre-tokenizer names -> the split regex in front of byte-level BPE. "smollm" and "starcoder"
# split digits one by one and then use GPT-2's regex.
GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)"
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_REGEX = LLAMA3_REGEX.replace(r"\p{N}{1,3}", r"\p{N}")
PRE_TOKENIZERS = {"default": (False, GPT2_REGEX), "gpt2": (False, GPT2_REGEX),
                  "smollm": (True, GPT2_REGEX), "starcoder": (True, GPT2_REGEX),
                  "llama-bpe": (False, LLAMA3_REGEX), "qwen2": (False, QWEN2_REGEX)}


class GGUFFile:
    """Metadata and tensors of one GGUF file, with errors that name the file."""

    def __init__(self, path: Path):
        from gguf import GGUFReader
        self.path = path
        if not path.is_file():
            raise ModelLoadError(f"GGUF file not found: {path}")
        try:
            self.reader = GGUFReader(str(path))
        except Exception as e:  # gguf raises ValueError/struct.error/etc. on damaged files
            raise ModelLoadError(f"corrupt or unreadable GGUF file {path}: {e}") from None

    def get(self, key: str, default=None):
        field = self.reader.fields.get(key)
        return default if field is None else field.contents()

    def require(self, key: str):
        value = self.get(key)
        if value is None:
            raise ModelLoadError(f"GGUF file {self.path} has no metadata key {key!r}")
        return value


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's convert_hf_to_gguf permutation of Q/K rows (interleaved -> rotate-half rope)."""
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_config(g: GGUFFile) -> ModelConfig:
    arch = g.require("general.architecture")
    if arch not in ARCHITECTURES:
        raise ModelLoadError(f"unsupported GGUF architecture {arch!r} in {g.path} "
                             f"(supported: {', '.join(ARCHITECTURES)})")
    if any(t.name == "rope_freqs.weight" for t in g.reader.tensors):
        raise ModelLoadError(f"{g.path}: GGUF rope_freqs (llama3 rope scaling) is not supported; "
                             "load the Hugging Face checkpoint instead")
    heads = g.require(f"{arch}.attention.head_count")
    hidden = g.require(f"{arch}.embedding_length")
    eos = g.get("tokenizer.ggml.eos_token_id")
    return ModelConfig(
        vocab_size=g.get(f"{arch}.vocab_size") or len(g.require("tokenizer.ggml.tokens")),
        hidden_size=hidden,
        intermediate_size=g.require(f"{arch}.feed_forward_length"),
        num_hidden_layers=g.require(f"{arch}.block_count"),
        num_attention_heads=heads,
        num_key_value_heads=g.get(f"{arch}.attention.head_count_kv") or heads,
        head_dim=g.get(f"{arch}.attention.key_length") or hidden // heads,
        rms_norm_eps=float(g.require(f"{arch}.attention.layer_norm_rms_epsilon")),
        rope_theta=float(g.get(f"{arch}.rope.freq_base", 10000.0)),
        max_position_embeddings=g.get(f"{arch}.context_length", 2048),
        tie_word_embeddings=not any(t.name == "output.weight" for t in g.reader.tensors),
        attention_bias=arch == "qwen2",
        architecture=ARCHITECTURES[arch],
        bos_token_id=g.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=[eos] if eos is not None else [],
    )


def gguf_state_dict(g: GGUFFile, config: ModelConfig) -> dict[str, torch.Tensor]:
    """Dequantized float32 tensors under Hugging Face names."""
    from gguf.quants import dequantize
    unpermute = config.architecture == "LlamaForCausalLM"
    out = {}
    for t in g.reader.tensors:
        if t.name in GLOBAL_TENSORS:
            name = GLOBAL_TENSORS[t.name]
        elif t.name.startswith("blk.") and t.name.split(".", 2)[2] in BLOCK_TENSORS:
            _, layer, rest = t.name.split(".", 2)
            name = f"model.layers.{layer}.{BLOCK_TENSORS[rest]}"
        else:
            raise ModelLoadError(f"unexpected tensor {t.name!r} in {g.path}")
        qtype = t.tensor_type.name
        if qtype not in SUPPORTED_QUANTS:
            raise ModelLoadError(f"tensor {t.name} in {g.path} uses quantization {qtype}, which is not "
                                 f"supported (supported: {', '.join(sorted(SUPPORTED_QUANTS))})")
        w = dequantize(t.data, t.tensor_type).astype(np.float32)
        w = w.reshape([int(n) for n in reversed(t.shape)])  # GGUF lists dims innermost-first
        if unpermute and name.endswith(("q_proj.weight", "q_proj.bias")):
            w = _unpermute(w, config.num_attention_heads)
        elif unpermute and name.endswith(("k_proj.weight", "k_proj.bias")):
            w = _unpermute(w, config.num_key_value_heads)
        out[name] = torch.from_numpy(np.ascontiguousarray(w))
    return out


def gguf_tokenizer_files(g: GGUFFile) -> dict[str, dict]:
    """tokenizer.json and tokenizer_config.json contents built from the GGUF tokenizer metadata."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

    kind = g.require("tokenizer.ggml.model")
    if kind != "gpt2":
        raise ModelLoadError(f"{g.path}: tokenizer model {kind!r} is not supported (only byte-level BPE, 'gpt2')")
    pre = g.get("tokenizer.ggml.pre", "default")
    if pre not in PRE_TOKENIZERS:
        raise ModelLoadError(f"{g.path}: pre-tokenizer {pre!r} is not supported "
                             f"(supported: {', '.join(PRE_TOKENIZERS)})")
    tokens = g.require("tokenizer.ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in g.require("tokenizer.ggml.merges")]
    types = g.get("tokenizer.ggml.token_type") or [1] * len(tokens)
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    split_digits, regex = PRE_TOKENIZERS[pre]
    steps = [pre_tokenizers.Digits(individual_digits=True)] if split_digits else []
    if regex == GPT2_REGEX:
        steps.append(pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True))
    else:
        steps += [pre_tokenizers.Split(Regex(regex), behavior="isolated"),
                  pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    tok.pre_tokenizer = pre_tokenizers.Sequence(steps)
    tok.decoder = decoders.ByteLevel()
    # token_type 3 = control, 4 = user-defined: matched whole, never split by BPE.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == 3])
    tok.add_tokens([AddedToken(t, normalized=False) for t, ty in zip(tokens, types) if ty == 4])

    def name(key):
        i = g.get(f"tokenizer.ggml.{key}_token_id")
        return tokens[i] if i is not None and 0 <= i < len(tokens) else None

    config = {"tokenizer_class": "PreTrainedTokenizerFast", "clean_up_tokenization_spaces": False,
              "model_max_length": int(g.get(f"{g.get('general.architecture')}.context_length", 2048))}
    for key in ("bos", "eos", "unknown", "padding"):
        if name(key) is not None:
            config[{"unknown": "unk", "padding": "pad"}.get(key, key) + "_token"] = name(key)
    template = g.get("tokenizer.chat_template")
    if template:
        config["chat_template"] = template
    if g.get("tokenizer.ggml.add_bos_token") and name("bos"):
        from tokenizers import processors
        bos = name("bos")
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokens.index(bos))])
    return {"tokenizer.json": json.loads(tok.to_str()), "tokenizer_config.json": config}


def convert_gguf(gguf_path: Path, out_dir: Path) -> Path:
    """Write a Hugging Face directory (float32 safetensors) equivalent to the GGUF file."""
    from specserve.model.weights import save_hf_weights
    g = GGUFFile(gguf_path)
    config = gguf_config(g)
    tensors = gguf_state_dict(g, config)
    files = gguf_tokenizer_files(g)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_hf_weights(tensors, out_dir)
    (out_dir / "config.json").write_text(json.dumps(config.to_hf() | {"torch_dtype": "float32"}, indent=2))
    generation = {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id[0]
                  if len(config.eos_token_id) == 1 else config.eos_token_id}
    (out_dir / "generation_config.json").write_text(json.dumps(generation, indent=2))
    for fname, content in files.items():
        (out_dir / fname).write_text(json.dumps(content, indent=2, ensure_ascii=False))
    return out_dir
