"""`specserve distill`: train a small draft model for a target (argparse only at import; see specserve/cli.py)."""
from __future__ import annotations

import argparse
import shlex

from specserve.model.registry import DEFAULT_MODEL


def register(subparsers) -> None:
    p = subparsers.add_parser(
        "distill", help="train a draft model for speculative decoding",
        description="Distil a small Llama-family draft from a target (teacher forcing on real text, cached "
                    "top-k target logits, optional reduced draft vocabulary) and save a directory that "
                    "--speculative-config accepts.",
        epilog="example: specserve distill --target smollm2-135m --out my-draft --corpus code --method eagle "
               "--minutes 60 (docs/distill.md)")
    p.add_argument("--target", default=DEFAULT_MODEL, help="target model (directory, .gguf or alias)")
    p.add_argument("--out", required=True, help="directory to write the draft to")
    p.add_argument("--corpus", nargs="+", required=True, metavar="{code,chat,FILE}",
                   help="code: the Python standard library; chat: ShareGPT prompts with target replies; "
                        "or text files")
    p.add_argument("--method", choices=("draft", "eagle"), default="draft",
                   help="draft: a standalone small model; eagle: one or more layers of the target's width that "
                        "read the target's final hidden state (--hidden and --embedding-rank do not apply)")
    p.add_argument("--layers", type=int, help="decoder layers (default 4; 1 for eagle)")
    p.add_argument("--hidden", type=int, default=320)
    p.add_argument("--embedding-rank", type=int, default=64,
                   help="rank of the factorised input embedding (0: full vocab x hidden table)")
    p.add_argument("--draft-vocab", type=int, default=8192,
                   help="keep the V most frequent target tokens of the corpus in the head (0: all)")
    budget = p.add_mutually_exclusive_group(required=True)
    budget.add_argument("--minutes", type=float, help="training wall-clock budget")
    budget.add_argument("--steps", type=int, help="optimizer steps")
    p.add_argument("--batch", type=int, default=16, help="windows per step")
    p.add_argument("--window", type=int, help="tokens per window (default 320; 512 for chat)")
    p.add_argument("--train-windows", type=int, help="train on the first N shuffled windows only (default all)")
    p.add_argument("--lr", type=float, default=1.5e-3)
    p.add_argument("--echo", type=int, default=2, help="optimizer steps per teacher shard")
    p.add_argument("--topk", type=int, default=32, help="target logits cached per position")
    p.add_argument("--chat-prompts", type=int, help="ShareGPT prompts to generate target replies for (default all)")
    p.add_argument("--spec-bench", action="store_true",
                   help="chat: also reply to the 350 Spec-Bench task questions (translation, summarization, qa, "
                        "math_reasoning, rag) outside the held-out ones the benchmarks use")
    p.add_argument("--replies-per-prompt", type=_positive_int, default=1,
                   help="chat: the target's greedy reply plus N-1 replies sampled at temperature 0.8 (seeded) "
                        "per training prompt: more training data from the same prompts")
    p.add_argument("--reply-tokens", type=int, default=192,
                   help="longest target reply generated per chat prompt; with --continuations, the reply part "
                        "of each window")
    p.add_argument("--continuations", type=_positive_int,
                   help="code or FILES: train on N windows of a text prefix followed by the target's own greedy "
                        "continuation (--reply-tokens of the --window) instead of windows of the text alone")
    p.add_argument("--ttt-steps", type=_positive_int, default=2,
                   help="eagle: draft steps unrolled in training, each reading the previous step's own "
                        "prediction (EAGLE-3's training-time test)")
    p.add_argument("--kl-weight", type=_nonnegative_float, default=0.1,
                   help="eagle: weight of the token loss KL(target || draft) next to the feature regression's 1")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", help="work directory for caches and checkpoints (default runs/distill/<out name>)")
    p.add_argument("--resume", action="store_true", help="continue from the work directory's checkpoint")
    p.add_argument("--prepare-only", action="store_true",
                   help="build the data and the whole teacher cache in --work, then stop without training "
                        "(the same command without it then trains on the cached teacher)")
    p.add_argument("--threads", type=int, help="torch CPU threads")
    p.add_argument("--device", help="auto (the default: cuda if torch sees a GPU, else cpu), cpu or cuda[:N]")
    p.set_defaults(func=_run)


def _positive_int(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return int(text)


def _nonnegative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"expected a non-negative number, got {text!r}")
    return value


def _command(args: argparse.Namespace) -> str:
    """The run as one explicit command line (every option, defaults included), for the draft's TRAINING.md."""
    parts = ["specserve", "distill"]
    # Options the method ignores: an EAGLE draft's shape is the target's; only EAGLE unrolls draft steps.
    unused = ("hidden", "embedding_rank", "topk") if args.method == "eagle" else ("ttt_steps", "kl_weight")
    for key, value in vars(args).items():
        if key in ("func", "command", "resume", "prepare_only", *unused) or value is None or value is False:
            continue
        flag = "--" + key.replace("_", "-")
        parts += [flag, *map(str, value)] if isinstance(value, list) else [flag] if value is True else [flag, str(value)]
    return shlex.join(parts)


def _run(args: argparse.Namespace) -> int:
    from pathlib import Path

    import torch

    from specserve.distill.pipeline import DistillConfig, run
    from specserve.distill.progress import ProgressBar
    from specserve.distill.train import TrainConfig

    if args.threads:
        torch.set_num_threads(args.threads)
    out = Path(args.out)
    work = Path(args.work) if args.work else Path("runs") / "distill" / out.name
    tcfg = TrainConfig(minutes=args.minutes, steps=args.steps, batch=args.batch, lr=args.lr, echo=args.echo,
                       seed=args.seed)
    if args.layers is None:
        args.layers = 1 if args.method == "eagle" else 4
    cfg = DistillConfig(target=args.target, out=out, corpus=args.corpus, work=work, method=args.method,
                        layers=args.layers, train_windows=args.train_windows,
                        hidden=args.hidden, embedding_rank=args.embedding_rank or None,
                        draft_vocab=args.draft_vocab or None, window=args.window, topk=args.topk,
                        chat_prompts=args.chat_prompts, spec_bench=args.spec_bench,
                        replies_per_prompt=args.replies_per_prompt,
                        continuations=args.continuations,
                        max_reply_tokens=args.reply_tokens, train=tcfg,
                        ttt_steps=args.ttt_steps, kl_weight=args.kl_weight, resume=args.resume,
                        prepare_only=args.prepare_only, device=args.device or "auto",
                        command=_command(args))
    with ProgressBar() as bar:
        run(cfg, log=bar.log, progress_cb=bar.update)
    return 0
