"""The distillation loop: KL(target || draft) on the cached top-k logits + cross-entropy on the target's
argmax; AdamW with warmup and cosine decay over the run's budget (steps or wall-clock minutes), bf16
autocast (CPU or GPU), checkpoints and resume, held-out top-1 agreement on a progress bar and in a JSONL
log. The teacher cache stays in host memory and on disk; each batch moves to the draft's device."""
from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from specserve.distill.student import bf16_autocast, causal_forward
from specserve.distill.teacher import PAD, TeacherCache, shard_to


@dataclass
class TrainConfig:
    minutes: float | None = None
    steps: int | None = None
    batch: int = 16             # windows per optimizer step
    lr: float = 1.5e-3
    min_lr_ratio: float = 0.1
    warmup: float = 0.03        # fraction of the budget
    weight_decay: float = 0.01
    ce_weight: float = 0.5
    echo: int = 2               # optimizer steps per teacher shard (data echoing: the teacher is the costly part)
    eval_every: int = 50
    checkpoint_seconds: float = 300.0
    seed: int = 0


def distill_loss(logits: torch.Tensor, shard: dict, to_draft: torch.Tensor,
                 ce_weight: float) -> tuple[torch.Tensor, dict]:
    """logits [B, T, Vd] of the draft; the teacher's cached top-k over the full vocabulary. The target's
    top-k probabilities are restricted to the draft's vocabulary and renormalised (a draft that cannot
    propose a token cannot be taught it); KL on that, plus CE on the target's argmax where it is kept."""
    logq = F.log_softmax(logits.float(), dim=-1)
    valid = shard["tokens"] >= 0
    ids = to_draft[shard["topk_ids"].long()]                       # [B, T, k], -1 outside the draft vocab
    kept = ids >= 0
    logp = shard["topk_logits"].float() - shard["lse"][..., None]
    p = logp.exp() * kept
    mass = p.sum(-1, keepdim=True)
    pn = p / mass.clamp_min(1e-9)
    logq_k = logq.gather(-1, ids.clamp_min(0))
    kl = (pn * (torch.log(pn.clamp_min(1e-12)) - logq_k)).sum(-1)
    use_kl = valid & (mass[..., 0] > 0)
    top_ok = valid & kept[..., 0]
    ce = -logq_k[..., 0]
    loss = kl[use_kl].mean()
    if top_ok.any():
        loss = loss + ce_weight * ce[top_ok].mean()
    return loss, {"kl": float(kl[use_kl].mean().detach()),
                  "ce": float(ce[top_ok].mean().detach()) if top_ok.any() else 0.0}


@torch.no_grad()
def agreement(model, shard: dict, vocab_map: torch.Tensor | None) -> float:
    """Held-out top-1 agreement: how often the draft's argmax (as a target id) is the target's argmax."""
    model.eval()
    hits = total = 0
    for start in range(0, len(shard["tokens"]), 8):
        tok = shard["tokens"][start:start + 8].long()
        with bf16_autocast(tok):
            pred = model.lm_head(causal_forward(model, tok.clamp_min(0))).argmax(-1)
        if vocab_map is not None:
            pred = vocab_map[pred]
        valid = tok >= 0
        hits += int(((pred == shard["topk_ids"][start:start + 8, :, 0].long()) & valid).sum())
        total += int(valid.sum())
    model.train()
    return hits / max(1, total)


class DistillObjective:
    """A standalone draft on the cached top-k target logits (see `distill_loss`)."""

    def __init__(self, eval_shard: dict, vocab_size: int, vocab_map: torch.Tensor | None, ce_weight: float,
                 device: str = "cpu"):
        self.eval_shard = shard_to(eval_shard, device)
        self.ce_weight = ce_weight
        self.to_draft = torch.full((vocab_size,), -1, dtype=torch.long)  # target id -> draft head row
        rows = vocab_map if vocab_map is not None else torch.arange(vocab_size)
        self.to_draft[rows] = torch.arange(len(rows))
        self.to_draft = self.to_draft.to(device)

    def loss(self, model, batch: dict) -> tuple[torch.Tensor, dict]:
        tokens = batch["tokens"].long().clamp_min(0)
        with bf16_autocast(tokens):
            logits = model.lm_head(causal_forward(model, tokens))
        return distill_loss(logits, batch, self.to_draft, self.ce_weight)

    def agreement(self, model, vocab_map: torch.Tensor | None) -> dict:
        return {"agreement": agreement(model, self.eval_shard, vocab_map)}


