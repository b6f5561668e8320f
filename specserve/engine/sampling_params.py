"""Per-request sampling parameters (vLLM's names and meanings)."""
from __future__ import annotations

from dataclasses import dataclass, field

from specserve.errors import InvalidRequestError


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0 = disabled
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: bool = False  # return the log-probability of each chosen token
    skip_special_tokens: bool = True
    # Service-level objectives of this request, in seconds (None: the server's default, if any): the
    # speculation policy keeps the predicted time per output token under slo_tpot, the scheduler admits
    # waiting requests by their slo_ttft deadline (docs/design.md §3.5).
    slo_tpot: float | None = None
    slo_ttft: float | None = None

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
            (self.top_k == -1 or self.top_k >= 1, f"top_k must be -1 (disabled) or >= 1, got {self.top_k}"),
            (0 <= self.min_tokens <= self.max_tokens,
             f"min_tokens must be in [0, max_tokens], got {self.min_tokens}"),
            (self.slo_tpot is None or self.slo_tpot > 0, f"the TPOT SLO must be positive, got {self.slo_tpot}"),
            (self.slo_ttft is None or self.slo_ttft > 0, f"the TTFT SLO must be positive, got {self.slo_ttft}"),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidRequestError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0
