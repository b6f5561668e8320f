"""Speculative decoding in the engine is lossless: greedy token-identical, sampling distribution-exact."""
import random

import pytest
import torch

from specserve import LLM, SamplingParams
from specserve.errors import SpecServeError
from specserve.settings import settings

GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


def prompts(n, seed=0):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        if rng.random() < 0.5:  # repetitive prompts give the n-gram proposer something to find
            pattern = [rng.randrange(256) for _ in range(rng.randint(2, 6))]
            out.append((pattern * 20)[:rng.randint(8, 50)])
        else:
            out.append([rng.randrange(256) for _ in range(rng.randint(3, 50))])
    return out


@pytest.fixture(scope="module")
def baseline(tiny_target):
    ps = prompts(100)
    return ps, [o.token_ids for o in LLM(model=str(tiny_target), dtype="float32").generate(ps, GREEDY)]


def spec_config(method: str, request, k: int) -> dict:
    """method: ngram, suffix, draft_model or eagle, the last two optionally with "+ngram" (prompt lookup) and/or
    "+suffix" (suffix decoding) where they find a match."""
    if method == "ngram":
        return {"method": "ngram", "num_speculative_tokens": k, "prompt_lookup_min": 1}
    if method == "suffix":
        return {"method": "suffix", "num_speculative_tokens": k}
    base, *free = method.split("+")
    draft = request.getfixturevalue("tiny_eagle" if base == "eagle" else "tiny_draft")
    return {"method": base, "model": str(draft), "num_speculative_tokens": k, "ngram_first": "ngram" in free,
            "suffix_first": "suffix" in free}


METHODS = ["draft_model", "ngram", "suffix", "draft_model+ngram", "eagle", "eagle+ngram", "eagle+ngram+suffix"]


def count_proposal_sources(proposer) -> dict:
    """Counts the lookups' matches and the draft model's forwards of a proposer with lookups first."""
    used = {"lookup": 0, "draft_model": 0}
    forward = proposer.runner.forward

    def counted(lookup):
        def counted_lookup(*args):
            found = lookup(*args)
            used["lookup"] += bool(found[0] if isinstance(found, tuple) else found)
            return found
        return counted_lookup

    def counted_forward(items, *args, **kwargs):
        used["draft_model"] += any(it.num_logits for it in items)
        return forward(items, *args, **kwargs)

    def counted_chain(items, features, steps, vocab_map):
        drafted = chain(items, features, steps, vocab_map)
        used["draft_model"] += drafted is not None and any(steps)
        used["chain"] = used.get("chain", 0) + (drafted is not None)
        return drafted

    for lookup in proposer.drafter.lookups:
        lookup.lookup = counted(lookup.lookup)
    chain = proposer.runner.draft_chain
    proposer.runner.forward, proposer.runner.draft_chain = counted_forward, counted_chain
    return used


@pytest.mark.parametrize("method", METHODS)
def test_greedy_sd_is_token_identical_for_k_1_to_8_and_batch_1_to_32(tiny_target, request, baseline, method):
    ps, want = baseline
    total_accepted = 0
    for k, max_num_seqs in zip(range(1, 9), [1, 2, 3, 5, 8, 13, 21, 32]):
        spec = spec_config(method, request, k)
        llm = LLM(model=str(tiny_target), dtype="float32", max_num_seqs=max_num_seqs, speculative_config=spec)
        if "+" in method:
            used = count_proposal_sources(llm.engine.proposer)
        outs = llm.generate(ps, GREEDY)
        if "+" in method:
            assert used["lookup"] > 0 and used["draft_model"] > 0, used  # both sources really proposed
        assert [o.token_ids for o in outs] == want, f"k={k}"
        total_accepted += sum(o.spec["num_accepted_tokens"] for o in outs)
        assert all(o.spec["num_draft_tokens"] <= k * o.spec["num_drafts"] for o in outs)
    assert total_accepted > 200  # drafts were really accepted, not just rejected every time


@pytest.mark.parametrize("method", METHODS)
def test_logprobs_and_top_logprobs_are_the_targets_under_speculation(tiny_target, request, method):
    """Log-probabilities of the chosen tokens and the 4 most likely tokens at every position, read from the
    verify rows, equal plain decoding's."""
    ps = prompts(16, seed=5)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=True, top_logprobs=4)
    want = LLM(model=str(tiny_target), dtype="float32").generate(ps, params)
    llm = LLM(model=str(tiny_target), dtype="float32", speculative_config=spec_config(method, request, 3))
    outs = llm.generate(ps, params)
    assert sum(o.spec["num_accepted_tokens"] for o in outs) > 10
    for got, ref in zip(outs, want):
        assert got.token_ids == ref.token_ids
        assert got.logprobs == pytest.approx(ref.logprobs, abs=1e-4)
        assert [[t for t, _ in top] for top in got.top_logprobs] == [[t for t, _ in top] for top in ref.top_logprobs]
        assert [v for top in got.top_logprobs for _, v in top] == pytest.approx(
            [v for top in ref.top_logprobs for _, v in top], abs=1e-4)
        assert all(len(top) == 4 for top in got.top_logprobs) and len(got.top_logprobs) == 12


