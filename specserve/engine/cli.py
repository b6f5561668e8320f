"""`specserve generate`: offline generation from the command line."""
from __future__ import annotations

import argparse

from specserve.engine.args import add_engine_args
from specserve.engine.config import OFFLINE_MAX_NUM_BATCHED_TOKENS

SAMPLE_PROMPT = "Write a Python function that checks whether a number is prime."


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "generate", help="generate text offline (batched, optionally speculative)",
        description="Generate text for one or more prompts without a server (the engine run in-process).",
        epilog="example: specserve generate --prompt 'def fibonacci(n):' --max-tokens 64 "
               "--speculative-config '{\"model\": \"default\", \"num_speculative_tokens\": 3}'")
    add_engine_args(p, OFFLINE_MAX_NUM_BATCHED_TOKENS)
    p.add_argument("--prompt", action="append", help="a prompt (repeatable); default: a sample prompt")
    p.add_argument("--prompts-file", help="a text file with one prompt per line")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the model's chat template")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--seed-per-request", type=int, default=None, dest="request_seed",
                   help="sampling seed of every request")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.set_defaults(func=_generate)


def _generate(args) -> int:
    import time
    from pathlib import Path

    from specserve.engine.args import engine_config_from_args
    from specserve.engine.llm import LLM
    from specserve.engine.sampling_params import SamplingParams
    from specserve.errors import SpecServeError

    prompts = list(args.prompt or [])
    if args.prompts_file:
        path = Path(args.prompts_file)
        if not path.is_file():
            raise SpecServeError(f"prompts file not found: {path}")
        prompts += [line for line in path.read_text().splitlines() if line.strip()]
    if not prompts:
        prompts = [SAMPLE_PROMPT]
        args.chat = True
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            top_k=args.top_k, seed=args.request_seed, stop=args.stop, ignore_eos=args.ignore_eos)
    llm = LLM(config=engine_config_from_args(args))
    inputs = [llm.tokenizer.encode_chat([{"role": "user", "content": p}]) if args.chat else p for p in prompts]
    t0 = time.perf_counter()
    outputs = llm.generate(inputs, params)
    elapsed = time.perf_counter() - t0
    for prompt, out in zip(prompts, outputs):
        print(f"### prompt: {prompt}\n{out.text}\n[{len(out.token_ids)} tokens, finish_reason={out.finish_reason}]")
    n = sum(len(o.token_ids) for o in outputs)
    line = f"{len(outputs)} requests, {n} tokens in {elapsed:.2f} s ({n / elapsed:.1f} tok/s)"
    drafts = sum(o.spec["num_drafts"] for o in outputs)
    if drafts:
        acc = sum(o.spec["num_accepted_tokens"] for o in outputs)
        line += (f"; speculative: {sum(o.spec['num_draft_tokens'] for o in outputs)} drafted, {acc} accepted, "
                 f"mean acceptance length {1 + acc / drafts:.2f}")
    print(line)
    return 0
