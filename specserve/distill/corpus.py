"""Distillation text: the CPython standard library (code), ShareGPT prompts with target replies (chat), or
user files; the held-out split; token windows; and the reduced draft vocabulary (FR-Spec).

Held-out data never reaches training: 1 stdlib file in 20 (by a hash of its path, so the split is stable
across machines and Python patch releases); for chat, 1 ShareGPT prompt in 10 (the held-out agreement shown
while training) and the Spec-Bench questions the benchmarks draw from: every MT-Bench-category question
(Spec-Bench contains MT-Bench's 80) and the first 10 of each task category (translation, summarization,
qa, math_reasoning, rag). Only the other 350 task questions may be trained on (`--spec-bench`).
"""
from __future__ import annotations

import json
import sysconfig
import zlib
from importlib import resources
from pathlib import Path

import numpy as np

from specserve.errors import SpecServeError


def _held_out(key: str, one_in: int) -> bool:
    return zlib.crc32(key.encode()) % one_in == 0


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files(split: str) -> list[Path]:
    """split: "train" or "eval"; sorted, so the order does not depend on the file system."""
    root = stdlib_root()
    files = sorted(f for f in root.rglob("*.py")
                   if "site-packages" not in f.parts and "__pycache__" not in f.parts)
    if not files:
        raise SpecServeError(f"no Python standard library sources under {root}")
    want_eval = split == "eval"
    return [f for f in files if _held_out(f.relative_to(root).as_posix(), 20) == want_eval]


def read_texts(paths: list[Path]) -> list[str]:
    texts = []
    for p in paths:
        try:
            texts.append(p.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue  # a few stdlib test fixtures are deliberately not UTF-8
    return texts


def sharegpt_prompts(split: str) -> list[str]:
    """First-turn ShareGPT prompts shipped in specserve/data (see its SOURCES.md), deduplicated."""
    data = resources.files("specserve") / "data" / "sharegpt"
    seen, train, held = set(), [], []
    for name in ("ShareGPT_V3_filtered_1000.json", "ShareGPT_V3_filtered_500.json"):
        for row in json.loads((data / name).read_text()):
            text = row["conversations"][0]["value"].strip()
            if text and text not in seen:
                seen.add(text)
                (held if _held_out(text, 10) else train).append(text)
    return held if split == "eval" else train


MT_BENCH_CATEGORIES = {"writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities"}
SPEC_BENCH_HELD_OUT_PER_TASK = 10  # first questions of each 80-question task category kept for benchmarks


def spec_bench_questions(split: str = "eval") -> list[dict]:
    """{"category", "text"} of each Spec-Bench first-turn question of a split, in file order.
    split: "eval" (the benchmarks' prompts: all 80 MT-Bench-category questions and the first 10 of each task
    category, 130 in all) or "train" (the other 350 task questions)."""
    path = resources.files("specserve") / "data" / "spec_bench" / "question.jsonl"
    seen: dict[str, int] = {}
    out = []
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            cat = row["category"]
            seen[cat] = seen.get(cat, 0) + 1
            held = cat in MT_BENCH_CATEGORIES or seen[cat] <= SPEC_BENCH_HELD_OUT_PER_TASK
            if held == (split == "eval"):
                out.append({"category": cat, "text": row["turns"][0]})
    return out


def tokenize(tokenizer, texts: list[str]) -> list[np.ndarray]:
    return [np.asarray(enc.ids, dtype=np.int32) for enc in tokenizer.hf.encode_batch(texts, add_special_tokens=False)]


def token_stream(documents: list[np.ndarray], eos_id: int) -> np.ndarray:
    """Tokenized documents concatenated, each followed by EOS (documents stay separable)."""
    parts = [np.append(d, np.int32(eos_id)) for d in documents]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)


def prefixes(documents: list[np.ndarray], n: int, length: int, rng: np.random.Generator) -> list[list[int]]:
    """n prefixes of `length` tokens, each starting at a random position of a document long enough, the
    documents taken in a random order (each gives one before any gives a second), like the acceptance
    benchmark's prompts."""
    long_enough = [d for d in documents if len(d) >= length]
    if not long_enough:
        raise SpecServeError(f"no document of the corpus has the {length} tokens a prefix needs")
    out = []
    while len(out) < n:
        for i in rng.permutation(len(long_enough))[:n - len(out)]:
            d = long_enough[i]
            start = int(rng.integers(0, len(d) - length + 1))
            out.append(d[start:start + length].tolist())
    return out


def sample_windows(sequences: list[np.ndarray], window: int, pad_id: int) -> np.ndarray:
    """One window per sequence (chat samples: a templated prompt plus the target's reply), truncated to
    `window` tokens and right-padded; padded positions are masked out of the loss by `pad_id`."""
    out = np.full((len(sequences), window), pad_id, dtype=np.int32)
    for i, s in enumerate(sequences):
        out[i, :min(window, len(s))] = s[:window]
    return out


def stream_windows(stream: np.ndarray, window: int) -> np.ndarray:
    """Consecutive non-overlapping windows [N, window] (the tail shorter than a window is dropped)."""
    n = len(stream) // window
    return stream[:n * window].reshape(n, window)


def frequent_vocab(stream: np.ndarray, size: int, vocab_size: int, must_keep: list[int]) -> list[int]:
    """The `size` most frequent token ids of the stream (ties by id), always including `must_keep`
    (EOS and chat-control tokens, which a draft must be able to propose)."""
    counts = np.bincount(stream, minlength=vocab_size).astype(np.int64)
    counts[np.asarray(must_keep, dtype=np.int64)] = np.iinfo(np.int64).max
    order = np.lexsort((np.arange(vocab_size), -counts))
    return sorted(int(t) for t in order[:size])


def coverage(stream: np.ndarray, vocab: list[int] | None) -> float:
    """Fraction of the stream's tokens that the draft vocabulary contains."""
    if vocab is None or len(stream) == 0:
        return 1.0
    return float(np.isin(stream, np.asarray(vocab)).mean())
