"""The proposers' side (specserve/structured_output/drafts.py): speculation under a grammar keeps the output
exactly the constrained target's (greedy token-identical for every method, sampled output distributed as the
masked target's distribution), drafts the grammar forbids are cut before the verify, and a draft model drafts
within the grammar."""
import re

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.structured_output.drafts import kept_drafts
from specserve.structured_output.params import StructuredOutputsParams as Guide
from tests.spec_decode.test_speculative_engine import METHODS, assert_follows, prompts, spec_config
from tests.structured_output.guide_fixtures import allowed, guided


@pytest.mark.parametrize("method", METHODS)
def test_greedy_speculation_under_a_grammar_is_token_identical(tiny_target, request, guided_baseline, method):
    ps, want = guided_baseline
    llm = LLM(model=str(tiny_target), dtype="float32", speculative_config=spec_config(method, request, 4))
    outs = llm.generate(ps, [guided(i) for i in range(len(ps))])
    assert [o.token_ids for o in outs] == [o.token_ids for o in want]
    assert sum(o.spec["num_accepted_tokens"] for o in outs) > 10  # drafts passed the grammar and the target


def count_proposed(llm) -> list[int]:
    """Draft tokens proposed per step, before the grammar cuts any."""
    executor, proposed = llm.engine.executor, []
    propose = executor.propose

    def counted(plan):
        proposal = propose(plan)
        proposed.append(sum(proposal.lengths))
        return proposal

    executor.propose = counted
    return proposed


def test_a_draft_models_proposals_stay_within_the_grammar(tiny_target, tiny_draft):
    """The draft model drafts under the grammar's mask (DraftGuide): none of its drafts is cut, and the target
    accepts them, although unconstrained it would draft anything but digits here."""
    llm = LLM(model=str(tiny_target), dtype="float32",
              speculative_config={"model": str(tiny_draft), "num_speculative_tokens": 4, "policy": "static"})
    proposed = count_proposed(llm)
    outs = llm.generate(prompts(8, seed=4), SamplingParams(max_tokens=30, temperature=0,
                                                          structured_outputs=Guide(regex="[0-9]{30}")))
    assert all(re.fullmatch("[0-9]*", o.text) for o in outs)
    assert sum(o.spec["num_draft_tokens"] for o in outs) == sum(proposed) > 100
    assert sum(o.spec["num_accepted_tokens"] for o in outs) > 50