def similar_length_batch(shard: dict, size: int) -> dict:
    """`size` windows of a shard [N, T, ...], each as likely as any other, chosen among windows of similar
    length and cut to the longest one's real tokens. Chat windows are one sample each, right-padded (a third
    of their positions are padding); padding rows never enter the loss, and causal attention means the
    trailing ones change nothing before them, so cutting them saves their compute and changes no loss.
    How: a random N // size * size of the windows, sorted by length, cut into chunks of `size`; one chunk."""
    tokens = shard["tokens"]
    size = min(size, len(tokens))
    kept = torch.randperm(len(tokens))[:len(tokens) // size * size]
    lengths = (tokens[kept] >= 0).sum(1)
    order = kept[torch.argsort(lengths, stable=True)]
    chunk = int(torch.randint(len(kept) // size, ()))
    rows = order[chunk * size:(chunk + 1) * size]
    t = int((tokens[rows] >= 0).sum(1).max())
    return {k: v[rows, :t] for k, v in shard.items()}


def lr_at(cfg: TrainConfig, progress: float) -> float:
    if progress < cfg.warmup:
        return cfg.lr * progress / cfg.warmup
    t = min(1.0, (progress - cfg.warmup) / max(1e-9, 1 - cfg.warmup))
    return cfg.lr * (cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t)))


def train(model, vocab_map, cache: TeacherCache, objective, cfg: TrainConfig, work: Path,
          resume: bool, progress_cb=None) -> dict:
    """Runs until cfg.steps or cfg.minutes (training wall time, counted across resumes) is spent.
    `objective`: `loss(model, batch) -> (loss, parts)` and `agreement(model, vocab_map) -> {"agreement": ..}`
    (DistillObjective here, EagleObjective in eagle.py); frozen parameters (requires_grad off) stay put."""
    ckpt_path, log_path = work / "checkpoint.pt", work / "train_log.jsonl"
    device = next(model.parameters()).device
    trainable = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in trainable if p.dim() == 2]
    no_decay = [p for p in trainable if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}], lr=cfg.lr, betas=(0.9, 0.95))
    step, elapsed, tokens_seen, loss_avg = 0, 0.0, 0, None
    if resume and ckpt_path.exists():
        state = torch.load(ckpt_path, weights_only=False, map_location="cpu")
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        step, elapsed, tokens_seen = state["step"], state["elapsed"], state["tokens_seen"]
        loss_avg = state.get("loss_avg")
        torch.set_rng_state(state["rng"])
    elif log_path.exists():
        log_path.unlink()
    rng = np.random.default_rng(cfg.seed)
    order = rng.permutation(cache.num_shards)  # shard visiting order, fixed by the seed (resume-stable)
    model.train()
    last_ckpt = time.monotonic()
    start = time.monotonic() - elapsed
    agree = objective.agreement(model, vocab_map) if step == 0 else None
    if step == 0:
        _log(log_path, {"step": 0, "elapsed": 0.0, **_rounded(agree)})

    def progress() -> float:
        parts = []
        if cfg.steps is not None:
            parts.append(step / cfg.steps if cfg.steps else 1.0)
        if cfg.minutes:
            parts.append((time.monotonic() - start) / (cfg.minutes * 60))
        return max(parts)

    while progress() < 1.0:
        shard = cache.get(int(order[(step // cfg.echo) % len(order)]))
        batch = shard_to(similar_length_batch(shard, cfg.batch), device)
        lr = lr_at(cfg, progress())
        for group in opt.param_groups:
            group["lr"] = lr
        loss, parts = objective.loss(model, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        opt.step()
        step += 1
        tokens_seen += int((batch["tokens"] >= 0).sum())
        loss_avg = float(loss.detach()) if loss_avg is None else 0.95 * loss_avg + 0.05 * float(loss.detach())
        elapsed = time.monotonic() - start
        if step % cfg.eval_every == 0:
            agree = objective.agreement(model, vocab_map)
            _log(log_path, {"step": step, "elapsed": round(elapsed, 1), "loss": round(loss_avg, 4),
                            **_rounded(parts), "lr": lr, "tokens": tokens_seen, **_rounded(agree),
                            "teacher_seconds": round(cache.seconds_teaching, 1)})
        if progress_cb:
            progress_cb(progress=min(1.0, progress()), step=step, loss=loss_avg,
                        agreement=agree["agreement"] if agree else None,
                        tokens_per_s=tokens_seen / max(elapsed, 1e-9), elapsed=elapsed)
        if time.monotonic() - last_ckpt > cfg.checkpoint_seconds:
            _checkpoint(ckpt_path, model, opt, step, elapsed, tokens_seen, loss_avg, cfg)
            last_ckpt = time.monotonic()
    agree = objective.agreement(model, vocab_map)
    elapsed = time.monotonic() - start
    _log(log_path, {"step": step, "elapsed": round(elapsed, 1), "loss": loss_avg, "tokens": tokens_seen,
                    **_rounded(agree), "final": True})
    _checkpoint(ckpt_path, model, opt, step, elapsed, tokens_seen, loss_avg, cfg)
    extra = {f"heldout_top1_{k}": round(v, 4) for k, v in agree.items() if k != "agreement"}
    return {"steps": step, "train_seconds": round(elapsed, 1), "tokens_seen": tokens_seen,
            "final_loss": loss_avg, "heldout_top1_agreement": round(agree["agreement"], 4), **extra}


def _rounded(values: dict) -> dict:
    return {k: round(v, 4) for k, v in values.items()}


def _checkpoint(path: Path, model, opt, step, elapsed, tokens_seen, loss_avg, cfg) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step, "elapsed": elapsed,
                "tokens_seen": tokens_seen, "loss_avg": loss_avg, "rng": torch.get_rng_state(), "config": asdict(cfg)}, tmp)
    tmp.replace(path)


def _log(path: Path, row: dict) -> None:
    with path.open("a") as f:
        f.write(json.dumps(row) + "\n")
