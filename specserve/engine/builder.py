"""Building an engine: load the target and drafts, size the KV cache, make the runners, the proposer and
the policy, profile the step cost. LLMEngine (llm_engine.py) then only runs steps on what this returns.

Each phase is timed and logged at startup (docs/design.md §5.1), beside the engine process's imports.
"""
from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass
from typing import Callable

import torch

from specserve.engine.block_manager import BlockManager
from specserve.engine.config import EngineConfig
from specserve.engine.executor import Executor
from specserve.engine.model_runner import ModelRunner, available_memory_bytes, kv_bytes_per_block
from specserve.engine.sampler import Sampler
from specserve.engine.scheduler import Scheduler
from specserve.engine.threads import ThreadGovernor
from specserve.errors import SpecServeError
from specserve.model import kernels as cpu_kernels
from specserve.model.loader import LoadedModel, load_model
from specserve.model.quantize import weight_summary
from specserve.settings import settings
from specserve.spec_decode.choice import DraftChoice
from specserve.spec_decode.config import SpeculativeConfig
from specserve.spec_decode.cost_model import StepCostModel
from specserve.spec_decode.draft_loader import build_proposer, draft_runners, load_drafts
from specserve.spec_decode.policies import make_policy
from specserve.spec_decode.speculation_models import SpeculationModels
from specserve.spec_decode.proposer_protocol import Proposer
from specserve.spec_decode.synthetic import SyntheticAcceptance

log = logging.getLogger("specserve.engine")

GiB = 1 << 30


@dataclass(slots=True)
class EngineParts:
    threads: ThreadGovernor | None  # None: the thread count was given, and is kept
    model_config: object
    tokenizer: object
    max_model_len: int
    runner: ModelRunner
    models: SpeculationModels
    proposer: Proposer | None
    policy: object | None
    executor: Executor
    scheduler: Scheduler
    synthetic_rates: list[float] | None  # benchmarks only (spec_decode/synthetic.py)
    measure_costs: Callable[[], StepCostModel]  # the step-cost sweep (or its cached result)


def build_engine(config: EngineConfig) -> EngineParts:
    if config.num_threads:
        torch.set_num_threads(config.num_threads)
    # Threads given: kept. Otherwise the step runs on the cores other processes leave free.
    threads = ThreadGovernor(torch.get_num_threads()) if not config.num_threads else None
    torch.manual_seed(config.seed)  # unseeded requests draw their generator seeds from here
    phases, clock = {}, time.perf_counter()

    def lap(name: str) -> None:
        nonlocal clock
        phases[name], clock = time.perf_counter() - clock, time.perf_counter()

    target = load_model(config.model, config.dtype, config.device, quantization=config.quantization)
    if config.quantization:
        log.info("weights: %s, %s activations (--quantization none loads them dense)",
                 weight_summary(target.model), config.dtype)
    max_model_len = config.max_model_len or min(target.config.max_position_embeddings, 4096)
    if max_model_len > target.config.max_position_embeddings:
        raise SpecServeError(f"max_model_len {max_model_len} exceeds the model's context "
                             f"({target.config.max_position_embeddings})")
    spec = config.speculative_config
    lap("target")
    drafts = load_drafts(spec, target, config) if spec else []
    lap("drafts")
    k = spec.num_speculative_tokens if spec else 0
    num_blocks = kv_blocks(config, target, drafts, max_model_len, k)
    make_runner = functools.partial(ModelRunner, num_blocks=num_blocks, block_size=config.block_size,
                                    max_model_len=max_model_len + k, enforce_eager=config.enforce_eager,
                                    max_graph_tokens=min(512, config.max_num_batched_tokens),
                                    max_num_seqs=config.max_num_seqs)
    runner = make_runner(target.model)
    models = SpeculationModels(k)
    proposer = build_proposer(spec, drafts, target, make_runner, DraftChoice(models)) if spec else None
    measure_costs = functools.partial(profile_step_costs, runner, proposer, config, target, drafts)
    policy = make_policy(spec.policy, k, spec.policy_options, models) if spec else None
    lap("runners")
    if (policy is not None and policy.uses_cost_model) or config.slo_tpot_ms:
        models.profile(measure_costs)  # before any request: the sweep writes into the KV cache
        lap("cost profile")
    log.info("startup: %s", ", ".join(f"{name} {seconds:.2f} s" for name, seconds in phases.items()))
    synthetic = synthetic_rates(spec)
    executor = Executor(runner, proposer, policy, Sampler(SyntheticAcceptance(synthetic, config.seed)
                                                          if synthetic else None))
    scheduler = Scheduler(BlockManager(num_blocks, config.block_size, config.enable_prefix_caching),
                          config.max_num_seqs, config.max_num_batched_tokens, max_model_len, k,
                          step_time=models.step_time, peek=proposer.peek if proposer is not None else None)
    return EngineParts(threads, target.config, target.tokenizer, max_model_len, runner, models, proposer, policy,
                       executor, scheduler, synthetic, measure_costs)


def kv_blocks(config: EngineConfig, target: LoadedModel, drafts: list[LoadedModel], max_model_len: int,
              k: int) -> int:
    """KV cache blocks in the budget, each holding the target's and every draft's cache of block_size tokens;
    an error if a request of max_model_len tokens and k drafts would not fit."""
    per_block = kv_bytes_per_block(target.model, config.block_size, target.model.embed_tokens.weight.dtype)
    for draft in drafts:  # each draft has its own cache tensors over the target's block tables
        per_block += kv_bytes_per_block(draft.model, config.block_size, draft.model.embed_tokens.weight.dtype)
    budget = (config.kv_cache_memory * GiB if config.kv_cache_memory >= 1
              else config.kv_cache_memory * available_memory_bytes(torch.device(config.device)))
    num_blocks = config.num_kv_blocks or int(budget // per_block)
    if num_blocks < -(-(max_model_len + k) // config.block_size):
        raise SpecServeError(f"the KV cache ({num_blocks * per_block / GiB:.3f} GiB) holds "
                             f"{num_blocks * config.block_size} tokens, fewer than max_model_len {max_model_len} "
                             f"+ {k}; raise --kv-cache-memory or lower --max-model-len")
    return num_blocks


def synthetic_rates(spec: SpeculativeConfig | None) -> list[float] | None:
    rates = spec.synthetic_rates if spec else None
    if rates:
        log.warning("synthetic acceptance: drafts kept at rates %s, not verified; outputs do not follow the "
                    "target model (benchmarks only)", [round(r, 3) for r in rates])
    return rates


def profile_step_costs(runner, proposer, config: EngineConfig, target, drafts) -> StepCostModel:
    """The step cost model's startup sweep, cached per model pair, device, dtype, quantization, kernels (their
    settings and build: edited kernels are measured again), threads and budget."""
    kernels = [settings.cpu_kernels, settings.batch_invariant, settings.int8_dot]
    kernels.append(cpu_kernels.library_id() if runner.device.type == "cpu" else None)
    key = "|".join(map(str, [target.path, [d.path for d in drafts], config.device, config.dtype,
                             config.quantization, kernels, torch.get_num_threads(), config.max_num_batched_tokens,
                             config.block_size, torch.__version__]))
    return StepCostModel.profile(runner, draft_runners(proposer), config.max_num_batched_tokens, key)
