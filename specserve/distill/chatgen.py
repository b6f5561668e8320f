"""Chat training samples: ShareGPT prompts in the target's chat template plus the target's own greedy reply,
generated with our engine in large batches (a draft must learn what the target says, not what users say).
Appended to a JSONL file in chunks, so an interrupted run keeps what it generated."""
from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np


def chat_samples(target_name: str, prompts: list[str], path: Path, max_prompt_tokens: int, max_reply_tokens: int,
                 batch: int = 32, log=print) -> list[np.ndarray]:
    """Token ids (templated prompt + reply + EOS) of every prompt, generating only those not in `path` yet."""
    done = {}
    if path.exists():
        for line in path.read_text().splitlines():
            row = json.loads(line)
            done[row["prompt"]] = row["ids"]
    todo = [p for p in prompts if p not in done]
    if todo:
        from specserve import LLM, SamplingParams
        llm = LLM(model=target_name, max_num_seqs=batch, dtype="bfloat16")
        tok = llm.tokenizer
        params = SamplingParams(max_tokens=max_reply_tokens, temperature=0)
        t0, made = time.perf_counter(), 0
        for start in range(0, len(todo), batch * 2):
            chunk = todo[start:start + batch * 2]
            # Long prompts are cut (by tokens) so that prompt + reply fit a training window.
            texts = [tok.decode(tok.encode(p, add_special_tokens=False)[:max_prompt_tokens]) for p in chunk]
            ids = [tok.encode_chat([{"role": "user", "content": t}]) for t in texts]
            outs = llm.generate(ids, params)
            with path.open("a") as f:
                for p, prompt_ids, out in zip(chunk, ids, outs):
                    row = prompt_ids + list(out.token_ids)
                    if not row or row[-1] not in tok.eos_token_ids:
                        row.append(tok.eos_token_ids[0])
                    done[p] = row
                    made += len(out.token_ids)
                    f.write(json.dumps({"prompt": p, "ids": row}) + "\n")
            log(f"generated replies for {min(start + len(chunk), len(todo))}/{len(todo)} prompts "
                f"({made / (time.perf_counter() - t0):.0f} tok/s)")
    return [np.asarray(done[p], dtype=np.int32) for p in prompts]
