"""What the engine hands back: per-request outputs (deltas, then totals once finished) and per-step stats."""
from __future__ import annotations

from dataclasses import dataclass, field

from specserve.engine.sequence import SpecStats


@dataclass(slots=True)
class RequestOutput:
    """One step's news about one request. While it runs, only the delta fields are filled: nothing here grows
    with the request's length. The last output (`finished`) also carries the totals."""
    request_id: str
    delta_token_ids: list[int]     # tokens committed this step
    delta_text: str                # text new since the previous output (a possible stop string held back)
    delta_logprobs: list[float] | None  # raw log-probability of each delta token, if the request asked
    finished: bool
    num_prompt_tokens: int
    num_output_tokens: int         # generated so far, this step's included
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: str | int | None = None  # the stop string or stop token id that ended the request
    # the params.top_logprobs most likely (token id, raw log-probability) at each delta token's position
    delta_top_logprobs: list[list[tuple[int, float]]] | None = None
    # Totals, set on the final output only:
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    text: str | None = None        # all generated text (stop string excluded)
    token_ids: list[int] | None = None  # all generated tokens
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None
    # per prompt position, if params.prompt_logprobs: None, then {token: (raw log-probability, rank)}; set with
    # the first tokens (they are known once the prompt is prefilled) and on the final output
    prompt_logprobs: list | None = None
    spec: dict | None = None       # speculation stats of this request (SpecStats.as_dict(), plus "draft")
    metrics: dict | None = None    # arrival, first scheduled, first token, finished (monotonic seconds)


@dataclass(slots=True)
class StepStats(SpecStats):
    """One engine step, for metrics and benchmarks. Times in seconds. The speculation counters
    (num_drafts = requests that carried >= 1 draft token, ...) are SpecStats'."""
    num_decodes: int = 0
    num_prefill_tokens: int = 0
    num_preempted: int = 0
    draft_lengths: list[int] = field(default_factory=list)  # l_i of every decode
    t_schedule: float = 0.0
    t_draft: float = 0.0
    t_forward: float = 0.0         # target forward (the verify pass when drafts are present)
    t_sample: float = 0.0          # sampling and rejection sampling, with the step's device->host transfer
    t_other: float = 0.0           # commit, detokenize, outputs, policy feedback
    t_grammar: float = 0.0         # of t_draft and t_sample: structured output's draft cuts and masks
    t_predicted: float | None = None  # the step cost model's prediction of t_draft + t_forward, if it runs
    # The policy's plan (model-based policies): expected committed tokens, and the step's predicted time
    # without drafts (less a prefill chunk's share): what its decision weighed against what happened
    planned_tokens: float | None = None
    planned_plain_s: float | None = None
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    prefix_cache_queries: int = 0  # prompt tokens of requests admitted this step, and of those the ones
    prefix_cache_hits: int = 0     # whose KV the prefix cache held

    @property
    def t_total(self) -> float:
        return self.t_schedule + self.t_draft + self.t_forward + self.t_sample + self.t_other
