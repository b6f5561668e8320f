"""How many tokens to draft: the interface the load-adaptive controller implements (SPEC §3).

The engine asks, every step:
1. `draft_limit(seq)` — before scheduling: the most draft tokens this request may carry (KV slots are
   reserved for them); 0 switches speculation off for the request this step.
2. `keep_drafting(step, confidences)` — after each batched draft step: which requests draft another
   token, given the draft's probability of every token drafted so far (SPEC §3.2).
3. `final_lengths(confidences)` — after drafting: how many of the drafted tokens each request sends to
   verification (a suffix may be dropped, SPEC §3.3).
4. `observe(stats)` — after verification: the step's acceptance and timing, for feedback.
"""
from __future__ import annotations


class StaticController:
    """A fixed speculation length k, shortened only where fewer tokens can still be committed."""

    def __init__(self, k: int, max_model_len: int):
        self.k = k
        self.max_model_len = max_model_len

    def draft_limit(self, seq) -> int:
        # Committing l drafts + 1 token must not pass max_tokens or the context length.
        remaining = min(seq.params.max_tokens - seq.num_output_tokens, self.max_model_len - len(seq.token_ids))
        return max(0, min(self.k, remaining - 1))

    def keep_drafting(self, step: int, confidences: list[list[float]]) -> list[bool]:
        return [True] * len(confidences)

    def final_lengths(self, confidences: list[list[float]]) -> list[int]:
        return [len(c) for c in confidences]

    def observe(self, stats) -> None:
        pass
