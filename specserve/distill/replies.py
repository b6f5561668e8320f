"""Training samples in the target's own words: a prompt followed by the target's greedy reply, generated with
our engine in large batches (a draft must learn what the target says, not what people wrote).

- chat: a ShareGPT prompt in the target's chat template + the target's reply, ending with EOS;
- continuations: a prefix of real text (code) + the target's next tokens, EOS ignored as the acceptance
  benchmark does, so every sample is exactly prefix + reply long.

Appended to a JSONL file in chunks keyed by the prompt, so an interrupted run keeps what it generated.
Generation can also keep the target's final hidden state of every position it ran (`FeatureRecorder`): an
EAGLE draft's training features, which would otherwise cost a second pass of the target over the windows."""
from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import numpy as np
import torch


class FeatureRecorder:
    """An engine's hidden-state tap (engine/executor.py): the target's final hidden state of every position each request runs,
    rows[request_id] [prompt + max_tokens, hidden] (a recomputed position after preemption overwrites)."""

    def __init__(self):
        self.rows: dict[str, torch.Tensor] = {}

    def __call__(self, entries, hidden: torch.Tensor) -> None:
        for seq, start, row, count in entries:
            if seq.request_id not in self.rows:  # kept in host memory: the training cache lives on disk
                self.rows[seq.request_id] = torch.zeros(seq.num_prompt_tokens + seq.params.max_tokens,
                                                        hidden.shape[1], dtype=hidden.dtype)
            self.rows[seq.request_id][start:start + count] = hidden[row:row + count].cpu()


def target_replies(target_name: str, prompts: list[tuple[str, list[int]]], path: Path, max_reply_tokens: int,
                   end_with_eos: bool, batch: int, log=print, features: dict | None = None,
                   device: str = "auto", temperature: float = 0.0, seed: int = 0) -> list[np.ndarray]:
    """Token ids (prompt + reply) of every (key, prompt ids), generating only the keys not in `path` yet.
    end_with_eos: stop at EOS and append one where the reply was cut; otherwise generate through EOS.
    temperature > 0: sampled replies, the i-th prompt's with seed `seed + i` (the same reply on a rerun).
    features: a dict to fill with key -> [len(ids), hidden], the target's (bf16) final hidden state at
    every position of each sample generated now (not of those read from `path`) but the final EOS of an
    EOS-ended sample, which the target never runs (len(ids) - 1 rows then)."""
    done = {}
    if path.exists():
        for line in path.read_text().splitlines():
            row = json.loads(line)
            done[row["prompt"]] = row["ids"]
    todo = [(key, ids) for key, ids in dict(prompts).items() if key not in done]
    if todo:
        from specserve import LLM, SamplingParams
        # No prefix caching: the recorder needs the hidden state of every position, and a prompt prefix taken
        # from the cache is not run.
        llm = LLM(model=target_name, max_num_seqs=batch, dtype="bfloat16", device=device,
                  enable_prefix_caching=features is None)
        eos = llm.tokenizer.eos_token_ids
        recorder = None
        if features is not None:
            recorder = FeatureRecorder()
            llm.engine.executor.hidden_taps.append(recorder)
        # The target runs the last kept token (its hidden state is a feature) only to sample one more: drop that.
        extra = int(recorder is not None)
        index = {key: i for i, (key, _) in enumerate(prompts)}

        def params(key):
            return SamplingParams(max_tokens=max_reply_tokens + extra, temperature=temperature,
                                  seed=seed + index[key] if temperature > 0 else None, ignore_eos=not end_with_eos)
        path.parent.mkdir(parents=True, exist_ok=True)
        t0, made = time.perf_counter(), 0
        for start in range(0, len(todo), batch * 2):
            chunk = todo[start:start + batch * 2]
            outs = llm.generate([ids for _, ids in chunk], [params(key) for key, _ in chunk])
            with path.open("a") as f:
                for (key, prompt_ids), out in zip(chunk, outs):
                    row = list(prompt_ids) + list(out.token_ids[:max_reply_tokens])
                    if end_with_eos and (not row or row[-1] not in eos):
                        row.append(eos[0])
                    if recorder is not None:
                        features[key] = recorder.rows.pop(out.request_id)[:len(row) - end_with_eos]
                    done[key] = row
                    made += min(len(out.token_ids), max_reply_tokens)
                    f.write(json.dumps({"prompt": key, "ids": row}) + "\n")
            log(f"generated replies for {min(start + len(chunk), len(todo))}/{len(todo)} prompts "
                f"({made / (time.perf_counter() - t0):.0f} tok/s)")
    return [np.asarray(done[key], dtype=np.int32) for key, _ in prompts]