@pytest.mark.parametrize("method", METHODS)
def test_greedy_sd_with_preemption(tiny_target, request, baseline, method):
    ps, want = baseline
    spec = spec_config(method, request, 4)
    llm = LLM(model=str(tiny_target), dtype="float32", speculative_config=spec, num_kv_blocks=40, block_size=4,
              max_model_len=96, max_num_seqs=16)
    assert [o.token_ids for o in llm.generate(ps[:40], GREEDY)] == want[:40]
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.scheduler.blocks.num_free == 40


@pytest.mark.parametrize("method", ["draft_model", "eagle+ngram"])
def test_drafts_quantized_at_load_stay_lossless(tiny_target, request, baseline, method):
    """"quantization": "q8_0" puts the draft's matrices in Q8_0 blocks (the target stays dense); the output
    is still the target's, token for token."""
    from specserve.model.cpu_linear import KernelLinear
    spec = spec_config(method, request, 3) | {"quantization": "q8_0"}
    llm = LLM(model=str(tiny_target), dtype="float32", speculative_config=spec)
    formats = lambda model: {m.source_fmt for m in model.modules() if isinstance(m, KernelLinear)}  # noqa: E731
    assert formats(llm.engine.proposer.runner.model) == {"q8_0"}
    assert "q8_0" not in formats(llm.engine.runner.model)
    ps, expected = baseline
    assert [o.token_ids for o in llm.generate(ps[:40], GREEDY)] == expected[:40]


@pytest.mark.parametrize("method", ["ngram", "eagle+ngram"])
def test_a_quantized_target_on_int8_dot_products_stays_lossless(tiny_target, request, method, monkeypatch):
    """A Q4_0 target on the integer path (int8 activations, the default for quantized weights): each row's
    logits do not depend on the rows beside it, so a verify gives what single decodes give."""
    monkeypatch.setattr(settings, "int8_dot", True)
    ps = prompts(40)
    plain = LLM(model=str(tiny_target), dtype="float32", quantization="q4_0")
    assert {m.fmt for m in plain.engine.runner.model.modules() if hasattr(m, "source_fmt")} == {"i4"}
    want = [o.token_ids for o in plain.generate(ps, GREEDY)]
    llm = LLM(model=str(tiny_target), dtype="float32", quantization="q4_0",
              speculative_config=spec_config(method, request, 4))
    assert [o.token_ids for o in llm.generate(ps, GREEDY)] == want


def test_stop_and_max_tokens_inside_an_accepted_run(tiny_target, tiny_draft, baseline):
    ps, want = baseline
    llm = LLM(model=str(tiny_target), dtype="float32",
              speculative_config={"model": str(tiny_draft), "num_speculative_tokens": 8})
    for p, w in list(zip(ps, want))[:10]:
        out = llm.generate([p], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))[0]
        assert out.token_ids == w[:5] and out.finish_reason == "length"
        stop_id = w[6]
        out = llm.generate([p], SamplingParams(max_tokens=24, temperature=0, stop_token_ids=[stop_id]))[0]
        assert out.token_ids == w[:w.index(stop_id) + 1] and out.finish_reason == "stop"


def exact_marginals(llm, prompt, params):
    """P(x1) and P(x2) = sum_x1 P(x1) P(x2 | x1) under the request's processed distribution."""
    from specserve.engine.sampler import to_probs
    from specserve.model.attention import AttentionMetadata, allocate_kv_cache
    model = llm.engine.runner.model
    c, device = model.config, model.embed_tokens.weight.device
    vocab = c.vocab_size
    seqs = [prompt] + [prompt + [x] for x in range(vocab)]
    per = len(prompt) // 16 + 1  # blocks per sequence
    cache = allocate_kv_cache(c.num_hidden_layers, len(seqs) * per, 16, c.num_key_value_heads, c.head_dim,
                              torch.float32, device)
    meta = AttentionMetadata.build([len(s) for s in seqs], [len(s) for s in seqs],
                                   [list(range(per * i, per * i + per)) for i in range(len(seqs))], 16, device)
    with torch.no_grad():
        h = model(torch.tensor([t for s in seqs for t in s], device=device), meta, cache)
        ends = torch.tensor([len(s) for s in seqs], device=device).cumsum(0) - 1
        probs = to_probs(model.compute_logits(h[ends]), [params] * len(seqs))
    p1 = probs[0]
    return p1.cpu(), (p1 @ probs[1:]).cpu()


@pytest.mark.parametrize("draft,ngram_first,seeded", [("tiny_far_draft", False, True), ("tiny_far_draft", True, True),
                                                      ("tiny_far_eagle", False, True), ("tiny_far_draft", True, False),
                                                      ("tiny_far_eagle", False, False)])
