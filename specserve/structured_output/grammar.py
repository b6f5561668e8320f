"""A request's structured output compiled by llguidance into the matcher the request holds: which tokens may
come next, given its committed output. llguidance rather than xgrammar: their masks cost about the same next
to a step, but llguidance compiles a schema several times faster, which every request with a new schema waits
for, needs no transformers, and reads Lark and llama.cpp's GBNF alike (docs/experiments/structured-output.md)."""
from __future__ import annotations

import functools
import json
import logging

import torch

from specserve.errors import InvalidRequestError
from specserve.structured_output.params import StructuredOutputsParams

log = logging.getLogger(__name__)


class InvalidGrammarError(InvalidRequestError):
    """A schema, regex or grammar that cannot be compiled (the server names the request's field)."""


# Whitespace between JSON tokens: none, a space, or a newline and up to 20 spaces or tabs of indentation
# (llama.cpp's rule). Unbounded, a small model at temperature 0.8 could spend its whole reply on newlines.
# A schema's own "x-guidance" options take precedence.
JSON_OPTIONS = {"whitespace_pattern": r"(?:\n[ \t]{0,20}| )?"}


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar of what the request asks (raises InvalidGrammarError for what cannot be one)."""
    import llguidance
    try:
        if params.json is not None or params.json_object:
            schema = params.json if params.json is not None else '{"type": "object"}'
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
        if params.regex is not None:
            return llguidance.grammar_from("regex", params.regex)
        if params.choice is not None:
            return llguidance.grammar_from("choice", json.dumps(list(params.choice)))
        return llguidance.grammar_from("grammar", params.grammar)
    except ValueError as e:
        raise InvalidGrammarError(f"invalid structured output: {e}") from None


class GrammarCompiler:
    """Compiles requests' structured outputs into llguidance matchers over the model's vocabulary. Its
    tokenizer index is built on the first guided request: long enough to build that an engine which never
    sees one should not pay for it."""

    def __init__(self, tokenizer, vocab_size: int):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size

    @functools.cached_property
    def lltokenizer(self):
        import llguidance
        return llguidance.LLTokenizer(self.tokenizer.hf.to_str(), n_vocab=self.vocab_size,
                                      eos_token=self.tokenizer.eos_token_ids)

    def check(self, params: StructuredOutputsParams) -> None:
        """Raises InvalidRequestError (a 400) for a schema, regex or grammar llguidance cannot compile."""
        self.matcher(params)

    def matcher(self, params: StructuredOutputsParams) -> "Grammar":
        import llguidance
        matcher = llguidance.LLMatcher(self.lltokenizer, grammar_text(params), log_level=0)
        if matcher.is_error():
            raise InvalidGrammarError(f"invalid structured output: {matcher.get_error()}")
        return Grammar(matcher, self.tokenizer.eos_token_ids)


class Grammar:
    """One request's grammar state: which tokens may come next, given its committed output."""
    __slots__ = ("matcher", "eos")

    def __init__(self, matcher, eos: list[int]):
        self.matcher, self.eos = matcher, eos

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of the leading tokens the grammar allows, in order."""
        return self.matcher.validate_tokens(tokens)

    def advance(self, tokens: list[int]) -> int:
        """Consume the tokens up to an end-of-sequence token (which ends the output, not the grammar: given to
        a matcher that has matched all it can, it is an error, and a matcher in error stays so, rollbacks
        included). Returns how many were consumed."""
        n = next((k for k, t in enumerate(tokens) if t in self.eos), len(tokens))
        if n:
            self.matcher.consume_tokens(tokens[:n])
            if self.matcher.is_error():  # a token its mask forbade: the request can only end now (fill)
                log.error("structured output: grammar error after tokens %s: %s", tokens[:n], self.matcher.get_error())
        return n

    def rollback(self, n: int) -> None:
        self.matcher.rollback(n)

    def fill(self, row: torch.Tensor) -> None:
        """The next token's mask into `row` [words] int32 (a bit per token)."""
        self.matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * 4)
        if self.matcher.is_error():  # never for masked tokens; if it were, end the request, not the step
            row.zero_()
            for eos in self.eos:
                row[eos // 32] |= torch.tensor(1, dtype=torch.int32) << (eos % 32)