def _key_by_sample(keyed: list, samples: list[np.ndarray], by_key: dict, features: dict) -> None:
    """Recorded features re-keyed from the prompt's key to the sample's bytes (int32), which is how the
    pipeline finds the features of a training window."""
    for (key, _), sample in zip(keyed, samples):
        if key in by_key:
            features[sample.tobytes()] = by_key[key]


def chat_prompt(tokenizer, text: str, max_prompt_tokens: int, keep_end: bool = False) -> list[int]:
    """A user message cut to about `max_prompt_tokens` tokens (so that prompt + reply fit a training window),
    in the target's chat template. keep_end: cut the middle instead of the end, keeping the beginning and the
    end (Spec-Bench's RAG questions follow their documents)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) <= max_prompt_tokens:
        cut = text
    elif keep_end:
        half = max_prompt_tokens // 2
        cut = tokenizer.decode(ids[:half]) + " ... " + tokenizer.decode(ids[len(ids) - half:])
    else:
        cut = tokenizer.decode(ids[:max_prompt_tokens])
    return tokenizer.encode_chat([{"role": "user", "content": cut}])


SAMPLE_TEMPERATURE = 0.8  # --replies-per-prompt: near the greedy reply's mode, yet most samples differ from it


def chat_samples(target_name: str, tokenizer, prompts: list[str], path: Path, max_prompt_tokens: int,
                 max_reply_tokens: int, log=print, keep_end: frozenset[str] = frozenset(),
                 features: dict | None = None, device: str = "auto", sampled: int = 0,
                 seed: int = 0) -> list[np.ndarray]:
    """Templated prompt + reply of every prompt (keyed by its text), without the EOS that ends each reply in
    `path`: a request stops at EOS, so the row after it would teach the draft nothing the engine asks.
    keep_end: prompts cut in the middle (`chat_prompt`). features: filled with the sample's bytes (int32) ->
    its target features, for samples generated now. sampled: instead of the greedy reply, this many replies
    per prompt sampled at SAMPLE_TEMPERATURE (keyed by text + sample number), prompt by prompt."""
    keyed = [(p, chat_prompt(tokenizer, p, max_prompt_tokens, p in keep_end)) for p in prompts]
    if sampled:
        keyed = [(f"{p}\x00sample {i}", ids) for p, ids in keyed for i in range(1, sampled + 1)]
    by_key = {} if features is not None else None
    # Bigger decode batches on a GPU; this 2-core CPU's matmuls turn compute-bound near 32-64 rows.
    batch = 128 if str(device).startswith("cuda") else 32
    samples = [s[:-1] for s in target_replies(target_name, keyed, path, max_reply_tokens, end_with_eos=True,
                                              batch=batch, log=log, features=by_key, device=device,
                                              temperature=SAMPLE_TEMPERATURE if sampled else 0.0, seed=seed)]
    if features is not None:
        _key_by_sample(keyed, samples, by_key, features)
    return samples


def continuation_samples(target_name: str, prefixes: list[list[int]], path: Path, reply_tokens: int,
                         log=print, features: dict | None = None, device: str = "auto") -> list[np.ndarray]:
    """Each prefix + exactly `reply_tokens` greedy target tokens (keyed by a hash of the prefix).
    features: filled with the sample's bytes (int32) -> its target features, for samples generated now."""
    keyed = [(hashlib.sha1(np.asarray(p, dtype=np.int32).tobytes()).hexdigest(), p) for p in prefixes]
    by_key = {} if features is not None else None
    samples = target_replies(target_name, keyed, path, reply_tokens, end_with_eos=False, batch=64, log=log,
                             features=by_key, device=device)
    if features is not None:
        _key_by_sample(keyed, samples, by_key, features)
    return samples