def test_sampled_sd_follows_the_target_distribution(tiny_target, request, draft, ngram_first, seeded):
    """T = 0.8, top-p 0.9, a draft whose q differs a lot from p: the empirical distribution of the first
    two generated tokens under SD converges to the exact target marginals and beats random references.
    With ngram_first the prompt's repeat ([7, 8] -> 9) makes lookup propose the first step's tokens
    (one-hot q) and the draft model later steps where lookup finds nothing: both kinds of q in one batch.
    (Deterministic n-gram proposals alone are covered at the sampler level in test_rejection_sampler.)
    The EAGLE draft's q comes from its reading of the target's hidden states. Seeded requests verify against
    the token plain decoding draws at each position (draws keyed by position); unseeded ones by rejection
    sampling with their own generators."""
    spec = {"model": str(request.getfixturevalue(draft)), "num_speculative_tokens": 3, "ngram_first": ngram_first}
    llm = LLM(model=str(tiny_target), dtype="float32", speculative_config=spec, max_num_seqs=64)
    prompt = [7, 8, 9, 7, 8]
    base = dict(max_tokens=4, temperature=0.8, top_p=0.9, ignore_eos=True)
    p1, p2 = exact_marginals(llm, prompt, SamplingParams(**base))
    n = 3000
    outs = llm.generate([prompt] * n, [SamplingParams(**base, seed=s if seeded else None) for s in range(n)])
    assert sum(o.spec["num_accepted_tokens"] for o in outs) > 20  # the accept path is exercised
    assert sum(o.spec["num_draft_tokens"] - o.spec["num_accepted_tokens"] for o in outs) > 1000  # and rejected
    assert_follows(outs, p1, p2)


def assert_follows(outs, p1, p2) -> None:
    """The first two tokens of `outs` (one prompt, independent seeds) are distributed as p1 and p2: the
    empirical distribution converges (all of them closer than the first 300) and is close in TV, and
    much closer than random distributions on the same support."""
    n = len(outs)
    for pos, exact in ((0, p1), (1, p2)):
        counts = torch.bincount(torch.tensor([o.token_ids[pos] for o in outs]), minlength=exact.numel()).float()
        small = torch.bincount(torch.tensor([o.token_ids[pos] for o in outs[:300]]),
                               minlength=exact.numel()).float() / 300
        tv_small = 0.5 * (small - exact).abs().sum().item()
        tv_full = 0.5 * (counts / n - exact).abs().sum().item()
        assert tv_full < tv_small, f"position {pos}: no convergence"
        support = exact > 0
        references = []
        for _ in range(20):  # random distributions on the same support
            r = torch.where(support, torch.rand(exact.numel()), 0)
            references.append(0.5 * (r / r.sum() - exact).abs().sum().item())
        assert tv_full < 0.08, f"position {pos}: TV {tv_full:.3f}"
        assert tv_full < min(references) / 3


def test_bad_speculative_configs_are_clear_errors(tiny_target):
    for cfg, msg in [('{"num_speculative_tokens": 4}', "needs \"model\""),
                     ('{"method": "medusa"}', "not supported"),
                     ('{"model": "x", "num_speculative_tokens": 0}', "num_speculative_tokens"),
                     ("not json", "not valid JSON"), ('{"model": "x", "bogus": 1}', "unknown"),
                     ('{"method": "ngram", "ngram_first": true}', "needs \"model\""),
                     ('{"model": "x", "ngram_first": "yes"}', "true or false"),
                     ('{"model": "x", "ngram_first": true, "prompt_lookup_min": 0}', "prompt_lookup_min"),
                     ('{"model": "x", "quantization": "q3_k"}', "quantization")]:
        with pytest.raises(SpecServeError, match=msg):
            LLM(model=str(tiny_target), speculative_config=cfg)


def test_draft_with_a_different_tokenizer_is_refused(tiny_target, tmp_path):
    from tests.tiny_models import make_tiny_model
    other = make_tiny_model(tmp_path / "other", seed=3)
    tok = (other / "tokenizer.json").read_text().replace('"</s>"', '"<eos>"')
    (other / "tokenizer.json").write_text(tok)
    with pytest.raises(SpecServeError, match="different tokenizer"):
        LLM(model=str(tiny_target), speculative_config={"model": str(other), "num_speculative_tokens": 2})


@pytest.mark.parametrize("method", ["ngram", "suffix", "draft_model", "eagle"])
def test_every_proposer_keeps_the_protocol(tiny_target, request, method):
    """What the engine calls on a proposer is declared once (spec_decode/proposer_protocol.py)."""
    from specserve.spec_decode.proposer_protocol import Proposer
    llm = LLM(model=str(tiny_target), dtype="float32", speculative_config=spec_config(method, request, 2))
    assert isinstance(llm.engine.proposer, Proposer)
