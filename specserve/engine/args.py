"""Engine flags shared by `specserve generate` and `specserve serve` (vLLM's names)."""
from __future__ import annotations

import argparse

from specserve.model.registry import DEFAULT_MODEL


def add_engine_args(p: argparse.ArgumentParser, max_num_batched_tokens: int,
                    speculative_default: str = "none, plain decoding") -> None:
    """`max_num_batched_tokens`: the per-step token budget's default for this command (server or offline);
    `speculative_default`: what --help says runs without --speculative-config. Every option's help names
    its default (tests/test_cli_help.py)."""
    g = p.add_argument_group("engine")
    g.add_argument("--model", default=DEFAULT_MODEL, help=f"HF directory, .gguf file or alias (default: {DEFAULT_MODEL})")
    g.add_argument("--speculative-config", default=None,
                   help='JSON, e.g. \'{"model": "default", "num_speculative_tokens": 4}\' or '
                        f'\'{{"method": "ngram", "num_speculative_tokens": 4}}\'; none: plain decoding '
                        f'(default: {speculative_default})')
    g.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"],
                   help="dtype of the weights and activations (default: %(default)s)")
    g.add_argument("--quantization", default="auto", choices=["auto", "none", "gguf", "q8_0", "q4_0", "q4_1"],
                   help="auto: a GGUF model on the CPU keeps its quantized matrices (gguf), else none; "
                        "none: dense in --dtype; q8_0/q4_0/q4_1: quantize at load (default: %(default)s)")
    g.add_argument("--device", default="auto",
                   help="auto (cuda if torch sees a GPU, else cpu), cpu or cuda[:N] (default: %(default)s)")
    g.add_argument("--max-num-seqs", type=int, default=64,
                   help="requests in the running batch at most (default: %(default)s)")
    g.add_argument("--max-num-batched-tokens", type=int, default=max_num_batched_tokens,
                   help=f"per-step token budget; prefills are chunked to fit (default: {max_num_batched_tokens})")
    g.add_argument("--max-model-len", type=int, default=None,
                   help="context length in tokens (default: the model's, at most 4096)")
    g.add_argument("--block-size", type=int, default=16, help="KV cache block size in tokens (default: %(default)s)")
    g.add_argument("--kv-cache-memory", type=float, default=1.0,
                   help="GiB (>= 1) or fraction of free memory (< 1) (default: %(default)s)")
    g.add_argument("--num-kv-blocks", type=int, default=None,
                   help="exact number of KV blocks, overriding --kv-cache-memory (default: from --kv-cache-memory)")
    g.add_argument("--num-threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    g.add_argument("--enforce-eager", action="store_true",
                   help="on a GPU, run every step op by op instead of replaying CUDA graphs (default: graphs)")
    g.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV blocks of a prompt prefix seen before (a system prompt, a conversation's "
                        "earlier turns) instead of computing them again (default: on)")
    g.add_argument("--seed", type=int, default=0,
                   help="engine seed, from which requests without a seed draw theirs (default: %(default)s)")
    g.add_argument("--slo-tpot-ms", type=float, default=None,
                   help="time-per-output-token objective of requests that set none (speculation policies and "
                        "the scheduler keep steps within it) (default: none)")
    g.add_argument("--slo-ttft-ms", type=float, default=None,
                   help="time-to-first-token objective of requests that set none (waiting requests are "
                        "admitted by deadline) (default: none)")


def engine_config_kwargs(args) -> dict:
    """EngineConfig's arguments from the flags, not yet resolved: resolving "auto" (the device, the
    quantization) imports torch, which a caller may want to leave to the engine process."""
    return dict(model=args.model, dtype=args.dtype, device=args.device, max_num_seqs=args.max_num_seqs,
                max_num_batched_tokens=args.max_num_batched_tokens, max_model_len=args.max_model_len,
                block_size=args.block_size, kv_cache_memory=args.kv_cache_memory, num_kv_blocks=args.num_kv_blocks,
                num_threads=args.num_threads, seed=args.seed, speculative_config=args.speculative_config,
                slo_tpot_ms=args.slo_tpot_ms, slo_ttft_ms=args.slo_ttft_ms, quantization=args.quantization,
                enforce_eager=args.enforce_eager, enable_prefix_caching=args.enable_prefix_caching)


def engine_config_from_args(args):
    from specserve.engine.config import EngineConfig
    return EngineConfig(**engine_config_kwargs(args))
