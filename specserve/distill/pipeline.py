"""`specserve distill` end to end: corpus -> windows and held-out split -> draft vocabulary -> student
init -> teacher-cached training -> exported draft directory. State lives in a work directory (windows,
vocabulary, teacher shards, checkpoint, log) so `--resume` continues where a run stopped."""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from specserve.distill import corpus
from specserve.distill.replies import chat_samples, continuation_samples
from specserve.distill.teacher import PAD, TeacherCache, teach, teach_features
from specserve.distill.train import DistillObjective, TrainConfig, train
from specserve.errors import SpecServeError


@dataclass
class DistillConfig:
    target: str
    out: Path
    corpus: list[str]
    work: Path
    method: str = "draft"              # "draft" (standalone) or "eagle" (reads the target's hidden state)
    layers: int = 4
    hidden: int = 320
    embedding_rank: int | None = 64
    draft_vocab: int | None = 8192
    window: int | None = None          # default: 320 for code and files, 512 for chat
    topk: int = 32
    shard_windows: int = 32
    eval_windows: int = 24
    train_windows: int | None = None   # use only the first N (shuffled) training windows (None: all)
    chat_prompts: int | None = None    # how many ShareGPT prompts get a target reply (None: all)
    spec_bench: bool = False           # chat: also the 350 Spec-Bench task questions outside the held-out set
    replies_per_prompt: int = 1        # chat: the greedy reply plus N - 1 replies sampled at temperature 0.8
    continuations: int | None = None   # code/files: windows of a text prefix + the target's continuation
    max_reply_tokens: int = 192        # chat: longest reply; continuations: the reply part of each window
    ttt_steps: int = 2                 # eagle: draft steps unrolled in training (EAGLE-3's training-time test)
    kl_weight: float = 0.1             # eagle: weight of KL(p || q) next to the feature regression's 1.0
    train: TrainConfig = field(default_factory=TrainConfig)
    resume: bool = False
    prepare_only: bool = False         # build the data and fill the teacher cache, then stop
    device: str = "auto"               # where the target teaches and the draft trains: auto, cpu or cuda[:N]
    command: str = ""


def _vocab_fingerprint(tokenizer) -> str:
    return hashlib.sha256(json.dumps(sorted(tokenizer.hf.get_vocab().items())).encode()).hexdigest()[:16]


def _git_revision() -> str | None:
    """The specserve commit the run used (+ "dirty" when the distill code had local edits), if in git."""
    import subprocess
    root = Path(__file__).resolve().parents[2]
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "specserve/distill", "specserve/model"], cwd=root,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return (rev + (" (with uncommitted changes)" if dirty else "")) if rev else None


