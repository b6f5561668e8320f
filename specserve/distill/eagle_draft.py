"""EAGLE-style drafts: a draft that reads the target's own final hidden state.

A standalone draft must re-derive from tokens what the target already knows. An EAGLE draft (Li et al.,
2024) gets it for free: the row of position j reads fc([embedding of token j; f_{j-1}]), where f_{j-1} is
the target's final (normed) hidden state at position j-1, and predicts f_j; the (reduced) target head turns
that into the draft's distribution for token j+1. Its next step reads its own prediction f̂_j in place of
f_j, which the target has not computed yet. One Llama layer of the target's width is enough.

Training (teacher forcing, no generation): the target's features of real text windows are cached once
(`teacher.teach_features`); the loss of each position is
    reg_weight · SmoothL1(f̂_j, f_j) + cls_weight · KL(p_j || q_j)
with p_j the target's next-token distribution restricted to the draft vocabulary (softmax of the kept head
rows applied to f_j: exact, no top-k truncation) and q_j the draft's. Every window is drafted `passes` times
(default 2): pass 1 reads the target's features (plus small uniform noise, as EAGLE does, for robustness to
its own errors); pass s reads pass s-1's predictions and attends to the keys that draft step s sees at
inference (`student.unrolled_mask`): EAGLE-3's "training-time test", so later draft positions are trained too.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from specserve.distill.student import bf16_autocast, causal_forward, init_small
from specserve.distill.teacher import shard_to
from specserve.model.config import ModelConfig
from specserve.model.llama import LlamaModel


def eagle_config(target: ModelConfig, layers: int, draft_vocab: int | None) -> ModelConfig:
    """The target's layer shape (width, heads, MLP) with `layers` layers and an EAGLE input: a plain
    Llama layer (dense SwiGLU of the target's intermediate size, the target's global rope) whatever the
    target's family, as EAGLE's drafts for Qwen3, Mixtral or Gemma are. Its final norm holds the target's
    as the target applies it (Gemma's 1 + w included, model/weights.py), so both normalise alike."""
    return ModelConfig(
        vocab_size=target.vocab_size, hidden_size=target.hidden_size, intermediate_size=target.intermediate_size,
        num_hidden_layers=layers, num_attention_heads=target.num_attention_heads,
        num_key_value_heads=target.num_key_value_heads, head_dim=target.head_dim,
        rms_norm_eps=target.rms_norm_eps, rope_theta=target.rope_theta, rope_scaling=target.rope_scaling,
        max_position_embeddings=target.max_position_embeddings, tie_word_embeddings=False,
        attention_bias=target.attention_bias, architecture="LlamaForCausalLM",
        bos_token_id=target.bos_token_id, eos_token_id=list(target.eos_token_id),
        draft_vocab_size=draft_vocab, eagle=True)


def init_eagle(target: LlamaModel, config: ModelConfig, vocab_map: torch.Tensor | None, seed: int) -> LlamaModel:
    """Embedding, final norm and head rows come from the target and stay frozen (the draft predicts in the
    target's feature space and must score tokens as the target does). fc starts as "pass the feature
    through" plus a small token term; the layers start small and random with scaled residual outputs."""
    torch.manual_seed(seed)
    model = LlamaModel(config)
    h = config.hidden_size
    head = target.lm_head.weight.detach().float()
    with torch.no_grad():
        init_small(model)
        model.fc.weight[:, h:] += torch.eye(h)
        model.embed_tokens.weight.copy_(target.embed_tokens.weight.float())
        model.norm.weight.copy_(target.norm.weight.float())
        model.lm_head.weight.copy_(head if vocab_map is None else head[vocab_map])
    for frozen in (model.embed_tokens.weight, model.norm.weight, model.lm_head.weight):
        frozen.requires_grad_(False)
    return model


def previous_features(features: torch.Tensor) -> torch.Tensor:
    """[B, T, H] target features f_t -> the input of row t, f_{t-1} (zeros for position 0)."""
    return F.pad(features[:, :-1], (0, 0, 1, 0))


def draft_passes(model: LlamaModel, ids: torch.Tensor, prev: torch.Tensor, passes: int) -> list[torch.Tensor]:
    """ids [B, T], prev [B, T, H] (input features) -> the outputs [B, T, H] of draft steps 1..passes at every
    position: step 1 from the given features, step s from step s-1's own predictions."""
    outs: list[torch.Tensor] = []
    kvs: list[list] = []
    for _ in range(passes):
        kvs.append([])
        outs.append(causal_forward(model, ids, previous_features(outs[-1]) if outs else prev,
                                   prefix=kvs[:-1], kv_out=kvs[-1]))
    return outs


class EagleObjective:
    """Loss and held-out agreement of an EAGLE draft on cached target features."""

    def __init__(self, eval_shard: dict, passes: int = 2, reg_weight: float = 1.0, cls_weight: float = 0.1,
                 noise: float = 0.2, device: str = "cpu"):
        if passes < 1:
            raise ValueError(f"passes must be >= 1, got {passes}")
        # tokens, features, and the target's full-vocabulary argmax ("argmax"), on the draft's device
        self.eval_shard = shard_to(eval_shard or {}, device)
        self.passes, self.reg_weight, self.cls_weight, self.noise = passes, reg_weight, cls_weight, noise

    def loss(self, model: LlamaModel, batch: dict) -> tuple[torch.Tensor, dict]:
        tokens = batch["tokens"].long()
        valid = tokens >= 0
        ids, f = tokens.clamp_min(0), batch["features"].float()
        prev = previous_features(f)
        prev = prev + (torch.rand_like(prev) * 2 - 1) * self.noise * (prev != 0)
        f = f[valid]                                                   # [N, H]: the loss skips padding rows
        with torch.no_grad():
            logp = F.log_softmax(f @ model.lm_head.weight.float().T, dim=-1)  # [N, Vd] p over the kept tokens
            p = logp.exp()
            neg_entropy = (p * logp).sum(-1).mean()
        total, parts = 0.0, {}
        with bf16_autocast(ids):
            outs = draft_passes(model, ids, prev, self.passes)
        for name, out in enumerate(outs, 1):
            out = out[valid]                                           # [N, H] f̂
            with bf16_autocast(ids):
                logits = model.lm_head(out)                            # [N, Vd] log q up to a constant
            # KL(p || q) = H(p, q) - H(p): soft-target cross-entropy (one fused kernel) plus a constant.
            kl = F.cross_entropy(logits.float(), p) + neg_entropy
            reg = F.smooth_l1_loss(out.float(), f)
            total = total + self.reg_weight * reg + self.cls_weight * kl
            parts[f"kl{name}"], parts[f"reg{name}"] = float(kl.detach()), float(reg.detach())
        return total, parts

    @torch.no_grad()
    def agreement(self, model: LlamaModel, vocab_map: torch.Tensor | None) -> dict:
        """Held-out top-1 agreement with the target's argmax at draft step 1 (target features), 2 (the draft's
        own predicted features), and further steps when training unrolls them."""
        model.eval()
        steps = max(2, self.passes)
        hits, total = [0] * steps, 0
        shard = self.eval_shard
        for start in range(0, len(shard["tokens"]), 8):
            tok = shard["tokens"][start:start + 8].long()
            valid = tok >= 0
            f = shard["features"][start:start + 8].float()
            with bf16_autocast(tok):
                outs = draft_passes(model, tok.clamp_min(0), previous_features(f), steps)
            for i, out in enumerate(outs):
                pred = model.lm_head(out).argmax(-1)
                if vocab_map is not None:
                    pred = vocab_map[pred]
                hits[i] += int(((pred == shard["argmax"][start:start + 8].long()) & valid).sum())
            total += int(valid.sum())
        model.train()
        return {"agreement" if i == 0 else f"agreement_step{i + 1}": h / max(1, total) for i, h in enumerate(hits)}


@torch.no_grad()
def target_argmax(target: LlamaModel, shard: dict) -> torch.Tensor:
    """[N, T] the target's greedy next token at every position of a feature shard (full vocabulary), on the
    shard's device."""
    weight = target.lm_head.weight
    return torch.stack([target.compute_logits(f.to(weight.device, weight.dtype)).argmax(-1)
                        for f in shard["features"]]).int().to(shard["features"].device)
