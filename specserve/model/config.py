"""Model configuration of every decoder family we serve (the families are listed in model/families.py)."""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from specserve.errors import ModelLoadError
from specserve.model.families import FAMILIES, MODEL_TYPES
from specserve.model.family import Family

ROPE_TYPES = ("default", "llama3", "linear")
ACTIVATIONS = ("silu", "gelu_pytorch_tanh")
SLIDING = "sliding_attention"  # a layer_types entry (the other: "full_attention")


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
    sliding_window: int | None = None  # Mistral v0.1; Gemma 3's sliding layers
    architecture: str = "LlamaForCausalLM"
    bos_token_id: int | None = None
    eos_token_id: list[int] = field(default_factory=list)
    hidden_act: str = "silu"  # the MLP's gate activation (Gemma: gelu_pytorch_tanh)
    # One entry per layer, "sliding_attention" or "full_attention": sliding layers attend within
    # `sliding_window` with their own rope (theta `rope_local_base_freq`, unscaled), full ones to everything.
    # None: every layer alike (the window, if any, and the one rope).
    layer_types: list[str] | None = None
    rope_local_base_freq: float | None = None  # None: sliding layers use rope_theta and rope_scaling too
    query_pre_attn_scalar: float | None = None  # attention scale is its -1/2 power (None: head_dim's)
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap) (Gemma)
    # Mixture of experts (model/moe.py): each MoE layer's MLP sends a token to num_experts_per_tok of
    # num_experts SwiGLU experts of width moe_intermediate_size; intermediate_size is then the width of the
    # dense layers' MLP (mlp_only_layers, the layers decoder_sparse_step skips).
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = False  # renormalise the chosen experts' router probabilities to sum to 1
    shared_expert_intermediate_size: int = 0  # a shared expert every token also takes (Qwen2-MoE)
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
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
        if self.architecture not in FAMILIES:
            raise ModelLoadError(
                f"unsupported architecture {self.architecture!r} "
                f"(supported: {', '.join(FAMILIES)})")
        if self.head_dim == 0:
            self.head_dim = self.hidden_size // self.num_attention_heads
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise ModelLoadError(f"config field {name} must be positive, got {getattr(self, name)}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ModelLoadError("num_attention_heads must be a multiple of num_key_value_heads")
        if self.hidden_act not in ACTIVATIONS:
            raise ModelLoadError(f"unsupported activation {self.hidden_act!r} (supported: {', '.join(ACTIVATIONS)})")
        if self.layer_types is not None and len(self.layer_types) != self.num_hidden_layers:
            raise ModelLoadError(f"layer_types has {len(self.layer_types)} entries for {self.num_hidden_layers} layers")
        if self.family.moe and not (0 < self.num_experts_per_tok <= self.num_experts
                                    and self.moe_intermediate_size > 0):
            raise ModelLoadError(f"{self.architecture} needs num_experts >= num_experts_per_tok > 0 and "
                                 f"moe_intermediate_size > 0 (got {self.num_experts}, {self.num_experts_per_tok}, "
                                 f"{self.moe_intermediate_size})")
        if isinstance(self.eos_token_id, int):
            self.eos_token_id = [self.eos_token_id]
        self.eos_token_id = list(self.eos_token_id or [])

    @property
    def family(self) -> Family:
        return FAMILIES[self.architecture]

    def is_sliding(self, layer: int) -> bool:
        """Whether the layer attends within `sliding_window` (with the local rope, where there is one)."""
        return self.sliding_window is not None and (self.layer_types is None or self.layer_types[layer] == SLIDING)

    def is_moe(self, layer: int) -> bool:
        return (self.family.moe and layer not in self.mlp_only_layers
                and (layer + 1) % self.decoder_sparse_step == 0)

    @classmethod
    def from_hf(cls, d: dict) -> "ModelConfig":
        """Build from a Hugging Face config.json dict (transformers 4.x and 5.x rope layouts); the family
        (model/families.py) reads what it names its own way."""
        arch = (d.get("architectures") or [MODEL_TYPES.get(d.get("model_type"), "?")])[0]
        family = FAMILIES.get(arch)
        rope_params = d.get("rope_parameters") or {}
        rope_theta = d.get("rope_theta", rope_params.get("rope_theta", 10000.0))
        scaling = d.get("rope_scaling")
        if scaling is None and rope_params.get("rope_type", "default") != "default":
            scaling = {k: v for k, v in rope_params.items() if k != "rope_theta"}
        try:
            fields = dict(
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
                attention_bias=bool(d.get("attention_bias", d.get("qkv_bias", family and family.attention_bias))),
                sliding_window=d.get("sliding_window") if d.get("use_sliding_window", True) else None,
                architecture=arch,
                bos_token_id=d.get("bos_token_id"),
                eos_token_id=d.get("eos_token_id") or [],
                hidden_act=d.get("hidden_act", "silu"),
                layer_types=d.get("layer_types"),
                rope_local_base_freq=d.get("rope_local_base_freq"),
                query_pre_attn_scalar=d.get("query_pre_attn_scalar"),
                final_logit_softcapping=d.get("final_logit_softcapping"),
                num_experts=d.get("num_experts") or d.get("num_local_experts") or 0,
                num_experts_per_tok=d.get("num_experts_per_tok") or 0,
                moe_intermediate_size=d.get("moe_intermediate_size") or 0,
                norm_topk_prob=bool(d.get("norm_topk_prob", False)),
                shared_expert_intermediate_size=d.get("shared_expert_intermediate_size") or 0,
                decoder_sparse_step=d.get("decoder_sparse_step") or 1,
                mlp_only_layers=list(d.get("mlp_only_layers") or []),
                draft_vocab_size=d.get("draft_vocab_size"),
                embedding_rank=d.get("embedding_rank"),
                eagle=bool(d.get("eagle", False)),
            )
            if family is not None and family.from_hf is not None:
                fields.update(family.from_hf(d))
        except KeyError as e:
            raise ModelLoadError(f"config.json is missing required field {e.args[0]!r}") from None
        fields["rope_scaling"] = check_rope_scaling(fields["rope_scaling"])
        return cls(**fields)

    def to_hf(self) -> dict:
        """A config.json dict that transformers also reads (fields at their defaults left out)."""
        d = {k: v for k, v in asdict(self).items() if v != ModelConfig.__dataclass_fields__[k].default
             or k in ("rope_theta", "rms_norm_eps", "tie_word_embeddings", "attention_bias")}
        arch = d.pop("architecture", self.architecture)
        d["architectures"] = [arch]
        d["model_type"] = FAMILIES[arch].model_type
        d["hidden_act"] = self.hidden_act
        d["head_dim"] = self.head_dim
        d["eos_token_id"] = self.eos_token_id[0] if len(self.eos_token_id) == 1 else self.eos_token_id
        if self.num_experts:
            d["num_local_experts"] = self.num_experts  # Mixtral's name of num_experts
        return d


def check_rope_scaling(scaling: dict | None) -> dict | None:
    """A rope_scaling dict with its kind under "rope_type" (older files say "type"); one we cannot run is an error."""
    if scaling is None:
        return None
    scaling = dict(scaling)
    scaling.setdefault("rope_type", scaling.pop("type", "default"))
    if scaling["rope_type"] not in ROPE_TYPES:
        raise ModelLoadError(f"unsupported rope scaling type {scaling['rope_type']!r}")
    return scaling
