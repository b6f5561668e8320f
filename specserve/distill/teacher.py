"""The target as teacher: top-k logits of every window position, cached on disk in shards.

A full 49k-entry row per token would be ~200 KB; the top-32 logits (fp16), their ids and the row's
logsumexp are ~200 bytes and carry almost all of the probability mass the draft can learn from. Shards are
plain safetensors files named by index, so an interrupted run (or a rerun with the same corpus) reuses them.
"""
from __future__ import annotations

from pathlib import Path

import time

import numpy as np
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from specserve.distill.student import causal_forward

PAD = -1  # token id of padding in a window; masked out of teaching and of the loss
CACHE_KEYS = ("tokens", "topk_ids", "topk_logits", "lse")


@torch.no_grad()
def teach(target, windows: np.ndarray, k: int, chunk: int = 16) -> dict[str, torch.Tensor]:
    """windows [N, T] int32 (PAD allowed at the end of a row) -> the cache entries for them, in host memory:
    tokens [N, T] int32, topk_ids [N, T, k] int32, topk_logits [N, T, k] fp16, lse [N, T] fp32."""
    weight = next(target.parameters())
    ids_all = torch.from_numpy(np.ascontiguousarray(windows)).long()
    out = {key: [] for key in CACHE_KEYS}
    for start in range(0, len(ids_all), chunk):
        ids = ids_all[start:start + chunk].to(weight.device)
        # Padding sits at the end of rows: run only up to the chunk's longest row, fill the rest.
        length = int((ids >= 0).sum(1).max())
        hidden = causal_forward(target, ids[:, :length].clamp_min(0))
        logits = target.softcap(target.lm_head(hidden.to(weight.dtype))).float()
        values, idx = logits.topk(k, dim=-1)
        pad = ids.shape[1] - length
        out["tokens"].append(ids.int())
        out["topk_ids"].append(F.pad(idx.int(), (0, 0, 0, pad)))
        out["topk_logits"].append(F.pad(values.half(), (0, 0, 0, pad)))
        out["lse"].append(F.pad(logits.logsumexp(-1), (0, pad)))
    return {key: torch.cat(v).cpu() for key, v in out.items()}


@torch.no_grad()
def teach_features(target, windows: np.ndarray, chunk: int = 16) -> dict[str, torch.Tensor]:
    """windows [N, T] int32 -> tokens [N, T] int32 and the target's final (normed) hidden state of every
    position, features [N, T, hidden] in the target's dtype: what an EAGLE draft reads and learns to predict.
    Padded positions hold zeros. Both in host memory."""
    device = next(target.parameters()).device
    ids_all = torch.from_numpy(np.ascontiguousarray(windows)).long()
    feats = []
    for start in range(0, len(ids_all), chunk):
        ids = ids_all[start:start + chunk].to(device)
        length = int((ids >= 0).sum(1).max())
        hidden = causal_forward(target, ids[:, :length].clamp_min(0))
        hidden = hidden * (ids[:, :length] >= 0)[..., None]
        feats.append(F.pad(hidden, (0, 0, 0, ids.shape[1] - length)).cpu())
    return {"tokens": ids_all.int(), "features": torch.cat(feats)}


def shard_to(shard: dict[str, torch.Tensor], device) -> dict[str, torch.Tensor]:
    """A shard (or a batch of one) on `device`: the cache lives in host memory, the draft may train elsewhere."""
    return {key: value.to(device) for key, value in shard.items()}


class TeacherCache:
    """Shard i holds the teacher's outputs for windows [i * shard_size, (i + 1) * shard_size):
    `teach_fn(rows)` -> dict with at least "tokens" (e.g. `teach` or `teach_features` bound to a target)."""

    def __init__(self, root: Path, teach_fn, windows: np.ndarray, shard_size: int):
        self.root, self.teach_fn, self.windows = Path(root), teach_fn, windows
        self.shard_size = shard_size
        self.root.mkdir(parents=True, exist_ok=True)
        self.num_shards = max(1, len(windows) // shard_size)
        self.seconds_teaching = 0.0
        self.tokens_taught = 0

    def path(self, i: int) -> Path:
        return self.root / f"shard-{i:05d}.safetensors"

    def rows(self, i: int) -> np.ndarray:
        return self.windows[i * self.shard_size:(i + 1) * self.shard_size]

    def get(self, i: int) -> dict[str, torch.Tensor]:
        i %= self.num_shards
        rows = self.rows(i)
        path = self.path(i)
        if path.exists():
            shard = load_file(str(path))
            if shard["tokens"].shape == rows.shape and np.array_equal(shard["tokens"].numpy(), rows):
                return shard
        t0 = time.perf_counter()
        shard = self.teach_fn(rows)
        self.seconds_teaching += time.perf_counter() - t0
        self.tokens_taught += int((rows != PAD).sum())
        self.put(i, shard)
        return shard

    def put(self, i: int, shard: dict[str, torch.Tensor]) -> None:
        """Store shard i (teacher outputs obtained elsewhere, e.g. recorded while generating)."""
        tmp = self.path(i).with_suffix(".tmp")
        save_file(shard, str(tmp))
        tmp.replace(self.path(i))  # never leave a half-written shard behind for a resumed run