def test_lookup_drafts_the_grammar_forbids_are_cut_before_the_verify(tiny_target):
    """Prompt lookup proposes what the context repeated, which a narrow regex mostly forbids: those drafts are
    never verified."""
    llm = LLM(model=str(tiny_target), dtype="float32",
              speculative_config={"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1})
    proposed = count_proposed(llm)
    outs = llm.generate(prompts(8, seed=4), SamplingParams(max_tokens=30, temperature=0,
                                                          structured_outputs=Guide(regex="[0-9]{30}")))
    assert all(re.fullmatch("[0-9]*", o.text) for o in outs)
    assert sum(o.spec["num_draft_tokens"] for o in outs) < sum(proposed)


@pytest.mark.parametrize("stochastic", [True, False])
def test_a_cut_draft_keeps_the_output_the_masked_targets(stochastic):
    """One position, 3 tokens, the third forbidden: p = (0.9, 0.1, 0) (the masked target), drafts drawn from
    q = (0.1, 0.5, 0.4) (a draft model's), or always the forbidden token (deterministic, q one-hot). Drafts are
    cut as the engine cuts them (kept_drafts) and verified by the rejection sampler: the committed token follows p.
    (Dropping a stochastic forbidden draft and drawing from p would give 0.86 / 0.14.)"""
    from specserve.spec_decode.rejection_sampler import rejection_sample
    n = 20000
    gen = torch.Generator().manual_seed(0)
    p = torch.tensor([0.9, 0.1, 0.0])
    q = torch.tensor([0.1, 0.5, 0.4]) if stochastic else torch.tensor([0.0, 0.0, 1.0])
    drafts = torch.multinomial(q, n, replacement=True, generator=gen)
    lengths = [kept_drafts(int(x != 2), 1, stochastic) for x in drafts.tolist()]
    rows = torch.tensor([r for r, length in enumerate(lengths) for _ in range(length + 1)])
    cells = [r for r, length in enumerate(lengths) if length]
    out = rejection_sample(p.argmax().expand(len(rows)), p.expand(len(rows), 3).clone(), drafts[cells],
                           q.expand(len(cells), 3).clone() if stochastic else None, lengths,
                           [torch.Generator().manual_seed(s) for s in range(n)])
    freq = torch.bincount(out[:, 0], minlength=3).float() / n  # the position's token: accepted, recovered or drawn
    assert freq[2] == 0 and freq[0] == pytest.approx(0.9, abs=0.01)


def masked_marginals(llm, prompt, params):
    """P(x1) and P(x2) = sum_x1 P(x1) P(x2 | x1) of the target's processed distribution under the request's
    grammar: at each position only the tokens its mask allows there (computed by the grammar itself)."""
    from specserve.engine.sampler import to_probs
    model = llm.engine.runner.model
    vocab = model.config.vocab_size
    grammar = llm.engine.inputs.grammars.matcher(params.structured_outputs)
    allow1 = allowed(grammar, vocab)
    first = allow1.nonzero()[:, 0].tolist()
    allow2 = []
    for x in first:
        grammar.advance([x])
        allow2.append(allowed(grammar, vocab))
        grammar.rollback(1)
    with torch.no_grad():  # a causal pass per context: its last position's logits
        rows = torch.stack([_last_logits(model, s) for s in [prompt] + [prompt + [x] for x in first]])
    p1 = to_probs(rows[:1].masked_fill(~allow1, float("-inf")), [params])[0]
    p2_given = to_probs(rows[1:].masked_fill(~torch.stack(allow2), float("-inf")), [params] * len(first))
    return p1, p1[first] @ p2_given


def _last_logits(model, tokens):
    from specserve.model.attention import AttentionMetadata, allocate_kv_cache
    c, device = model.config, model.embed_tokens.weight.device
    blocks = len(tokens) // 16 + 1
    cache = allocate_kv_cache(c.num_hidden_layers, blocks, 16, c.num_key_value_heads, c.head_dim, torch.float32, device)
    meta = AttentionMetadata.build([len(tokens)], [len(tokens)], [list(range(blocks))], 16, device)
    h = model(torch.tensor(tokens, device=device), meta, cache)
    return model.compute_logits(h[-1:])[0]


def test_sampled_speculation_under_a_grammar_follows_the_masked_target(tiny_target, tiny_far_draft):
    """T = 0.8, a draft far from the target: the first two tokens under speculation and a regex
    (two printable characters, then letters) are distributed as the target's masked distribution, which is
    what plain decoding under the grammar samples from. Drafts outside the grammar are cut, the others verified."""
    llm = LLM(model=str(tiny_target), dtype="float32", max_num_seqs=64,
              speculative_config={"model": str(tiny_far_draft), "num_speculative_tokens": 3, "policy": "static"})
    prompt = [7, 8, 9, 7, 8]
    base = dict(max_tokens=4, temperature=0.8, structured_outputs=Guide(regex="[ -~]{2}[a-z]*"))
    p1, p2 = masked_marginals(llm, prompt, SamplingParams(**base))
    assert 20 < int((p1 > 0).sum()) < 120  # the mask leaves a real choice, not the whole vocabulary
    n = 3000
    outs = llm.generate([prompt] * n, [SamplingParams(**base, seed=s) for s in range(n)])
    assert sum(o.spec["num_accepted_tokens"] for o in outs) > 20  # drafts the grammar allowed were accepted
    assert sum(o.spec["num_draft_tokens"] - o.spec["num_accepted_tokens"] for o in outs) > 500  # and rejected
    assert all(re.fullmatch("[ -~]{2}[a-z]*", o.text) or o.finish_reason == "length" for o in outs)
    assert_follows(outs, p1, p2)
