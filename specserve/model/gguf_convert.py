"""GGUF (llama.cpp) -> Hugging Face layout: config, dequantized weights, tokenizer, chat template."""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path

import gguf
import numpy as np
import torch

from specserve.cache import cache_dir
from specserve.errors import ModelLoadError
from specserve.model.config import ModelConfig, check_rope_scaling
from specserve.model.families import FAMILIES
from specserve.model.family import Family
from specserve.model.gguf_tokenizer import gguf_tokenizer_files

# Dequantized at load (gguf-py); Q8_0, Q4_0, Q4_1 and Q4_K can also stay quantized (model/quantize.py).
# Q6_K (the attn_v / ffn_down / output matrices of llama.cpp's _M mixes) loads dense: those matrices, and the
# fused groups they belong to, run as float matrices beside the quantized rest.
SUPPORTED_QUANTS = {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"}

# gguf-py's tensor kinds of a block -> our per-layer names (the family maps these to its HF names,
# model/family.py). ffn_norm is the norm in front of the MLP, whatever a family calls it.
_T = gguf.MODEL_TENSOR
LAYER_TENSORS = {gguf.TENSOR_NAMES[kind].removeprefix("blk.{bid}."): ours for kind, ours in {
    _T.ATTN_NORM: "input_layernorm", _T.FFN_NORM: "post_attention_layernorm",
    _T.ATTN_Q_NORM: "q_norm", _T.ATTN_K_NORM: "k_norm",
    _T.ATTN_POST_NORM: "attention_output_norm", _T.FFN_POST_NORM: "mlp_output_norm",
    _T.ATTN_Q: "q_proj", _T.ATTN_K: "k_proj", _T.ATTN_V: "v_proj", _T.ATTN_OUT: "o_proj",
    _T.FFN_GATE: "gate_proj", _T.FFN_UP: "up_proj", _T.FFN_DOWN: "down_proj",
    _T.FFN_GATE_INP: "router",
    _T.FFN_GATE_EXP: "expert_gate", _T.FFN_UP_EXP: "expert_up", _T.FFN_DOWN_EXP: "expert_down",
    _T.FFN_GATE_SHEXP: "shared_gate_proj", _T.FFN_UP_SHEXP: "shared_up_proj",
    _T.FFN_DOWN_SHEXP: "shared_down_proj", _T.FFN_GATE_INP_SHEXP: "shared_expert_gate",
}.items()}
GLOBAL_TENSORS = {gguf.TENSOR_NAMES[kind]: hf for kind, hf in {
    _T.TOKEN_EMBD: "model.embed_tokens", _T.OUTPUT_NORM: "model.norm", _T.OUTPUT: "lm_head"}.items()}
_S = gguf.Keys.General  # general.sampling.* -> generation_config.json's names
SAMPLING_KEYS = {_S.SAMPLING_TEMP: "temperature", _S.SAMPLING_TOP_P: "top_p", _S.SAMPLING_TOP_K: "top_k",
                 _S.SAMPLING_MIN_P: "min_p", _S.SAMPLING_PENALTY_REPEAT: "repetition_penalty"}
STACKED_EXPERTS = ("expert_gate", "expert_up", "expert_down")  # [experts, rows, cols] in one tensor


class GGUFFile:
    """Metadata and tensors of one GGUF file, with errors that name the file.

    gguf-py's reader parses every metadata field into numpy views, ~2 s for a tokenizer of 49k tokens and
    merges, on every start. What it found (the fields' values; each tensor's type, shape and place in the
    file) is kept in the cache, keyed by the file's path, size and modification time, so a later load reads
    that index and maps the tensors straight from the file, as the same numpy views."""

    def __init__(self, path: Path):
        self.path = path
        if not path.is_file():
            raise ModelLoadError(f"GGUF file not found: {path}")
        index = _read_index(path)
        if index is None:
            index = _build_index(path)
        self.fields: dict = index["fields"]
        data = np.memmap(path, dtype=np.uint8, mode="r")
        self.tensors = [GGUFTensor(t["name"], gguf.GGMLQuantizationType(t["type"]), t["shape"],
                                   np.ndarray(t["view"], np.dtype(t["dtype"]), data, t["offset"]))
                        for t in index["tensors"]]

    def get(self, key: str, default=None):
        value = self.fields.get(key)
        return default if value is None else value

    def require(self, key: str):
        value = self.get(key)
        if value is None:
            raise ModelLoadError(f"GGUF file {self.path} has no metadata key {key!r}")
        return value


@dataclass(slots=True)
class GGUFTensor:
    name: str
    tensor_type: gguf.GGMLQuantizationType
    shape: list[int]  # GGUF's order, innermost dimension first
    data: np.ndarray  # gguf-py's view: float arrays in numpy order, quantized ones as [rows, row bytes]


INDEX_VERSION = 1


def _index_path(path: Path) -> Path:
    stat = path.stat()
    key = f"{INDEX_VERSION}|{version('gguf')}|{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}"
    return cache_dir() / "gguf_index" / f"{hashlib.sha1(key.encode()).hexdigest()[:20]}.json"


def _read_index(path: Path) -> dict | None:
    try:
        return json.loads(_index_path(path).read_text())
    except (OSError, ValueError):
        return None


def _build_index(path: Path) -> dict:
    from gguf import GGUFReader
    try:
        reader = GGUFReader(str(path))
    except Exception as e:  # gguf raises ValueError/struct.error/etc. on damaged files
        raise ModelLoadError(f"corrupt or unreadable GGUF file {path}: {e}") from None
    index = {"fields": {key: field.contents() for key, field in reader.fields.items()},
             "tensors": [{"name": t.name, "type": int(t.tensor_type), "shape": [int(n) for n in t.shape],
                          "view": list(t.data.shape), "dtype": t.data.dtype.str, "offset": int(t.data_offset)}
                         for t in reader.tensors]}
    out = _index_path(path)
    try:  # a read-only cache only costs the next start its parse
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(index))
        tmp.replace(out)
    except (OSError, TypeError, ValueError):
        pass
    return index


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's convert_hf_to_gguf permutation of Q/K rows (interleaved -> rotate-half rope)."""
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_family(g: GGUFFile) -> Family:
    """The family of the file's general.architecture ("llama" with experts: Mixtral)."""
    arch = g.require("general.architecture")
    experts = bool(g.get(f"{arch}.expert_count"))
    for family in FAMILIES.values():
        if family.gguf_arch == arch and family.moe == experts:
            return family
    supported = sorted({f.gguf_arch for f in FAMILIES.values() if f.gguf_arch})
    raise ModelLoadError(f"unsupported GGUF architecture {arch!r}{' with experts' if experts else ''} in {g.path} "
                         f"(supported: {', '.join(supported)})")


