"""Structured output: a request's JSON schema, regex, choice or grammar becomes a mask over the target's
vocabulary at every position it samples, computed by llguidance (bench/grammar_backends.py measured it and
xgrammar on our tokenizer: a mask costs 3-10 us either way, next to a step of milliseconds; llguidance compiles a
schema ~7x faster, which every request with a new schema waits for, needs no transformers, and reads Lark and
llama.cpp's GBNF alike).

Under speculation (docs/design.md §4.4): a draft model drafts under the grammar's mask too (DraftGuide); before
the verify forward, each guided request's drafts are cut at the first token its grammar forbids (kept_drafts:
the target, masked, would reject it anyway, and a cut draft's verify rows are not paid for); after it, the
mask of verify row j is the grammar's state after the output so far and drafts[:j], each computed by walking
the drafts and rolling back. The target's masked distribution is what plain decoding samples from, so
rejection sampling keeps the output exactly the constrained target's. The grammar advances only with
committed tokens (Sequence.append).
"""
from __future__ import annotations

import functools
import json
import logging
from collections.abc import Collection
from dataclasses import dataclass

import torch

from specserve.device_sync import to_host
from specserve.errors import InvalidRequestError


log = logging.getLogger(__name__)


class InvalidGrammarError(InvalidRequestError):
    """A schema, regex or grammar that cannot be compiled (the server names the request's field)."""


# Whitespace between JSON tokens: none, a space, or a newline and up to 20 spaces or tabs of indentation
# (llama.cpp's rule). Unbounded, a small model at temperature 0.8 could spend its whole reply on newlines.
# A schema's own "x-guidance" options take precedence.
JSON_OPTIONS = {"whitespace_pattern": r"(?:\n[ \t]{0,20}| )?"}


@dataclass(frozen=True, slots=True)
class StructuredOutputsParams:
    """What a request's output must match; exactly one field set (vLLM's names)."""
    json: str | None = None          # a JSON schema, serialized
    json_object: bool = False        # any JSON object
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None       # a Lark grammar, or llama.cpp's GBNF

    def __post_init__(self):
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise InvalidRequestError("structured output takes exactly one of json, json_object, regex, choice "
                                      f"and grammar; got {', '.join(given) or 'none'}")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c for c in self.choice)):
            raise InvalidRequestError("choice must be a non-empty list of non-empty strings")

    def to_grammar(self) -> str:
        """The llguidance grammar (raises InvalidRequestError for what cannot be one)."""
        import llguidance
        try:
            if self.json is not None or self.json_object:
                schema = self.json if self.json is not None else '{"type": "object"}'
                return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
            if self.regex is not None:
                return llguidance.grammar_from("regex", self.regex)
            if self.choice is not None:
                return llguidance.grammar_from("choice", json.dumps(list(self.choice)))
            return llguidance.grammar_from("grammar", self.grammar)
        except ValueError as e:
            raise InvalidGrammarError(f"invalid structured output: {e}") from None


_SUBSCHEMAS = ("items", "additionalProperties", "not", "if", "then", "else", "contains")  # a schema each
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")                        # a list of schemas
_SCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties")         # name -> schema


def closed(schema):
    """The schema with every object that does not say otherwise closed to the properties it names
    (additionalProperties false): what OpenAI's strict mode asks of a schema. A new value."""
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    for key in _SUBSCHEMAS:
        if isinstance(out.get(key), dict):
            out[key] = closed(out[key])
    for key in _SCHEMA_LISTS:
        if isinstance(out.get(key), list):
            out[key] = [closed(s) for s in out[key]]
    for key in _SCHEMA_MAPS:
        if isinstance(out.get(key), dict):
            out[key] = {name: closed(s) for name, s in out[key].items()}
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


class GrammarCompiler:
    """Compiles requests' structured outputs into llguidance matchers over the model's vocabulary. Its
    tokenizer index (~0.25 s to build) is made on the first guided request."""

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
        matcher = llguidance.LLMatcher(self.lltokenizer, params.to_grammar(), log_level=0)
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


# The logit of a token the grammar forbids: exp() of it underflows to exactly 0 after any temperature, and no
# penalty brings it back, while staying finite (an added -inf would be; but 0 * inf is NaN when building it).
FORBIDDEN = -1e30


def words(vocab_size: int) -> int:
    """int32 words of a bitmask over the vocabulary."""
    return (vocab_size + 31) // 32


def kept_drafts(valid: int, length: int, stochastic: bool) -> int:
    """How many of a request's `length` drafts go to the verify when its grammar allows the first `valid`.
    Those; and after them, for a draft drawn from a distribution q (a draft model's, sampled), the first
    forbidden one too: the target (p = 0 there) rejects it and draws the recovered token from
    normalize(max(0, p − q)), which is what keeps the output p's. Dropping it and drawing from p would
    not: P(y) would be min(p, q) + (q(M) − β)/(1 − β)·max(0, p − q) + q(not M)·p (M: what the grammar
    allows, β: the acceptance probability), not p (docs/design.md §4.4). A deterministic draft (greedy, or
    prompt lookup's one-hot q) is dropped: its residual is p itself."""
    return min(length, valid + 1) if stochastic and valid < length else valid


