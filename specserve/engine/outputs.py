"""What the engine hands back: per-request outputs and per-step statistics."""
from __future__ import annotations

from dataclasses import dataclass, field

from specserve.engine.sequence import SpecStats


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    text: str                      # all text so far (stop string excluded)
    token_ids: list[int]           # all generated tokens so far
    delta_text: str                # text new since the previous output of this request
    delta_token_ids: list[int]
    finished: bool
    finish_reason: str | None      # "stop" | "length" | "abort"
    stop_reason: str | int | None  # the stop string or stop token id that ended the request
    logprobs: list[float] | None
    spec: dict                     # speculation stats of this request (SpecStats.as_dict())
    metrics: dict                  # arrival, first scheduled, first token, finished (monotonic seconds)


@dataclass(slots=True)
class StepStats(SpecStats):
    """One engine step. Times in seconds; the controller and the latency model consume these.
    The speculation counters (num_drafts = requests that carried >= 1 draft token, ...) are SpecStats'."""
    num_decodes: int = 0
    num_prefill_tokens: int = 0
    num_preempted: int = 0
    draft_lengths: list[int] = field(default_factory=list)  # l_i of every decode
    t_schedule: float = 0.0
    t_draft: float = 0.0
    t_forward: float = 0.0         # target forward (the verify pass when drafts are present)
    t_sample: float = 0.0          # sampling and rejection sampling
    t_other: float = 0.0           # bookkeeping: commit, detokenize, outputs
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0

    @property
    def t_total(self) -> float:
        return self.t_schedule + self.t_draft + self.t_forward + self.t_sample + self.t_other