def gguf_config(g: GGUFFile) -> ModelConfig:
    family = gguf_family(g)
    arch = g.require("general.architecture")
    if "rope_freqs.weight" in {t.name for t in g.tensors}:
        raise ModelLoadError(f"{g.path}: GGUF rope_freqs (llama3 rope scaling) is not supported; "
                             "load the Hugging Face checkpoint instead")
    heads = g.require(f"{arch}.attention.head_count")
    hidden = g.require(f"{arch}.embedding_length")
    scaling = g.get(f"{arch}.rope.scaling.type")
    layers = g.require(f"{arch}.block_count")
    names = {t.name for t in g.tensors}
    fields = dict(
        vocab_size=g.get(f"{arch}.vocab_size") or len(g.require("tokenizer.ggml.tokens")),
        hidden_size=hidden,
        intermediate_size=g.require(f"{arch}.feed_forward_length"),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=g.get(f"{arch}.attention.head_count_kv") or heads,
        head_dim=g.get(f"{arch}.attention.key_length") or hidden // heads,
        rms_norm_eps=float(g.require(f"{arch}.attention.layer_norm_rms_epsilon")),
        rope_theta=float(g.get(f"{arch}.rope.freq_base", 10000.0)),
        rope_scaling=None if scaling in (None, "none") else {
            "rope_type": scaling, "factor": float(g.require(f"{arch}.rope.scaling.factor"))},
        max_position_embeddings=g.get(f"{arch}.context_length", 2048),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        sliding_window=g.get(f"{arch}.attention.sliding_window"),
        architecture=family.architecture,
        bos_token_id=g.get("tokenizer.ggml.bos_token_id"),
        eos_token_id=gguf_stop_ids(g),
        final_logit_softcapping=g.get(f"{arch}.final_logit_softcapping"),
        num_experts=g.get(f"{arch}.expert_count") or 0,
        num_experts_per_tok=g.get(f"{arch}.expert_used_count") or 0,
        moe_intermediate_size=g.get(f"{arch}.expert_feed_forward_length") or 0,
        shared_expert_intermediate_size=g.get(f"{arch}.expert_shared_feed_forward_length") or 0,
        # a mixture's dense layers: those without a router (no key says which)
        mlp_only_layers=[i for i in range(layers) if family.moe and f"blk.{i}.ffn_gate_inp.weight" not in names],
    )
    if family.from_gguf is not None:
        fields.update(family.from_gguf(g, arch))
    fields["rope_scaling"] = check_rope_scaling(fields["rope_scaling"])
    return ModelConfig(**fields)


