"""A request's input, checked before it reaches the engine: tokenized, token ids in the vocabulary, prompt +
max_tokens within the context. Stateless, so the server runs it on its own side of the engine."""
from __future__ import annotations

from dataclasses import dataclass, field

from specserve.engine.sampling_params import SamplingParams
from specserve.structured_output.grammar import GrammarCompiler
from specserve.errors import InvalidRequestError


@dataclass
class InputProcessor:
    tokenizer: object
    vocab_size: int
    max_model_len: int
    grammars: GrammarCompiler = field(init=False)

    def __post_init__(self):
        self.grammars = GrammarCompiler(self.tokenizer, self.vocab_size)

    def prepare(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        """Token ids of the prompt; raises InvalidRequestError (a 400) for what the engine cannot run."""
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        if not ids:
            raise InvalidRequestError("the prompt is empty")
        vocab = self.vocab_size
        if any(not isinstance(t, int) or not 0 <= t < vocab for t in ids):
            raise InvalidRequestError(f"prompt token ids must be integers in [0, {vocab})")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise InvalidRequestError(
                f"This model's maximum context length is {self.max_model_len} tokens. However, you requested "
                f"{len(ids) + params.max_tokens} tokens ({len(ids)} in the prompt, {params.max_tokens} for the "
                "completion). Please reduce the length of the prompt or max_tokens.")
        if params.structured_outputs is not None:
            self.grammars.check(params.structured_outputs)
        return ids
