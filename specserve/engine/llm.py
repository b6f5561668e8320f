"""Offline batch generation in vLLM's style: `LLM(model=...).generate(prompts, SamplingParams(...))`."""
from __future__ import annotations

from specserve.engine.config import OFFLINE_MAX_NUM_BATCHED_TOKENS, EngineConfig
from specserve.engine.llm_engine import LLMEngine
from specserve.engine.outputs import RequestOutput
from specserve.engine.sampling_params import SamplingParams
from specserve.model.registry import DEFAULT_MODEL


class LLM:
    def __init__(self, model: str = DEFAULT_MODEL, config: EngineConfig | None = None, **engine_args):
        """Engine flags as keyword arguments (vLLM's style), or a ready EngineConfig. Offline use gets the
        throughput-oriented step budget unless one is given."""
        engine_args.setdefault("max_num_batched_tokens", OFFLINE_MAX_NUM_BATCHED_TOKENS)
        self.engine = LLMEngine(config or EngineConfig(model=model, **engine_args))
        self.tokenizer = self.engine.tokenizer

    def generate(self, prompts: str | list[str] | list[list[int]],
                 sampling_params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Prompts are texts or token-id lists; outputs come back in prompt order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.engine.add_request(p, sp) for p, sp in zip(prompts, params)]
        final: dict[str, RequestOutput] = {}
        while self.engine.has_unfinished():
            for out in self.engine.step():
                if out.finished:
                    final[out.request_id] = out
        return [final[i] for i in ids]

    def reset_prefix_cache(self) -> None:
        """Forget every cached prompt prefix (vLLM's name) and suffix decoding's cache of earlier outputs, e.g.
        between benchmark runs of the same prompts."""
        self.engine.reset_prefix_cache()

    def chat(self, conversations: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | None = None) -> list[RequestOutput]:
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        return self.generate([self.tokenizer.encode_chat(c) for c in conversations], sampling_params)
