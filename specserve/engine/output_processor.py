"""Output processing: committed tokens -> text, and where a request stops.

The executor proposes tokens (accepted drafts + one sampled); before the scheduler commits them, `check`
walks them in order: a stop token (once past min_tokens), a stop string in the detokenized text, or
max_tokens ends the request, and the tokens after that point are not committed. The text of each running
request lives here, keyed by request id, with the part not yet handed out: a possible prefix of a stop
string is held back until the next tokens decide it.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from tokenizers.decoders import DecodeStream

from specserve.engine.sequence import Sequence

log = logging.getLogger("specserve.engine")
# tokenizers' DecodeStream raises this when byte-fallback pieces stop being valid UTF-8 after it emitted
# their first characters (its text so far is no longer a prefix of the decoded ids).
INVALID_PREFIX = "Invalid prefix encountered"


@dataclass(slots=True)
class Verdict:
    """How many of a row's tokens to commit, and whether they end the request."""
    num_tokens: int
    finish_reason: str | None = None  # "stop" | "length"
    stop_reason: str | int | None = None  # the stop string or stop token id


@dataclass(slots=True)
class RequestText:
    stream: DecodeStream
    holdback: int          # characters of a possible stop-string prefix kept back while running
    stop_ids: set[int]     # tokens that end the request (its stop_token_ids, and EOS unless ignored)
    text: str = ""
    num_sent: int = 0      # characters of `text` already handed to the caller


class OutputProcessor:
    def __init__(self, tokenizer, eos_token_ids: list[int]):
        self.tokenizer = tokenizer
        self.eos_token_ids = set(eos_token_ids)
        self.requests: dict[str, RequestText] = {}

    def add(self, seq: Sequence) -> None:
        p = seq.params
        self.requests[seq.request_id] = RequestText(
            DecodeStream(skip_special_tokens=p.skip_special_tokens), max((len(s) for s in p.stop), default=1) - 1,
            set(p.stop_token_ids) | (set() if p.ignore_eos else self.eos_token_ids))

    def free(self, request_id: str) -> None:
        self.requests.pop(request_id, None)

    def check(self, seq: Sequence, tokens: list[int]) -> Verdict:
        """Detokenize `tokens` (the next ones `seq` would commit), stopping at the first that ends it."""
        state, p = self.requests[seq.request_id], seq.params
        for i, token in enumerate(tokens):
            n = seq.num_output_tokens + i + 1  # output length with this token
            if token in state.stop_ids and n > p.min_tokens:
                return Verdict(i + 1, "stop", token)
            piece = self._step(seq, state, token)
            if piece:
                start = max(0, len(state.text) - state.holdback)
                state.text += piece
                if n > p.min_tokens:
                    for s in p.stop:
                        at = state.text.find(s, start)
                        if at >= 0:
                            state.text = state.text[:at]
                            return Verdict(i + 1, "stop", s)
            if n >= p.max_tokens:
                return Verdict(i + 1, "length")
        return Verdict(len(tokens))

    def _step(self, seq: Sequence, state: RequestText, token: int) -> str | None:
        """The text `token` adds. A model may emit byte pieces that are not UTF-8 (any byte-fallback
        vocabulary: Llama 2, Mistral, Gemma): the stream cannot go on from there, so a fresh one starts at
        this token (the stray bytes are dropped) instead of the exception ending every request in the step."""
        try:
            return state.stream.step(self.tokenizer.hf, token)
        except Exception as e:
            if INVALID_PREFIX not in str(e):
                raise
            log.warning("request %s: its output is not valid UTF-8 at token %d; detokenizing on from there",
                        seq.request_id, token)
            state.stream = DecodeStream(skip_special_tokens=seq.params.skip_special_tokens)
            return state.stream.step(self.tokenizer.hf, token)

    def take_new_text(self, request_id: str, finished: bool) -> str:
        """Text not yet handed out, holding back a possible stop-string prefix until the end."""
        state = self.requests.get(request_id)
        if state is None:
            return ""
        end = len(state.text) if finished else max(state.num_sent, len(state.text) - state.holdback)
        new = state.text[state.num_sent:end]
        state.num_sent = end
        return new

    def text(self, request_id: str) -> str:
        state = self.requests.get(request_id)
        return state.text if state is not None else ""
