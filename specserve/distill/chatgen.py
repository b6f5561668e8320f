"""Chat training samples: ShareGPT prompts in the target's chat template plus the target's own greedy reply,
generated with our engine in large batches (a draft must learn what the target says, not what users say).
Appended to a JSONL file in chunks, so an interrupted run keeps what it generated. Each sample comes with its
prompt length: the draft is trained on the reply positions only (as EAGLE trains on assistant turns)."""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from specserve.errors import SpecServeError


def chat_samples(target_name: str, tok, prompts: list[str], path: Path, max_prompt_tokens: int, max_reply_tokens: int,
                 batch: int = 32, log=print) -> list[tuple[np.ndarray, int]]:
    """(token ids: templated prompt + reply + EOS, prompt length) of every prompt, generating only those not in
    `path` yet."""
    done = {}
    if path.exists():
        for line in path.read_text().splitlines():
            row = json.loads(line)
            done[row["prompt"]] = row["ids"]
    from specserve import LLM, SamplingParams
    # Long prompts are cut (by tokens) so that prompt + reply fit a training window.
    prompt_ids = {p: tok.encode_chat([{"role": "user", "content": tok.decode(
        tok.encode(p, add_special_tokens=False)[:max_prompt_tokens])}]) for p in prompts}
    todo = [p for p in prompts if p not in done]
    if todo:
        llm = LLM(model=target_name, max_num_seqs=batch, dtype="bfloat16")
        path.parent.mkdir(parents=True, exist_ok=True)
        params = SamplingParams(max_tokens=max_reply_tokens, temperature=0)
        t0, made = time.perf_counter(), 0
        for start in range(0, len(todo), batch * 2):
            chunk = todo[start:start + batch * 2]
            outs = llm.generate([prompt_ids[p] for p in chunk], params)
            with path.open("a") as f:
                for p, out in zip(chunk, outs):
                    row = prompt_ids[p] + list(out.token_ids)
                    if not row or row[-1] not in tok.eos_token_ids:
                        row.append(tok.eos_token_ids[0])
                    done[p] = row
                    made += len(out.token_ids)
                    f.write(json.dumps({"prompt": p, "ids": row}) + "\n")
            log(f"generated replies for {min(start + len(chunk), len(todo))}/{len(todo)} prompts "
                f"({made / (time.perf_counter() - t0):.0f} tok/s)")
    out = []
    for p in prompts:
        n = len(prompt_ids[p])
        if done[p][:n] != prompt_ids[p]:
            raise SpecServeError(f"{path} holds a sample whose prompt does not tokenize as it does now (another "
                                 f"tokenizer or --reply-tokens?): start a new --work directory")
        out.append((np.asarray(done[p], dtype=np.int32), n))
    return out
