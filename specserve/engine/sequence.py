"""One request's state as it moves through the engine."""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from specserve.engine.sampling_params import SamplingParams
from specserve.seeding import make_generator


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class SpecStats:
    """Speculation counters of one request (vLLM's meaning: a 'draft' is one proposal of >= 1 tokens)."""
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)
    last_drafted: int = 0  # draft tokens its latest decode step verified (0: that step drafted nothing)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens committed per verification, counting the bonus/recovered token (1 = nothing accepted)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    def record(self, num_draft: int, num_accepted: int) -> None:
        """One verification of `num_draft` tokens, of which the first `num_accepted` were accepted."""
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        if len(self.accepted_per_position) < num_draft:
            self.accepted_per_position.extend([0] * (num_draft - len(self.accepted_per_position)))
        for i in range(num_accepted):
            self.accepted_per_position[i] += 1

    def as_dict(self) -> dict:
        return {"num_drafts": self.num_drafts, "num_draft_tokens": self.num_draft_tokens,
                "num_accepted_tokens": self.num_accepted_tokens,
                "accepted_per_position": list(self.accepted_per_position),
                "mean_acceptance_length": round(self.mean_acceptance_length, 4)}


class Sequence:
    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 prompt: str | None = None, arrival_time: float | None = None, device: str = "cpu",
                 grammar=None):
        self.request_id = request_id
        self.prompt = prompt
        self.token_ids = list(prompt_token_ids)  # prompt followed by output
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.status = Status.WAITING
        self.block_table: list[int] = []
        self.num_computed = 0  # tokens whose target KV is in the cache (a proposer tracks its own cache)
        self.block_hashes: list[bytes] = []  # prefix-cache hashes of the full blocks of token_ids, so far
        self.num_registered = 0  # leading blocks of block_table offered to the prefix cache
        # Sampled requests draw from their own generator, on the device whose probabilities it samples.
        self.generator = None if params.greedy else make_generator(
            params.seed if params.seed is not None else int(torch.randint(2**62, ())), device)
        self.logprobs: list[float] = []
        self.top_logprobs: list[list[tuple[int, float]]] = []  # per output token, if params.top_logprobs
        # per prompt position, if params.prompt_logprobs: None for the first, then {token: (logprob, rank)}
        self.prompt_logprobs: list[dict[int, tuple[float, int]] | None] = [None]
        self.finish_reason: str | None = None  # "stop" | "length" | "abort"
        self.stop_reason: str | int | None = None
        self.spec = SpecStats()
        self.grammar = grammar  # structured output's Grammar (None: unconstrained), advanced by append
        self.arrival_time = arrival_time if arrival_time is not None else time.monotonic()
        self.first_scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finished_time: float | None = None

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def in_prefill(self) -> bool:
        """More than one token lacks KV: a (re)prefill, not a decode step."""
        return len(self.token_ids) - self.num_computed > 1

    def add_prompt_logprobs(self, position: int, entries: list[dict[int, tuple[float, int]]]) -> None:
        """Record the prompt logprobs of positions position, position + 1, ... (those not yet recorded: a
        request recomputed after preemption computes them again)."""
        for p, entry in enumerate(entries, start=position):
            if p == len(self.prompt_logprobs):
                self.prompt_logprobs.append(entry)

    def append(self, tokens: list[int], logprobs: list[float] | None, top_logprobs: list | None = None) -> None:
        """Commit generated tokens (the output processor has already cut them at a stop)."""
        self.token_ids += tokens
        if self.grammar is not None:
            self.grammar.advance(tokens)
        if logprobs is not None:
            self.logprobs += logprobs
        if top_logprobs is not None:
            self.top_logprobs += top_logprobs
