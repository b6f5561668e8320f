"""Per-request sampling parameters (vLLM's names and meanings)."""
from __future__ import annotations

from dataclasses import dataclass, field

from specserve.seeding import SEED_MAX, SEED_MIN
from specserve.structured_output.params import StructuredOutputsParams
from specserve.errors import InvalidRequestError

# Temperatures below this sample greedily (vLLM's _SAMPLING_EPS): dividing float32 logits by 1e-40
# overflows to inf/nan, and any temperature this small is an argmax in all but float rounding anyway.
GREEDY_TEMPERATURE = 1e-5
# top_k beyond the vocabulary means "all tokens" (sampling.RowParams clamps it to the vocabulary it samples).
# This bound only keeps the value representable as an int64 tensor element.
MAX_TOP_K = (1 << 63) - 1
MAX_TOP_LOGPROBS = 20  # OpenAI's bound on top_logprobs (vLLM's default --max-logprobs)
MAX_REPETITION_PENALTY = 10.0  # a bound that keeps logits finite: anything beyond bans the token already


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 (or below GREEDY_TEMPERATURE) = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0 = disabled
    seed: int | None = None  # a signed 64-bit integer; None draws one from the engine's seed
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: bool = False  # return the log-probability of each chosen token
    top_logprobs: int = 0   # and of the most likely tokens at each position, this many (needs logprobs)
    # vLLM's: each prompt token's log-probability (after the first) and the this-many most likely tokens at its
    # position; None: not computed (a request that asks is never served from the prefix cache)
    prompt_logprobs: int | None = None
    # vLLM's penalties (sampling.penalize): presence and frequency on the output, repetition on prompt and output
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    # Service-level objectives of this request, in seconds (None: the server's default, if any): the
    # speculation policy keeps the predicted time per output token under slo_tpot, the scheduler admits
    # waiting requests by their slo_ttft deadline (docs/design.md §3.5).
    slo_tpot: float | None = None
    slo_ttft: float | None = None
    # Prefix caching: only requests with the same salt share cached KV blocks (vLLM's cache_salt), so that
    # one tenant cannot learn from another's time to first token which prompts the cache holds.
    cache_salt: str | None = None
    # The output must match a JSON schema, regex, choice or grammar (specserve/structured_output/)
    structured_outputs: StructuredOutputsParams | None = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = [s for s in (self.stop or []) if s]
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == 0:
            self.top_k = -1
        checks = [
            (self.max_tokens >= 1, f"max_tokens must be at least 1, got {self.max_tokens}"),
            (self.temperature >= 0, f"temperature must be non-negative, got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k == -1 or 1 <= self.top_k <= MAX_TOP_K,
             f"top_k must be -1 (disabled) or in [1, {MAX_TOP_K}], got {self.top_k}"),
            (self.seed is None or (not isinstance(self.seed, bool) and isinstance(self.seed, int)
                                   and SEED_MIN <= self.seed <= SEED_MAX),
             f"seed must be an integer in [{SEED_MIN}, {SEED_MAX}] (a signed 64-bit integer), got {self.seed}"),
            (0 <= self.min_tokens <= self.max_tokens,
             f"min_tokens must be in [0, max_tokens], got {self.min_tokens}"),
            (0 <= self.top_logprobs <= MAX_TOP_LOGPROBS,
             f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}"),
            (not self.top_logprobs or self.logprobs, "top_logprobs needs logprobs"),
            (self.prompt_logprobs is None or 0 <= self.prompt_logprobs <= MAX_TOP_LOGPROBS,
             f"prompt_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.prompt_logprobs}"),
            (-2 <= self.presence_penalty <= 2, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2 <= self.frequency_penalty <= 2,
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (0 < self.repetition_penalty <= MAX_REPETITION_PENALTY,
             f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}], got {self.repetition_penalty}"),
            (self.slo_tpot is None or self.slo_tpot > 0, f"the TPOT SLO must be positive, got {self.slo_tpot}"),
            (self.slo_ttft is None or self.slo_ttft > 0, f"the TTFT SLO must be positive, got {self.slo_ttft}"),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidRequestError(message)

    @property
    def penalized(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def greedy(self) -> bool:
        """Argmax decoding: temperature 0, or any temperature below GREEDY_TEMPERATURE."""
        return self.temperature < GREEDY_TEMPERATURE
