"""Tiny random checkpoints of every model family as transformers writes them (a Hugging Face folder with our
byte-level tokenizer, a family-style chat template and a generation config), and the same models as GGUF
files written the way llama.cpp's converter writes them (gguf-py's tensor names, experts stacked, Q/K rows
permuted for its "llama" arch, Gemma's norms stored as 1 + w). With spm=True, Mixtral and Gemma 3 carry the
SentencePiece vocabulary their real files have (tests/model/spm_vocab.py) instead, in the folder as the
tokenizer.json transformers builds from it."""
import json
from pathlib import Path

import numpy as np
import torch
import transformers
from gguf import MODEL_ARCH, GGMLQuantizationType, GGUFWriter, RopeScalingType, get_tensor_name_map, quants
from safetensors.torch import load_file, save_file

from tests.byte_vocab import TOKENS, VOCAB
from tests.model.gguf_fixtures import _permute, _permute_back, add_byte_tokenizer
from tests.model.spm_vocab import add_spm_tokenizer, spm_vocab, write_spm_gguf
from tests.tiny_models import byte_tokenizer

SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512, bos_token_id=258, eos_token_id=259,
             tie_word_embeddings=False)
MOE = dict(num_experts_per_tok=2, moe_intermediate_size=32, norm_topk_prob=True)
# family -> (architecture, its transformers config, GGUF arch, chat template in the family's style)
FAMILIES = {
    "qwen3": ("Qwen3ForCausalLM", lambda: transformers.Qwen3Config(**SMALL, head_dim=24), "qwen3",
              "{%- for m in messages %}{{ '<s>' + m.role + '\n' + m.content + '</s>\n' }}{%- endfor %}"
              "{%- if add_generation_prompt %}{{ '<s>assistant\n' }}{%- if enable_thinking is defined and "
              "enable_thinking is false %}{{ '<think>\n\n</think>\n\n' }}{%- endif %}{%- endif %}"),
    # experts in layers 0 and 2, layer 1 dense (mlp_only_layers)
    "qwen3_moe": ("Qwen3MoeForCausalLM", lambda: transformers.Qwen3MoeConfig(
        **SMALL, **MOE, head_dim=24, num_experts=8, mlp_only_layers=[1]), "qwen3moe", None),
    "qwen2_moe": ("Qwen2MoeForCausalLM", lambda: transformers.Qwen2MoeConfig(
        **SMALL, **MOE | {"norm_topk_prob": False}, num_experts=6, shared_expert_intermediate_size=64), "qwen2moe",
        None),
    "mixtral": ("MixtralForCausalLM", lambda: transformers.MixtralConfig(
        **SMALL | {"intermediate_size": 32}, num_local_experts=6, num_experts_per_tok=2), "llama",
        "{{ bos_token }}{% for m in messages %}{% if (m.role == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('roles must alternate user/assistant') }}{% endif %}{% if m.role == 'user' %}"
        "{{ '[INST] ' + m.content + ' [/INST]' }}{% else %}{{ m.content + eos_token }}{% endif %}{% endfor %}"),
    # layers: sliding, full, sliding; a window shorter than the test prompts; linear rope scaling on the full layer
    "gemma3": ("Gemma3ForCausalLM", lambda: transformers.Gemma3TextConfig(
        **SMALL | {"tie_word_embeddings": True}, head_dim=32, sliding_window=6, query_pre_attn_scalar=40,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], final_logit_softcapping=5.0,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}), "gemma3",
        "{{ bos_token }}{% for m in messages %}{{ '<start_of_turn>' + ('model' if m.role == 'assistant' else m.role)"
        " + '\n' + m.content | trim + '<end_of_turn>\n' }}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}"),
}
MOE_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral")
SPM_STYLE = {"mixtral": "llama", "gemma3": "gemma"}  # the SentencePiece vocabulary of the family's real files
# a ChatML-style template for the families that leave it None above
CHATML = ("{% for m in messages %}{{ '<s>' + m.role + '\n' + m.content + '</s>\n' }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<s>assistant\n' }}{% endif %}")


def reference_model(family: str, seed: int = 0, vocab_size: int = VOCAB):
    """A transformers model of the family with random weights, random norms and biases (every weight
    matters) and a router scale that spreads tokens over the experts."""
    arch, make_config, _, _ = FAMILIES[family]
    config = make_config()
    config.vocab_size = vocab_size
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
            elif name.endswith("gate.weight"):  # routers, the shared expert's gate
                p.normal_(std=1.0)
    return model


def make_family_dir(path: Path, family: str, seed: int = 0, spm: bool = False) -> Path:
    """A Hugging Face folder of the family as transformers saves it (experts one tensor each), with the byte
    tokenizer (spm: the family's SentencePiece one), the family's chat template and a generation_config.json."""
    style = SPM_STYLE[family] if spm else None
    tokens = spm_vocab(style)[0] if spm else TOKENS
    model = reference_model(family, seed, len(tokens))
    model.save_pretrained(path)
    if spm:
        write_spm_gguf(path / "vocab.gguf", style)
        transformers.AutoTokenizer.from_pretrained(path, gguf_file="vocab.gguf").save_pretrained(path)
        (path / "vocab.gguf").unlink()
    else:
        byte_tokenizer().save(str(path / "tokenizer.json"))
    bos, eos = ("<bos>", "<eos>") if style == "gemma" else ("<s>", "</s>")
    (path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": bos, "eos_token": eos, "chat_template": FAMILIES[family][3] or CHATML}))
    (path / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": tokens.index(bos), "eos_token_id": tokens.index(eos), "temperature": 0.7, "top_p": 0.8,
         "top_k": 20}))
    return path


