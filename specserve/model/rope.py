"""Rotary position embeddings (rotate-half layout, as in Hugging Face checkpoints)."""
from __future__ import annotations

import math

import torch

from specserve.model import kernels
from specserve.model.config import ModelConfig


def inverse_frequencies(config: ModelConfig, local: bool = False) -> torch.Tensor:
    """The global rope's, or with `local` the sliding layers' (theta rope_local_base_freq, unscaled)."""
    dim = config.head_dim
    theta = config.rope_local_base_freq if local else config.rope_theta
    inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64, device="cpu") / dim))
    scaling = {} if local else config.rope_scaling or {}
    kind = scaling.get("rope_type", "default")
    if kind == "linear":
        inv_freq = inv_freq / scaling["factor"]
    elif kind == "llama3":
        # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between.
        factor = scaling["factor"]
        low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
        old_len = scaling.get("original_max_position_embeddings", 8192)
        wavelen = 2 * math.pi / inv_freq
        smooth = (old_len / wavelen - low) / (high - low)
        blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
        inv_freq = torch.where(wavelen > old_len / low, inv_freq / factor,
                               torch.where(wavelen < old_len / high, inv_freq, blended))
    return inv_freq.float()


def has_local_rope(config: ModelConfig) -> bool:
    """Whether sliding layers rotate by a rope of their own (Gemma 3)."""
    return config.rope_local_base_freq is not None and config.layer_types is not None


def rope_table(config: ModelConfig, max_positions: int, device=None, local: bool = False) -> torch.Tensor:
    """cos/sin for every position: [max_positions, 2, head_dim // 2] in float32 (`local`: the sliding
    layers' rope, see inverse_frequencies)."""
    # Built on the CPU explicitly, so a model constructed under torch.device("meta") still gets real values.
    t = torch.arange(max_positions, dtype=torch.float32, device="cpu")
    freqs = torch.outer(t, inverse_frequencies(config, local))
    return torch.stack([freqs.cos(), freqs.sin()], dim=1).to(device or "cpu")


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos, sin: [T, 1, head_dim // 2] (float32)."""
    if kernels.rope_supported(x, cos, sin):  # the same arithmetic in one C call (CPU, no autograd)
        return kernels.rope(x, cos, sin)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
