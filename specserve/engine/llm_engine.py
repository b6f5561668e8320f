"""LLMEngine: add requests, call `step()` until done. One step (docs/design.md §5):

    plan = scheduler.schedule(policy)        who runs, how many tokens each, how many drafts each
    result = executor.execute(plan)          draft -> one target forward -> sample/verify (one host transfer)
    verdicts = outputs.check(...)            detokenize, find stops: how many tokens each row commits
    committed = scheduler.update(plan, result, verdicts)    append tokens, finish, release KV
    outputs, feedback                        deltas for the callers, outcomes and times for the policy
"""
from __future__ import annotations

import dataclasses
import itertools
import time

from specserve.step_types import DraftOutcome, StepFeedback, StepPlan, StepResult
from specserve.engine.builder import build_engine
from specserve.engine.config import EngineConfig
from specserve.engine.inputs import InputProcessor
from specserve.engine.output_processor import OutputProcessor
from specserve.engine.outputs import RequestOutput, StepStats
from specserve.engine.sampling_params import SamplingParams
from specserve.engine.sequence import Sequence, Status
from specserve.errors import InvalidRequestError


@dataclasses.dataclass(slots=True)
class EngineInfo:
    """What a client of the engine (the server, possibly in another process) needs to know of it."""
    config: EngineConfig
    max_model_len: int
    vocab_size: int
    num_kv_blocks: int
    tokenizer: object
    draft_names: list[str]
    policy_name: str | None
    max_drafts: int


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        parts = build_engine(config)  # load, size, profile (engine/builder.py)
        self.threads, self.model_config, self.tokenizer = parts.threads, parts.model_config, parts.tokenizer
        self.max_model_len, self.runner, self.models = parts.max_model_len, parts.runner, parts.models
        self.proposer, self.policy, self.executor = parts.proposer, parts.policy, parts.executor
        self.scheduler, self.synthetic_rates = parts.scheduler, parts.synthetic_rates
        self._measure_costs = parts.measure_costs
        self.inputs = InputProcessor(self.tokenizer, self.model_config.vocab_size, self.max_model_len)
        self.outputs = OutputProcessor(self.tokenizer, self.tokenizer.eos_token_ids)
        self.requests: dict[str, Sequence] = {}
        self._aborted: list[RequestOutput] = []  # final outputs of aborted requests, for the next step
        self._ids = itertools.count()
        self.last_stats = StepStats()

    def profile_costs(self) -> None:
        """The step cost model's startup sweep (or its cached result). Before any request runs: the sweep
        writes into the KV cache."""
        self.models.profile(self._measure_costs)

    # ---- requests -------------------------------------------------------------------------------
    def prepare(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        """Tokenize and validate a request without touching engine state (safe from any thread)."""
        return self.inputs.prepare(prompt, params)

    def info(self) -> EngineInfo:
        spec = self.config.speculative_config
        return EngineInfo(self.config, self.max_model_len, self.model_config.vocab_size,
                          self.scheduler.blocks.num_blocks, self.tokenizer, self.draft_names,
                          self.policy.name if self.policy is not None else None,
                          spec.num_speculative_tokens if spec else 0)

    def add_request(self, prompt: str | list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, arrival_time: float | None = None,
                    prompt_token_ids: list[int] | None = None) -> str:
        params = self._with_default_slos(params or SamplingParams())
        request_id = request_id if request_id is not None else str(next(self._ids))
        if request_id in self.requests:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        ids = prompt_token_ids if prompt_token_ids is not None else self.prepare(prompt, params)
        grammar = (self.inputs.grammars.matcher(params.structured_outputs)
                   if params.structured_outputs is not None else None)
        seq = Sequence(request_id, ids, params, prompt if isinstance(prompt, str) else None, arrival_time,
                       self.config.device, grammar)
        self.requests[request_id] = seq
        self.outputs.add(seq)
        self.scheduler.add(seq)
        return request_id

    def _with_default_slos(self, params: SamplingParams) -> SamplingParams:
        c = self.config
        tpot = params.slo_tpot if params.slo_tpot is not None else (c.slo_tpot_ms and c.slo_tpot_ms / 1000)
        ttft = params.slo_ttft if params.slo_ttft is not None else (c.slo_ttft_ms and c.slo_ttft_ms / 1000)
        if (tpot, ttft) == (params.slo_tpot, params.slo_ttft):
            return params
        return dataclasses.replace(params, slo_tpot=tpot or None, slo_ttft=ttft or None)

    def abort(self, request_id: str) -> None:
        """Stop a request at any point and free its KV blocks; its final output comes with the next step."""
        seq = self.requests.get(request_id)
        if seq is None:
            return
        self.scheduler.abort(seq)
        self._aborted.append(self._output(seq, [], None))
        self._free(seq)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prompt prefix, and the earlier outputs suffix decoding drafts from (benchmarks
        that replay the same prompts start each run cold: a replayed reply would be drafted from its twin)."""
        self.scheduler.blocks.reset_cache()
        if self.proposer is not None:
            self.proposer.forget_outputs()

    def has_unfinished(self) -> bool:
        return bool(self.requests) or bool(self._aborted)

    def newest_running(self) -> str | None:
        """The request admitted last (preemption's victim, and the suspect when a step fails)."""
        return self.scheduler.running[-1].request_id if self.scheduler.running else None

    def recompute_all(self) -> None:
        """Preempt every running request: each is recomputed from its tokens, so whatever a failed step left
        half-written (KV rows, draft caches, EAGLE features) is rebuilt."""
        for seq in list(self.scheduler.running):
            self.scheduler.preempt(seq)
            self._reset_draft(seq)

    def _reset_draft(self, seq: Sequence) -> None:
        if self.proposer is not None:
            self.proposer.reset(seq.request_id)

    def _free(self, seq: Sequence) -> None:
        """Forget a request that finished or was aborted, once its last output is made."""
        self.requests.pop(seq.request_id, None)
        self.models.forget(seq.request_id)
        self.outputs.free(seq.request_id)
        if self.proposer is not None:
            self.proposer.free(seq.request_id)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def kv_usage(self) -> float:
        """Fraction of KV cache blocks in use."""
        return self.scheduler.blocks.usage

    @property
    def draft_names(self) -> list[str]:
        """The drafts requests are routed between (empty unless several)."""
        return list(getattr(self.proposer, "names", ()))

    # ---- the step --------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outputs, self._aborted = self._aborted, []
        if self.threads is not None:
            self.threads.tick()
        t0 = time.perf_counter()
        plan = self.scheduler.schedule(self.policy)
        for seq in plan.preempted:
            self._reset_draft(seq)
        t1 = time.perf_counter()
        if plan.is_empty:
            self.last_stats = StepStats(num_preempted=len(plan.preempted), t_schedule=t1 - t0)
            return outputs
        result = self.executor.execute(plan)
        t2 = time.perf_counter()
        verdicts = [self.outputs.check(s.seq, tokens) for s, tokens in zip(result.sampling, result.committed)]
        committed = self.scheduler.update(plan, result, verdicts)
        for seq, new, logprobs, top in committed:
            if seq.status != Status.FINISHED and self.proposer is not None:
                self.proposer.on_commit(seq, len(new))
            outputs.append(self._output(seq, new, logprobs, top))
            if seq.status == Status.FINISHED:
                self._free(seq)
        result.times.schedule, result.times.update = t1 - t0, time.perf_counter() - t2
        self._record(plan, result)
        return outputs

    def _record(self, plan: StepPlan, result: StepResult) -> None:
        """Step statistics for metrics and benchmarks; outcomes and phase times for the policy."""
        times, proposal = result.times, result.proposal
        stats = StepStats(num_decodes=len(plan.decodes), num_preempted=len(plan.preempted),
                          num_prefill_tokens=sum(s.num_tokens for s in plan.prefills),
                          draft_lengths=list(proposal.lengths), t_schedule=times.schedule, t_draft=times.draft,
                          t_forward=times.forward, t_sample=times.sample, t_other=times.update,
                          t_grammar=times.grammar,
                          num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
                          kv_usage=self.scheduler.blocks.usage, prefix_cache_queries=plan.cache_queries,
                          prefix_cache_hits=plan.cache_hits)
        outcomes = []
        for i, (s, length) in enumerate(zip(plan.decodes, proposal.lengths)):
            accepted = len(result.committed[i]) - 1
            if length:
                stats.record(length, accepted)
            outcomes.append(DraftOutcome(s.seq.request_id, proposal.sources[i], length, accepted,
                                         result.confidences[i] if result.confidences else None))
        asked = self.policy is not None and plan.view is not None
        # The scheduler's TPOT admission reads the cost model too (Scheduler._tpot_budget): with objectives it
        # learns from every step whatever the policy, rather than judge prefill chunks by the startup profile
        # alone (a profile cached at another hour, and the machine's speed drifts)
        if asked or (self.models.has_cost and any(s.seq.params.slo_tpot for s in plan.decodes)):
            feedback = StepFeedback(plan.view, outcomes, times, len(plan.decodes) + sum(proposal.lengths),
                                    stats.num_prefill_tokens, result.forward_kv, proposal.draft_forwards)
            stats.t_predicted = self.models.observe(feedback)
        if asked:
            if (planned := plan.prediction) is not None:
                stats.planned_tokens, stats.planned_plain_s = planned.tokens, planned.plain_seconds
            self.policy.observe(feedback)
        self.last_stats = stats

    def _output(self, seq: Sequence, new: list[int], logprobs: list[float] | None, top=None) -> RequestOutput:
        finished = seq.status == Status.FINISHED
        out = RequestOutput(seq.request_id, new, self.outputs.take_new_text(seq.request_id, finished), logprobs,
                            finished, seq.num_prompt_tokens, seq.num_output_tokens, seq.finish_reason,
                            seq.stop_reason, delta_top_logprobs=top)
        if seq.params.prompt_logprobs is not None and (finished or new and len(new) == seq.num_output_tokens):
            out.prompt_logprobs = list(seq.prompt_logprobs)
        if finished:
            out.prompt, out.prompt_token_ids = seq.prompt, seq.token_ids[:seq.num_prompt_tokens]
            out.text, out.token_ids = self.outputs.text(seq.request_id), seq.output_token_ids
            out.logprobs = list(seq.logprobs) if seq.params.logprobs else None
            out.top_logprobs = list(seq.top_logprobs) if seq.params.top_logprobs else None
            out.spec = seq.spec.as_dict()
            if self.synthetic_rates:  # benchmarks only: say the acceptance was drawn, not verified
                out.spec["synthetic_acceptance_rates"] = self.synthetic_rates
            if self.draft_names and (draft := self.proposer.draft_of(seq.request_id)) is not None:
                out.spec["draft"] = draft  # several drafts: say which one served the request
            out.metrics = {"arrival_time": seq.arrival_time, "first_scheduled_time": seq.first_scheduled_time,
                           "first_token_time": seq.first_token_time, "finished_time": seq.finished_time,
                           "slo_ttft": seq.params.slo_ttft, "slo_tpot": seq.params.slo_tpot}
        return out