def gguf_stop_ids(g: GGUFFile) -> list[int]:
    """The end-of-sequence token and, where it differs, the end-of-turn one (Gemma's <end_of_turn>)."""
    ids = [g.get("tokenizer.ggml.eos_token_id"), g.get("tokenizer.ggml.eot_token_id")]
    return list(dict.fromkeys(i for i in ids if i is not None))


def hf_tensor_names(config: ModelConfig, gguf_name: str, num_experts: int) -> list[str]:
    """The Hugging Face names of a GGUF tensor's matrices: one, or one per expert of a stacked tensor."""
    name, _, kind = gguf_name.rpartition(".")  # kind: weight or bias
    if name in GLOBAL_TENSORS:
        return [f"{GLOBAL_TENSORS[name]}.{kind}"]
    _, layer, stem = name.split(".", 2) if name.startswith("blk.") else (None, None, None)
    if stem not in LAYER_TENSORS:
        return []
    ours, family = LAYER_TENSORS[stem], config.family
    experts = range(num_experts) if ours in STACKED_EXPERTS else [None]
    return [f"model.layers.{layer}.{family.hf_name(ours).format(e=e)}.{kind}" for e in experts]


def gguf_generation_config(g: GGUFFile) -> dict:
    """generation_config.json's contents: the start and stop tokens, and the recommended sampling where the
    file records one (general.sampling.*)."""
    stop = gguf_stop_ids(g)
    out = {"bos_token_id": g.get("tokenizer.ggml.bos_token_id"), "eos_token_id": stop[0] if len(stop) == 1 else stop}
    return out | {name: g.get(key) for key, name in SAMPLING_KEYS.items() if g.get(key) is not None}


def gguf_state_dict(g: GGUFFile, config: ModelConfig, skip: set[str] = frozenset()) -> dict[str, torch.Tensor]:
    """Dequantized float32 tensors under Hugging Face names (norms without the family's offset, which
    llama.cpp adds: the loader adds it back, weights.py). The tensors named in `skip` (ones that stay
    quantized: quantize.gguf_kernel_tensors) come as zeros of their shape, not dequantized."""
    from gguf.quants import dequantize
    family = config.family
    out = {}
    for t in g.tensors:
        names = hf_tensor_names(config, t.name, config.num_experts)
        if not names:
            raise ModelLoadError(f"unexpected tensor {t.name!r} in {g.path}")
        qtype = t.tensor_type.name
        if qtype not in SUPPORTED_QUANTS:
            raise ModelLoadError(f"tensor {t.name} in {g.path} uses quantization {qtype}, which is not "
                                 f"supported (supported: {', '.join(sorted(SUPPORTED_QUANTS))})")
        shape = [int(n) for n in reversed(t.shape)]  # GGUF lists dims innermost-first
        if t.name in skip:
            for name in names:  # one name, or one per expert of a stacked tensor
                out[name] = torch.zeros(()).expand(shape[1:] if len(names) > 1 else shape)
            continue
        w = dequantize(t.data, t.tensor_type).astype(np.float32).reshape(shape)
        name = names[0]
        if family.permuted_qk_in_gguf and name.endswith(("q_proj.weight", "q_proj.bias")):
            w = _unpermute(w, config.num_attention_heads)
        elif family.permuted_qk_in_gguf and name.endswith(("k_proj.weight", "k_proj.bias")):
            w = _unpermute(w, config.num_key_value_heads)
        elif name.endswith("norm.weight") and family.norm_offset:
            w = w - family.norm_offset
        elif name.endswith("shared_expert_gate.weight"):
            w = w.reshape(1, -1)  # llama.cpp keeps this [1, hidden] matrix as a vector
        for name, part in zip(names, w if len(names) > 1 else [w]):
            out[name] = torch.from_numpy(np.ascontiguousarray(part))
    return out


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
    (out_dir / "generation_config.json").write_text(json.dumps(gguf_generation_config(g), indent=2))
    for fname, content in files.items():
        (out_dir / fname).write_text(json.dumps(content, indent=2, ensure_ascii=False))
    return out_dir