def cut_drafts(decodes, proposal, lookups: Collection[str]) -> dict[int, list[int]]:
    """Cuts each guided decode's drafts after the first token its grammar forbids (kept_drafts; proposal.lengths
    in place); returns the grammar-valid drafts of each guided decode, by index. One host read of the drafts
    when any is guided. `lookups`: the proposers whose drafts are looked up, not drawn (their q is one-hot)."""
    guided = [i for i, s in enumerate(decodes) if s.seq.grammar is not None]
    if not guided:
        return {}
    # (one more host read in a step where a guided request drafted: its drafts must be known before the verify)
    rows = to_host(proposal.token_ids[guided])[0] if any(proposal.lengths[i] for i in guided) else None
    kept = {}
    for r, i in enumerate(guided):
        drafts = rows[r][:proposal.lengths[i]] if rows else []
        n = decodes[i].seq.grammar.valid_prefix(drafts) if drafts else 0
        stochastic = proposal.probs is not None and i in proposal.sampled and proposal.sources[i] not in lookups
        proposal.lengths[i] = kept_drafts(n, len(drafts), stochastic)
        kept[i] = drafts[:n]
    return kept


def logit_bias(sampling, kept: dict[int, list[int]], lengths: list[int], vocab_size: int, device
               ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """For the guided requests among the step's sampling rows (decodes first, `lengths` drafts each, then
    prefills completing their prompt): the flattened row indices [R] and a bias [R, V] to add to their logits,
    0 where the grammar allows the token and FORBIDDEN where not; row j of a request is its grammar's state
    after its drafts[:j] (past a kept forbidden draft, the state before it: those rows are never sampled).
    None when no request is guided."""
    guided = [i for i, s in enumerate(sampling) if s.seq.grammar is not None]
    if not guided:
        return None
    starts, row = [], 0
    for i in range(len(sampling)):
        starts.append(row)
        row += (lengths[i] if i < len(lengths) else 0) + 1
    rows = [starts[i] + j for i in guided for j in range((lengths[i] if i < len(lengths) else 0) + 1)]
    mask = torch.empty(len(rows), words(vocab_size), dtype=torch.int32)
    r = 0
    for i in guided:
        grammar, drafts, advanced = sampling[i].seq.grammar, kept.get(i, []), 0
        for j in range((lengths[i] if i < len(lengths) else 0) + 1):
            if 1 <= j <= len(drafts) and advanced == j - 1:  # (rows after a drafted end of sequence: unused)
                advanced += grammar.advance(drafts[j - 1:j])
            grammar.fill(mask[r])
            r += 1
        if advanced:
            grammar.rollback(advanced)
    return torch.tensor(rows, dtype=torch.long).to(device), _bias(mask, vocab_size).to(device)


def _bias(mask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, V] float32 logit bias of bitmasks [R, words]: 0 where allowed, FORBIDDEN where not. Bit t of the
    little-endian words is token t: each byte of the mask looks up its 8 tokens' biases. Branch-free
    (masked_fill with a grammar's irregular mask took ~1.8 ms for 16 rows here, this ~0.4)."""
    biases = torch.nn.functional.embedding(mask.view(torch.uint8).long(), _byte_biases())
    return biases.view(len(mask), -1)[:, :vocab_size]


class DraftGuide:
    """Keeps a draft model's proposals for guided requests within their grammars: at each draft step, the
    drafting rows of guided requests get the grammar's bias after the drafts so far (read back from the
    device: one host read per draft step when any drafting request is guided). Without it, a draft that
    proposes what the grammar forbids is cut before the verify, after its forward was paid for. The drafts'
    q is then the masked draft distribution, which rejection sampling takes like any other q."""

    def __init__(self, decodes):
        self.grammars = {i: s.seq.grammar for i, s in enumerate(decodes) if s.seq.grammar is not None}
        self.advanced = dict.fromkeys(self.grammars, 0)

    def bias(self, drafting: list[int], token_ids: torch.Tensor, step: int, vocab_size: int,
             vocab_map: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(rows of `drafting` to bias, their bias [R, draft vocabulary]) for draft step `step`, or None."""
        rows = [r for r, i in enumerate(drafting) if i in self.grammars]
        if not rows:
            return None
        if step:  # the previous step's drafts, now known: advance each grammar by its own
            previous = to_host(token_ids[[drafting[r] for r in rows], step - 1])[0]
            for r, token in zip(rows, previous):
                i = drafting[r]
                if self.advanced[i] == step - 1 and self.grammars[i].valid_prefix([token]) == 1:
                    self.advanced[i] += self.grammars[i].advance([token])
            rows = [r for r in rows if self.advanced[drafting[r]] == step]  # (a forbidden draft is cut later)
            if not rows:
                return None
        mask = torch.empty(len(rows), words(vocab_size), dtype=torch.int32)
        for m, r in zip(mask, rows):
            self.grammars[drafting[r]].fill(m)
        bias = _bias(mask, vocab_size).to(token_ids.device)
        if vocab_map is not None:  # a reduced-vocabulary draft: its head rows' target tokens
            bias = bias[:, vocab_map]
        return torch.tensor(rows, dtype=torch.long, device=token_ids.device), bias

    def finish(self) -> None:
        """Back to the committed output's state."""
        for i, n in self.advanced.items():
            if n:
                self.grammars[i].rollback(n)


@functools.cache
def _byte_biases() -> torch.Tensor:
    """[256, 8] float32: for each byte value, the bias of the 8 tokens its bits stand for."""
    bits = (torch.arange(256)[:, None] >> torch.arange(8)) & 1
    return torch.where(bits.bool(), 0.0, FORBIDDEN).float()


def apply_logit_bias(logits: torch.Tensor, bias: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """The logits [T, V] with the guided rows' grammar bias added (a new tensor; the same one if none)."""
    if bias is None:
        return logits
    rows, values = bias
    return logits.index_add(0, rows, values)