def write_family_gguf(path: Path, hf_dir: Path, family: str, qtype: str = "F32",
                      spm: bool = False) -> dict[str, torch.Tensor]:
    """A GGUF file of the model in `hf_dir` (spm: a folder made with spm=True). Returns the Hugging Face state
    dict a correct loader must reproduce (matrices dequantized; the rest as in the folder)."""
    arch, _, gguf_arch, template = FAMILIES[family]
    cfg = json.loads((hf_dir / "config.json").read_text())
    state = load_file(str(hf_dir / "model.safetensors"))
    layers, experts = cfg["num_hidden_layers"], cfg.get("num_experts") or cfg.get("num_local_experts") or 0
    names = get_tensor_name_map(next(a for a in MODEL_ARCH if a.name.lower() == gguf_arch), layers)
    dense_names = get_tensor_name_map(MODEL_ARCH.LLAMA, layers)
    w = GGUFWriter(str(path), gguf_arch)
    w.add_block_count(layers)
    w.add_context_length(256)
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    w.add_key_length(cfg["head_dim"] if cfg.get("head_dim") else cfg["hidden_size"] // cfg["num_attention_heads"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    rope = cfg.get("rope_parameters") or {}
    full = rope.get("full_attention", rope)
    w.add_rope_freq_base(full["rope_theta"])
    if full.get("rope_type", "default") == "linear":
        w.add_rope_scaling_type(RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(full["factor"])
    if experts:
        w.add_expert_count(experts)
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        if cfg.get("moe_intermediate_size"):
            w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        if cfg.get("shared_expert_intermediate_size"):
            w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
    if family == "gemma3":
        w.add_sliding_window(cfg["sliding_window"])
        w.add_sliding_window_pattern([t == "sliding_attention" for t in cfg["layer_types"]])
        w.add_rope_freq_base_swa(rope["sliding_attention"]["rope_theta"])
        w.add_final_logit_softcapping(cfg["final_logit_softcapping"])
        w.add_attention_scale(cfg["query_pre_attn_scalar"] ** -0.5)  # not the scalar llama.cpp would derive
    if spm:
        add_spm_tokenizer(w, SPM_STYLE[family], template)
    else:
        add_byte_tokenizer(w, template or CHATML)
    w.add_sampling_temp(0.6)
    w.add_sampling_top_k(40)
    # each layer's experts stacked the way llama.cpp does: [experts, rows, cols] per projection
    grouped, expected = {}, {}
    for name, t in state.items():
        base, kind = name.rsplit(".", 1)
        parts = base.split(".")
        expert = None
        if "experts" in parts:
            e = parts.index("experts")
            expert = int(parts.pop(e + 1))
        grouped.setdefault((".".join(parts), kind), {})[expert] = (name, t)
    qt = GGMLQuantizationType[qtype]
    for (stem, kind), members in grouped.items():
        # the Llama arch's names for a dense MLP in a MoE model (mlp_only_layers: llama.cpp has no such layers)
        gguf_name = (names.get_name(stem) or dense_names.get_name(stem)) + "." + kind
        order = sorted(members, key=lambda k: -1 if k is None else k)
        stacked = order != [None]
        a = np.stack([members[k][1].float().numpy() for k in order]) if stacked else members[None][1].float().numpy()
        if gguf_name.endswith("norm.weight") and family == "gemma3":
            a = a + 1.0  # as llama.cpp stores Gemma's norms
        if stem.endswith("shared_expert_gate"):
            a = a.reshape(-1)
        permuted = gguf_arch == "llama" and stem.endswith(("q_proj", "k_proj"))
        heads = cfg["num_attention_heads"] if stem.endswith("q_proj") else cfg["num_key_value_heads"]
        if permuted:
            a = _permute(a, heads)
        if a.ndim == 1 or qt == GGMLQuantizationType.F32:
            w.add_tensor(gguf_name, np.ascontiguousarray(a))
            deq = a
        else:
            q = quants.quantize(np.ascontiguousarray(a), qt)
            w.add_tensor(gguf_name, q, raw_dtype=qt)
            deq = quants.dequantize(q, qt).reshape(a.shape)
        if permuted:
            deq = _permute_back(deq, heads)
        if gguf_name.endswith("norm.weight") and family == "gemma3":
            deq = deq - 1.0
        if stem.endswith("shared_expert_gate"):
            deq = deq.reshape(1, -1)
        for k, part in zip(order, deq if stacked else [deq]):
            expected[members[k][0]] = torch.from_numpy(np.ascontiguousarray(part, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return expected


def reference_with(hf_dir: Path, tensors: dict[str, torch.Tensor], out: Path):
    """The transformers model of `hf_dir` with `tensors` in place of its weights (a copy of the folder)."""
    out.mkdir(parents=True, exist_ok=True)
    for f in hf_dir.iterdir():
        if f.name != "model.safetensors":
            (out / f.name).write_bytes(f.read_bytes())
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    model = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32, attn_implementation="eager")
    return model.eval()
