"""The sampler's side of a step: each guided request's verify rows get a logit bias that forbids what its
grammar forbids there; row j is the grammar's state after the output so far and the request's drafts[:j]."""
from __future__ import annotations

import functools

import torch

# The logit of a token the grammar forbids: exp() of it underflows to exactly 0 after any temperature, and no
# penalty brings it back, while staying finite (an added -inf would be; but 0 * inf is NaN when building it).
FORBIDDEN = -1e30


def words(vocab_size: int) -> int:
    """int32 words of a bitmask over the vocabulary."""
    return (vocab_size + 31) // 32


def logit_bias(sampling, kept: dict[int, list[int]], lengths: list[int], vocab_size: int, device
               ) -> tuple[torch.Tensor, torch.Tensor] | None:
    """For the guided requests among the step's sampling rows (decodes first, `lengths` drafts each, then
    prefills completing their prompt): the flattened row indices [R] and a bias [R, V] to add to their logits,
    0 where the grammar allows the token and FORBIDDEN where not; row j of a request is its grammar's state
    after its drafts[:j] (`kept`: the grammar-valid drafts; past a kept forbidden draft, the state before it:
    those rows are never sampled). None when no request is guided."""
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
    return torch.tensor(rows, dtype=torch.long).to(device), mask_bias(mask, vocab_size).to(device)


def apply_logit_bias(logits: torch.Tensor, bias: tuple[torch.Tensor, torch.Tensor] | None) -> torch.Tensor:
    """The logits [T, V] with the guided rows' grammar bias added (a new tensor; the same one if none)."""
    if bias is None:
        return logits
    rows, values = bias
    return logits.index_add(0, rows, values)


def mask_bias(mask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[R, V] float32 logit bias of bitmasks [R, words]: 0 where allowed, FORBIDDEN where not. Bit t of the
    little-endian words is token t: each byte of the mask looks up its 8 tokens' biases. A lookup costs the
    same for any mask, where masked_fill with a grammar's irregular mask is several times slower."""
    biases = torch.nn.functional.embedding(mask.view(torch.uint8).long(), _byte_biases())
    return biases.view(len(mask), -1)[:, :vocab_size]


@functools.cache
def _byte_biases() -> torch.Tensor:
    """[256, 8] float32: for each byte value, the bias of the 8 tokens its bits stand for."""
    bits = (torch.arange(256)[:, None] >> torch.arange(8)) & 1
    return torch.where(bits.bool(), 0.0, FORBIDDEN).float()
