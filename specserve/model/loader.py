"""Load a model (HF directory, GGUF file, or alias) of any family we serve into our decoder + tokenizer."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from specserve.errors import ModelLoadError
from specserve.model.config import ModelConfig
from specserve.model.llama import LlamaModel
from specserve.model.registry import ALIASES, gguf_path, resolve
from specserve.model.tokenizer import Tokenizer
from specserve.model.weights import load_hf_state_dict, read_safetensors

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}


@dataclass(slots=True)
class LoadedModel:
    model: LlamaModel
    tokenizer: Tokenizer
    config: ModelConfig
    path: Path


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise ModelLoadError(f"unknown dtype {dtype!r} (choose from {', '.join(DTYPES)})")
    return DTYPES[dtype]


def read_config(model_dir: Path) -> ModelConfig:
    path = model_dir / "config.json"
    if not path.exists():
        raise ModelLoadError(f"no config.json in {model_dir}")
    try:
        return ModelConfig.from_hf(json.loads(path.read_text()))
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"corrupt config.json in {model_dir}: {e}") from None
    except ModelLoadError as e:  # name the file: the config alone does not know where it came from
        raise ModelLoadError(f"{path}: {e}") from None


def _generation_eos(model_dir: Path) -> list[int]:
    path = model_dir / "generation_config.json"
    eos = json.loads(path.read_text()).get("eos_token_id") if path.exists() else None
    return [eos] if isinstance(eos, int) else list(eos or [])


def build_model(config: ModelConfig, state_dict: dict, dtype: torch.dtype, device) -> LlamaModel:
    model = LlamaModel(config, device="meta").to_empty(device="cpu")
    if config.tie_word_embeddings:  # to_empty() unties shared parameters
        model.lm_head.weight = model.embed_tokens.weight
    load_hf_state_dict(model, state_dict)
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)


def load_model(name: str, dtype: str | torch.dtype = "float32", device: str = "cpu",
               quantization: str | None = None) -> LoadedModel:
    """quantization: None keeps every weight dense in `dtype` (a GGUF file dequantized); "gguf" keeps a
    GGUF file's Q8_0/Q4_0/Q4_1/Q4_K matrices as they are (an alias of a GGUF model loads from its file);
    "q8_0", "q4_0" or "q4_1" quantizes the matrices at load (`model/quantize.py`)."""
    path = resolve(name)
    dtype = parse_dtype(dtype)
    if quantization == "gguf" and path.suffix != ".gguf":
        if name not in ALIASES or not gguf_path(name).exists():
            raise ModelLoadError(f"quantization 'gguf' needs a .gguf model; {name!r} is not one")
        path = gguf_path(name)
    g = None
    if path.suffix == ".gguf":
        from specserve.model.gguf_convert import GGUFFile, gguf_config, gguf_state_dict
        from specserve.model.gguf_tokenizer import gguf_tokenizer
        from specserve.model.quantize import gguf_kernel_tensors
        g = GGUFFile(path)
        config = gguf_config(g)
        tokenizer = gguf_tokenizer(g, list(config.eos_token_id))
        kept = gguf_kernel_tensors(g, config) if quantization == "gguf" else set()  # never dequantized
        model = build_model(config, gguf_state_dict(g, config, kept), dtype, device)
    else:
        config = read_config(path)
        eos = _generation_eos(path) or list(config.eos_token_id)
        config.eos_token_id = eos
        tokenizer = Tokenizer.from_dir(path, eos)
        model = build_model(config, read_safetensors(path), dtype, device)
    if quantization is not None:
        from specserve.model.quantize import quantize_model
        quantize_model(model, quantization, g)
    return LoadedModel(model, tokenizer, config, path)
