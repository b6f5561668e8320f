"""TRAINING.md for a distilled draft: how it was made (command, seed, code revision, data, times) and a
summary of its training log, written from distill.json and the run's train_log.jsonl."""
from __future__ import annotations

import json
from pathlib import Path


def training_card(info: dict, log_rows: list[dict], revision: str | None = None) -> str:
    evals = [r for r in log_rows if r.get("agreement") is not None]
    # About eight evenly spaced rows plus the last: enough to see the learning curve.
    stride = max(1, len(evals) // 8)
    shown = evals[::stride] + ([evals[-1]] if evals and evals[-1] is not evals[::stride][-1] else [])
    cov = info.get("vocab_coverage", {})
    final_loss = "-" if info.get("final_loss") is None else f"{info['final_loss']:.3f}"
    eagle = info.get("method") == "eagle"
    step2 = info.get("heldout_top1_agreement_step2")
    if eagle:
        shape = (f"EAGLE draft: {info['layers']} layer(s) of the target's shape (hidden {info['hidden']}) reading the "
                 f"target's hidden state, head over {info['draft_vocab_size'] or 'all'} target tokens; "
                 f"{info['params'] / 1e6:.1f}M parameters (the input embedding is the target's, not stored)")
    else:
        shape = (f"draft: {info['layers']} layers, hidden {info['hidden']}, input embedding rank "
                 f"{info['embedding_rank'] or 'full'}, head over {info['draft_vocab_size'] or 'all'} target tokens; "
                 f"{info['params'] / 1e6:.1f}M parameters")
    lines = [
        f"# Draft distilled for {info['target']}", "",
        "## How it was made", "",
        "```bash", info["command"], "```", "",
        f"- code revision: {revision or 'not recorded'}",
        f"- seed: {info['seed']}; corpus: {' '.join(info['corpus'])}; {info['train_windows']:,} training windows "
        f"of {info['window']} tokens (held-out split: see docs/distill.md)",
        f"- {shape}",
        f"- draft vocabulary coverage of the corpus: {cov.get('train', 1):.1%} (train), "
        f"{cov.get('heldout', 1):.1%} (held-out)",
        f"- time: {info['prep_seconds'] / 60:.1f} min data preparation (tokenizing"
        f"{', generating target replies' if 'chat' in info['corpus'] else ''}, held-out teaching), "
        f"{info['train_seconds'] / 60:.1f} min training (of which the teacher: "
        f"{'features' if eagle else 'top-k logits'} of {info['teacher_tokens_cached']:,} tokens)",
        f"- {info['steps']} optimizer steps, {info['tokens_seen']:,} tokens seen; final loss "
        f"{final_loss}; held-out top-1 agreement with the target {info['heldout_top1_agreement']:.1%}"
        + (f" (second draft step, reading its own prediction: {step2:.1%})" if step2 is not None else ""),
        "", "## Training log (held-out top-1 agreement with the target's argmax)", "",
        "| step | minutes | loss | tokens seen | of which teaching (min) | held-out top-1 |"
        + (" second step |" if step2 is not None else ""),
        "|---|---|---|---|---|---|" + ("---|" if step2 is not None else ""),
    ]
    for r in shown:
        loss = f"{r['loss']:.3f}" if r.get("loss") is not None else "-"
        teach = f"{r['teacher_seconds'] / 60:.1f}" if r.get("teacher_seconds") is not None else "-"
        lines.append(f"| {r['step']} | {r['elapsed'] / 60:.1f} | {loss} | {r.get('tokens', 0):,} | {teach} | "
                     f"{r['agreement']:.1%} |" + (f" {r['agreement_step2']:.1%} |" if step2 is not None else ""))
    return "\n".join(lines) + "\n"


def write_card(draft_dir: Path, work_dir: Path, revision: str | None = None) -> Path:
    info = json.loads((Path(draft_dir) / "distill.json").read_text())
    log_path = Path(work_dir) / "train_log.jsonl"
    rows = [json.loads(line) for line in log_path.read_text().splitlines()] if log_path.exists() else []
    path = Path(draft_dir) / "TRAINING.md"
    path.write_text(training_card(info, rows, revision))
    return path
