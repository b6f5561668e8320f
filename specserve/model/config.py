"""Model configuration for Llama-family decoders (Llama 2/3, SmolLM2, Qwen2, Mistral)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from specserve.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}


@dataclass(slots=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int = 0  # 0: hidden_size // num_attention_heads
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # e.g. {"rope_type": "llama3", "factor": 8.0, ...}
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: bias on q/k/v projections
    sliding_window: int | None = None  # Mistral v0.1
    architecture: str = "LlamaForCausalLM"
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)
    # Reduced-vocabulary drafts predict only these target token ids (row r of the head = target id
    # draft_vocab[r]); None means the head covers the whole vocabulary.
    draft_vocab_size: int | None = None
    # Small drafts keep the full input vocabulary in a low-rank table (vocab x rank, then rank -> hidden):
    # a full-width embedding alone would be most of a draft's size. None: the usual vocab x hidden table.
    embedding_rank: int | None = None
    # EAGLE-style draft: each position reads fc([embedding of its token; the target's final hidden state at
    # the previous position]) and its output is the prediction of the target's hidden state. The input
    # embedding is the target's own (not stored with the draft).
    eagle: bool = False

    def __post_init__(self):
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"unsupported architecture {self.architecture!r} "
                f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
        if self.head_dim == 0:
            self.head_dim = self.hidden_size // self.num_attention_heads
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ModelLoadError(f"config field {name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelLoadError("num_attention_heads must be a multiple of num_key_value_heads")
        if isinstance(self.eos_token_id, int):
            self.eos_token_id = [self.eos_token_id]
        self.eos_token_id = list(self.eos_token_id or [])

    @classmethod
    def from_hf(cls, d: dict) -> "ModelConfig":
        """Build from a Hugging Face config.json dict (transformers 4.x and 5.x rope layouts)."""
        archs = d.get("architectures") or [{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
                                             "mistral": "MistralForCausalLM"}.get(d.get("model_type"), "?")]
        arch = archs[0]
        rope_params = d.get("rope_parameters") or {}
        rope_theta = d.get("rope_theta", rope_params.get("rope_theta", 10000.0))
        scaling = d.get("rope_scaling")
        if scaling is None and rope_params.get("rope_type", "default") != "default":
            scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
        if scaling is not None:
            scaling = dict(scaling)
            scaling.setdefault("rope_type", scaling.pop("type", "default"))
            if scaling["rope_type"] not in ("default", "llama3", "linear"):
                raise ModelLoadError(f"unsupported rope scaling type {scaling['rope_type']!r}")
        try:
            return cls(
                vocab_size=d["vocab_size"],
                hidden_size=d["hidden_size"],
                intermediate_size=d["intermediate_size"],
                num_hidden_layers=d["num_hidden_layers"],
                num_attention_heads=d["num_attention_heads"],
                num_key_value_heads=d.get("num_key_value_heads") or d["num_attention_heads"],
                head_dim=d.get("head_dim") or 0,
                rms_norm_eps=d.get("rms_norm_eps", 1e-6),
                rope_theta=float(rope_theta),
                rope_scaling=scaling,
                max_position_embeddings=d.get("max_position_embeddings", 2048),
                tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                attention_bias=bool(d.get("attention_bias", arch == "Qwen2ForCausalLM")),
                sliding_window=d.get("sliding_window") if d.get("use_sliding_window", True) else None,
                architecture=arch,
                bos_token_id=d.get("bos_token_id"),
                eos_token_id=d.get("eos_token_id") or [],
                draft_vocab_size=d.get("draft_vocab_size"),
                embedding_rank=d.get("embedding_rank"),
                eagle=bool(d.get("eagle", False)),
            )
        except KeyError as e:
            raise ModelLoadError(f"config.json is missing required field {e.args[0]!r}") from None

    def to_hf(self) -> dict:
        """A config.json dict that transformers also reads."""
        d = asdict(self)
        arch = d.pop("architecture")
        d["architectures"] = [arch]
        d["model_type"] = SUPPORTED_ARCHITECTURES[arch]
        d["hidden_act"] = "silu"
        d["eos_token_id"] = self.eos_token_id[0] if len(self.eos_token_id) == 1 else self.eos_token_id
        for key in ("draft_vocab_size", "embedding_rank"):
            if d[key] is None:
                del d[key]
        if self.sliding_window is None:
            d.pop("sliding_window")
        if not self.eagle:
            d.pop("eagle")
        return d