def build_data(cfg: DistillConfig, target, log, features: dict | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Training windows (shuffled), held-out windows and the token stream used for vocabulary counts.
    features: filled with window bytes -> target features [window, hidden] for the samples generated now."""
    tok, eos = target.tokenizer, target.tokenizer.eos_token_ids[0]
    rng = np.random.default_rng(cfg.train.seed)
    kind = cfg.corpus[0] if cfg.corpus[0] in ("code", "chat") else "files"
    if cfg.spec_bench and kind != "chat":
        raise SpecServeError("--spec-bench adds chat prompts: it needs --corpus chat")
    if cfg.replies_per_prompt > 1 and kind != "chat":
        raise SpecServeError("--replies-per-prompt adds replies to chat prompts: it needs --corpus chat")
    if kind == "chat":
        if cfg.continuations:
            raise SpecServeError("--continuations applies to code and text files; chat samples are the target's "
                                 "replies already")
        window = cfg.window or 512
        max_prompt = window - cfg.max_reply_tokens
        train_prompts = corpus.sharegpt_prompts("train")[:cfg.chat_prompts]
        bench = [q["text"] for q in corpus.spec_bench_questions("train")] if cfg.spec_bench else []
        train_prompts += bench
        eval_prompts = corpus.sharegpt_prompts("eval")[:cfg.eval_windows]
        by_sample = {} if features is not None else None
        path, keep_end = cfg.work / "chat_samples.jsonl", frozenset(bench)
        samples = chat_samples(cfg.target, tok, train_prompts + eval_prompts, path, max_prompt, cfg.max_reply_tokens,
                               log=log, keep_end=keep_end, features=by_sample, device=cfg.device)
        train_seqs, eval_seqs = samples[:len(train_prompts)], samples[len(train_prompts):]
        if cfg.replies_per_prompt > 1:  # more of the target's replies to the same prompts (held-out: greedy only)
            train_seqs += chat_samples(cfg.target, tok, train_prompts, path, max_prompt, cfg.max_reply_tokens,
                                       log=log, keep_end=keep_end, features=by_sample, device=cfg.device,
                                       sampled=cfg.replies_per_prompt - 1, seed=cfg.train.seed)
            samples = train_seqs + eval_seqs
        train_w = corpus.sample_windows(train_seqs, window, PAD)
        eval_w = corpus.sample_windows(eval_seqs, window, PAD)
        stream = np.concatenate(train_seqs)
        if features is not None:  # the windows are the samples cut or padded to `window` (zero features)
            for seq, w in zip(samples, np.concatenate([train_w, eval_w])):
                if (f := by_sample.get(seq.tobytes())) is not None:
                    features[w.tobytes()] = F.pad(f[:window], (0, 0, 0, window - min(window, len(f))))
    else:
        window = cfg.window or 320
        if kind == "code":
            train_texts = corpus.read_texts(corpus.stdlib_files("train"))
            eval_texts = corpus.read_texts(corpus.stdlib_files("eval"))
        else:
            paths = sorted(Path(p) for p in cfg.corpus)
            missing = [str(p) for p in paths if not p.is_file()]
            if missing:
                raise SpecServeError(f"corpus files not found: {', '.join(missing)}")
            texts = corpus.read_texts(paths)
            held = [corpus._held_out(str(p), 20) for p in paths]
            if all(held) or not any(held):  # too few files for a hash split: hold out the last twentieth
                joined = "\n".join(texts)
                cut = len(joined) * 19 // 20
                train_texts, eval_texts = [joined[:cut]], [joined[cut:]]
            else:
                train_texts = [t for t, h in zip(texts, held) if not h]
                eval_texts = [t for t, h in zip(texts, held) if h]
        t0 = time.perf_counter()
        train_docs, eval_docs = corpus.tokenize(tok, train_texts), corpus.tokenize(tok, eval_texts)
        stream = corpus.token_stream(train_docs, eos)
        train_w = corpus.stream_windows(stream, window)
        eval_w = corpus.stream_windows(corpus.token_stream(eval_docs, eos), window)
        log(f"tokenized {len(train_texts)} training texts: {len(stream):,} tokens, {len(train_w):,} windows "
            f"of {window} ({time.perf_counter() - t0:.0f}s)")
        if cfg.continuations:
            # The draft drafts inside the target's replies: train on those (EAGLE's target-generated data).
            prefix = window - cfg.max_reply_tokens
            if prefix < 1:
                raise SpecServeError(f"--reply-tokens {cfg.max_reply_tokens} leaves no prefix in a {window}-token "
                                     f"window")
            prompts = (corpus.prefixes(train_docs, cfg.continuations, prefix, rng)
                       + corpus.prefixes(eval_docs, cfg.eval_windows, prefix, rng))
            samples = continuation_samples(cfg.target, prompts, cfg.work / "continuations.jsonl",
                                           cfg.max_reply_tokens, log=log, features=features, device=cfg.device)
            train_w, eval_w = np.stack(samples[:cfg.continuations]), np.stack(samples[cfg.continuations:])
            stream = np.concatenate([stream, train_w.ravel()])  # the draft vocabulary covers the replies too
    if len(train_w) == 0 or len(eval_w) == 0:
        raise SpecServeError(f"corpus too small for a {window}-token training window and a held-out window")
    train_w = train_w[rng.permutation(len(train_w))][:cfg.train_windows]
    eval_w = eval_w[rng.permutation(len(eval_w))[:cfg.eval_windows]]
    return train_w, eval_w, stream


def _eval_shard(path: Path, eval_w: np.ndarray, make) -> dict:
    """The held-out windows' teacher outputs, cached next to the training shards."""
    from safetensors.torch import load_file, save_file
    if path.exists() and np.array_equal(load_file(str(path))["tokens"].numpy(), eval_w):
        return load_file(str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    shard = make(eval_w)
    save_file(shard, str(path))
    return shard


def run(cfg: DistillConfig, log=print, progress_cb=None) -> dict:
    from specserve.distill.export import export_draft
    from specserve.distill.student import draft_config, init_student
    from specserve.engine.config import resolve_device
    from specserve.model.loader import load_model

    t_start = time.perf_counter()
    cfg.device = resolve_device(cfg.device)
    cfg.work.mkdir(parents=True, exist_ok=True)
    target = load_model(cfg.target, "float32", cfg.device)
    meta_path = cfg.work / "meta.json"
    fingerprint = _vocab_fingerprint(target.tokenizer)
    if cfg.resume and meta_path.exists() and json.loads(meta_path.read_text())["tokenizer"] != fingerprint:
        raise SpecServeError(f"cannot resume {cfg.work}: it was distilled for a target with a different "
                             f"tokenizer than {cfg.target}")
    recorded: dict[bytes, torch.Tensor] = {}  # EAGLE features the target computed while generating
    train_w, eval_w, stream = build_data(cfg, target, log, recorded if cfg.method == "eagle" else None)
    vocab_map = None
    if cfg.draft_vocab and cfg.draft_vocab < target.config.vocab_size:
        must = list(target.tokenizer.eos_token_ids) + [t for t in (target.config.bos_token_id,) if t is not None]
        vocab_map = corpus.frequent_vocab(stream, cfg.draft_vocab, target.config.vocab_size, must)
    eval_stream = eval_w[eval_w >= 0]
    cov = {"train": round(corpus.coverage(stream, vocab_map), 4),
           "heldout": round(corpus.coverage(eval_stream, vocab_map), 4)}
    log(f"draft vocabulary: {len(vocab_map) if vocab_map else target.config.vocab_size} tokens, corpus coverage "
        f"{cov['train']:.1%} (train) / {cov['heldout']:.1%} (held-out)")
    meta_path.write_text(json.dumps({"tokenizer": fingerprint, "target": cfg.target}) + "\n")
    vm = torch.tensor(vocab_map) if vocab_map is not None else None
    if cfg.method == "eagle":
        from specserve.distill.eagle_draft import EagleObjective, eagle_config, init_eagle, target_argmax
        teacher = target.model.to(torch.bfloat16)  # the engine serves the target in bf16: teach what it says
        dcfg = eagle_config(target.config, cfg.layers, len(vocab_map) if vocab_map else None)
        student = init_eagle(teacher, dcfg, vm, cfg.train.seed).to(cfg.device)  # reads the served (bf16) embedding and head
        cache = TeacherCache(cfg.work / "features", lambda rows: teach_features(teacher, rows), train_w,
                             cfg.shard_windows)

        def recorded_shard(windows):
            if windows.size and all(w.tobytes() in recorded for w in windows):
                return {"tokens": torch.from_numpy(windows), "features": torch.stack([recorded[w.tobytes()] for w in windows])}

        for i in range(cache.num_shards):  # shards whose every window was recorded skip the teacher
            if (shard := recorded_shard(cache.rows(i))) is not None:
                cache.put(i, shard)

        def eval_features(windows):
            shard = recorded_shard(windows) or teach_features(teacher, windows)
            return {**shard, "argmax": target_argmax(teacher, shard)}

        eval_shard = _eval_shard(cfg.work / "features" / "eval.safetensors", eval_w, eval_features)
        recorded.clear()  # on disk now
        objective = EagleObjective(eval_shard, passes=cfg.ttt_steps, cls_weight=cfg.kl_weight, device=cfg.device)
    else:
        dcfg = draft_config(target.config, cfg.layers, cfg.hidden, len(vocab_map) if vocab_map else None,
                            cfg.embedding_rank)
        student = init_student(target.model, dcfg, vm, cfg.train.seed).to(cfg.device)
        teacher = target.model.to(torch.bfloat16)
        cache = TeacherCache(cfg.work / "teacher", lambda rows: teach(teacher, rows, cfg.topk), train_w,
                             cfg.shard_windows)
        eval_shard = _eval_shard(cfg.work / "teacher" / "eval.safetensors", eval_w,
                                 lambda w: teach(teacher, w, cfg.topk))
        objective = DistillObjective(eval_shard, target.config.vocab_size, vm, cfg.train.ce_weight, cfg.device)
    if cfg.prepare_only:
        for i in range(cache.num_shards):
            cache.get(i)
        prep_seconds = time.perf_counter() - t_start
        log(f"prepared {cfg.work}: {cache.num_shards} teacher shards ({cache.tokens_taught:,} tokens taught in "
            f"{cache.seconds_teaching / 60:.1f} min), {prep_seconds / 60:.1f} min in all; no draft trained")
        return {"prep_seconds": round(prep_seconds, 1), "teacher_tokens_cached": cache.tokens_taught,
                "teacher_seconds": round(cache.seconds_teaching, 1), "shards": cache.num_shards}
    prep_seconds = time.perf_counter() - t_start
    summary = train(student, None if vm is None else vm.to(cfg.device), cache, objective, cfg.train, cfg.work,
                    cfg.resume, progress_cb)
    # Shipped parameters: an EAGLE draft borrows the target's embedding.
    params = sum(p.numel() for n, p in student.named_parameters() if not (dcfg.eagle and n == "embed_tokens.weight"))
    info = {"command": cfg.command, "target": cfg.target, "corpus": cfg.corpus, "seed": cfg.train.seed,
            "method": cfg.method, "layers": cfg.layers, "hidden": dcfg.hidden_size,
            "embedding_rank": dcfg.embedding_rank, **({"ttt_steps": cfg.ttt_steps, "kl_weight": cfg.kl_weight} if dcfg.eagle else {}),
            "draft_vocab_size": dcfg.draft_vocab_size, "vocab_coverage": cov, "params": params,
            "train_windows": int(len(train_w)), "window": int(train_w.shape[1]),
            "teacher_tokens_cached": cache.tokens_taught, "prep_seconds": round(prep_seconds, 1),
            "train": asdict(cfg.train), **summary}
    export_draft(student, vocab_map, target.path, cfg.out, info)
    from specserve.distill.card import write_card
    write_card(cfg.out, cfg.work, _git_revision())
    log(f"saved draft to {cfg.out}: {params / 1e6:.1f}M parameters, held-out top-1 agreement "
        f"{summary['heldout_top1_agreement']:.1%}, {summary['train_seconds'] / 60:.1f} min training")
    return info
