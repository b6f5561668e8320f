"""Multi-turn conversations (`specserve bench --turns N`): what prefix caching is for. With `--dataset
code-edit`, multi-turn code editing instead (benchmark/code_edit.py).

Each conversation opens with an MT-Bench question and its follow-up (the data set's two turns), then asks
further MT-Bench first turns of the same category (the shipped ShareGPT files hold first turns only). Every
turn is a chat request carrying the whole history: the earlier user messages and the model's own replies
(its streamed text), so turn t re-sends everything turns 1..t-1 said. A turn is sent when the previous one
has ended plus a think time; conversations start at the run's arrival times. Each turn names its
conversation in OpenAI's `user` field, so a session-affine router can keep it where its prefix is cached. The record adds the mean TTFT
and E2E per turn index (`turns`) and the server's prefix-cache hit rate.
"""
from __future__ import annotations

import asyncio
import json

import numpy as np

from specserve.benchmark import code_edit
from specserve.benchmark.client import RequestResult, StreamingClient, monotonic_clock
from specserve.benchmark.arrival_schedules import DATA_DIR
from specserve.benchmark.prompts import DATASETS


def build_conversations(n: int, turns: int, seed: int = 0, dataset: str = "mt-bench") -> list[list[str]]:
    """n conversations of `turns` user messages each, from MT-Bench, or with dataset "code-edit" sessions of
    edits to one function each (benchmark/code_edit.py) (seeded)."""
    if dataset == code_edit.DATASET:
        return code_edit.build_sessions(n, turns, seed)
    text = (DATA_DIR / DATASETS["mt-bench"]).read_text()
    rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    rng = np.random.default_rng([seed, 4])
    out = []
    for i in rng.permutation(len(rows))[:n] if n <= len(rows) else rng.integers(0, len(rows), n):
        first = rows[i]
        same = [r["turns"][0] for r in rows if r["category"] == first["category"] and r is not first]
        extra = [same[j] for j in rng.permutation(len(same))]
        out.append((list(first["turns"]) + extra)[:turns])
    return out


async def execute_conversations(client: StreamingClient, conversations: list[list[str]], starts: np.ndarray,
                                max_tokens: int, think_time_s: float, progress) -> list[RequestResult]:
    """Every conversation from its start time, turn after turn. Results in (conversation, turn) order;
    `arrival_s` is when each turn became ready to send."""
    clock = monotonic_clock()
    results: list[list[RequestResult]] = [[] for _ in conversations]

    async def talk(c: int) -> None:
        await asyncio.sleep(max(0.0, float(starts[c]) - clock()))
        history: list[dict] = []
        for t, question in enumerate(conversations[c]):
            history.append({"role": "user", "content": question})
            r = RequestResult(id=-1, arrival_s=clock(), max_tokens=max_tokens, turn=t, text="")
            await client.send(r, "", clock, messages=list(history), session=f"conversation-{c}")
            results[c].append(r)
            progress.advance(r.ok)
            if not r.ok:
                return  # the conversation cannot go on without its reply
            history.append({"role": "assistant", "content": r.text})
            await asyncio.sleep(think_time_s)

    await asyncio.gather(*(talk(c) for c in range(len(conversations))))
    flat = [r for rs in results for r in rs]
    for i, r in enumerate(flat):
        r.id = i
    return flat


def per_turn(results: list[RequestResult]) -> list[dict]:
    """Mean TTFT and E2E (s) of the completed requests of each turn index."""
    out = []
    for t in sorted({r.turn for r in results if r.turn is not None}):
        ok = [r for r in results if r.turn == t and r.ok]
        out.append({"turn": t + 1, "requests": len(ok),
                    "mean_prompt_tokens": float(np.mean([r.prompt_tokens for r in ok if r.prompt_tokens]))
                    if any(r.prompt_tokens for r in ok) else None,
                    "mean_ttft_s": float(np.mean([r.ttft_s for r in ok])) if ok else None,
                    "mean_e2e_s": float(np.mean([r.e2e_s for r in ok])) if ok else None})
    return out
