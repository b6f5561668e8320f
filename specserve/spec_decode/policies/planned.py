"""`planned`: the draft length a fitted latency model recommends for the measured arrival rate — the
request-level model of docs/design.md §2 driving the engine.

`"policy_options": {"model": "model.json"}` (from `specserve latency fit`): the rate is the number of new
requests seen over the last `window` seconds, and k = argmin_k L(rate; k) among 0..num_speculative_tokens
(`specserve latency plan`'s choice), recomputed at most every `every` seconds."""
from __future__ import annotations

import time
from collections import deque

from specserve.errors import SpecServeError
from specserve.spec_decode.policies.base import Policy, register


@register("planned")
class Planned(Policy):
    def __init__(self, max_drafts: int, models=None, model: str | None = None, window: float = 30.0, every: float = 1.0):
        super().__init__(max_drafts, models)
        if not model:
            raise SpecServeError('policy "planned" needs "policy_options": {"model": "<latency model JSON>"}')
        from specserve.latency.fitting.model_file import load
        from specserve.latency.decisions.planning import candidate_ks
        self.latency = load(model).model
        self.candidates = candidate_ks(self.latency, range(max_drafts + 1))[0]  # k -> E the fit can speak for
        self.window, self.every = float(window), float(every)
        self.arrivals: deque[float] = deque()
        self.seen: set[str] = set()
        self.k, self.decided = 0, -float("inf")

    def rate(self, now: float) -> float:
        while self.arrivals and self.arrivals[0] < now - self.window:
            self.arrivals.popleft()
        return len(self.arrivals) / self.window

    def plan(self, batch) -> list[int]:
        return [self.k] * len(batch)

    def observe(self, feedback) -> None:
        """Counts the requests new to the batch as arrivals; recomputes k at most every `every` seconds."""
        now = time.monotonic()
        running = {r.request_id for r in feedback.batch.requests}
        self.arrivals.extend(now for _ in running - self.seen)
        self.seen = running  # only the running can come back
        if now - self.decided >= self.every:
            rate = self.rate(now)
            latencies = {k: self.latency.latency(rate, k, e) for k, e in self.candidates.items()}
            self.k = min(latencies, key=lambda k: (latencies[k], k))
            self.decided = now
