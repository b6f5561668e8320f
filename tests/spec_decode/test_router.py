"""Several drafts in one engine (spec_decode/router.py): each request is drafted by the draft whose kept
vocabulary covers its prompt best, and speculative decoding stays lossless with both in one batch."""
import random

import pytest

from specserve import LLM, SamplingParams
from specserve.benchmark.metrics import spec_totals
from specserve.engine.async_engine import AsyncLLMEngine
from specserve.errors import SpecServeError
from specserve.server.metrics import ServerMetrics
from specserve.spec_decode.router import RoutedProposer
from tests.spec_decode.test_speculative_engine import GREEDY, assert_follows, exact_marginals
from tests.tiny_models import make_tiny_eagle

LOW = list(range(160)) + [258, 259]  # kept tokens of the "low" draft (byte ids 0..159, BOS, EOS)
HIGH = list(range(100, 260))         # and of the "high" draft


@pytest.fixture(scope="module")
def drafts(tmp_path_factory, tiny_target):
    d = tmp_path_factory.mktemp("routed")
    return {name: make_tiny_eagle(d / name, tiny_target, noise=noise, noise_seed=seed, draft_vocab=vocab)
            for name, noise, seed, vocab in [("low", 0.04, 5, LOW), ("high", 0.04, 7, HIGH),
                                             ("low_noisy", 0.1, 6, LOW), ("high_noisy", 0.1, 8, HIGH)]}


def mixed_prompts(n: int, seed: int) -> tuple[list[list[int]], list[int]]:
    """Prompts of only low byte ids (route 0) or only high ones (route 1), shuffled together."""
    rng = random.Random(seed)
    prompts, routes = [], []
    for _ in range(n):
        route = rng.randrange(2)
        ids = range(0, 100) if route == 0 else range(160, 256)
        prompts.append([rng.choice(ids) for _ in range(rng.randint(3, 40))])
        routes.append(route)
    return prompts, routes


def recording_routes(proposer: RoutedProposer) -> dict:
    seen = {}
    route = proposer.route

    def recorded(seq):
        index = route(seq)
        seen[tuple(seq.token_ids[:seq.num_prompt_tokens])] = index
        return index

    proposer.route = recorded
    return seen


@pytest.mark.parametrize("k,max_num_seqs", [(1, 1), (4, 7), (8, 32)])
def test_requests_go_to_the_draft_covering_their_prompt_and_greedy_stays_identical(tiny_target, drafts, k,
                                                                                   max_num_seqs):
    ps, routes = mixed_prompts(60, seed=k)
    want = [o.token_ids for o in LLM(model=str(tiny_target), dtype="float32").generate(ps, GREEDY)]
    spec = {"model": [str(drafts["low"]), str(drafts["high"])], "num_speculative_tokens": k}
    llm = LLM(model=str(tiny_target), dtype="float32", max_num_seqs=max_num_seqs, speculative_config=spec)
    seen = recording_routes(llm.engine.proposer)
    outs = llm.generate(ps, GREEDY)
    assert [o.token_ids for o in outs] == want
    assert [seen[tuple(p)] for p in ps] == routes
    assert [o.spec["draft"] for o in outs] == [("low", "high")[r] for r in routes]
    for route in (0, 1):  # both drafts proposed, and were accepted
        assert sum(o.spec["num_accepted_tokens"] for o, r in zip(outs, routes) if r == route) > 20


def test_routed_greedy_with_preemption_and_aborts(tiny_target, drafts):
    """A small KV cache preempts requests of both routes (recomputed later, on the same draft), and an
    aborted request frees its blocks; the survivors stay token-identical."""
    ps, _ = mixed_prompts(40, seed=11)
    want = [o.token_ids for o in LLM(model=str(tiny_target), dtype="float32").generate(ps, GREEDY)]
    spec = {"model": [str(drafts["low"]), str(drafts["high"])], "num_speculative_tokens": 4}
    llm = LLM(model=str(tiny_target), dtype="float32", speculative_config=spec, num_kv_blocks=40, block_size=4,
              max_model_len=96, max_num_seqs=16)
    assert [o.token_ids for o in llm.generate(ps, GREEDY)] == want
    assert llm.engine.scheduler.num_preemptions > 0
    engine = llm.engine
    ids = [engine.add_request(p, GREEDY) for p in ps[:6]]
    engine.step()
    engine.step()
    engine.abort(ids[0])
    done = {}
    while engine.has_unfinished():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    assert done[ids[0]].finish_reason == "abort"
    assert [done[i].token_ids for i in ids[1:]] == want[1:6]
    assert engine.scheduler.blocks.num_free == 40


def test_sampled_sd_with_both_drafts_in_one_batch_follows_the_target_distribution(tiny_target, drafts):
    """T = 0.8, top-p 0.9, drafts that get about a third of their tokens accepted: requests of both routes
    interleaved in every batch, each request's first two tokens against the exact marginals of its prompt.
    Each draft's q rows must reach its own requests: handing route 1's rows to the first requests of the
    batch instead moved the second token's TV from 0.02 to 0.17-0.22 (the first token comes from the
    prefill, before any drafting)."""
    spec = {"model": [str(drafts["low_noisy"]), str(drafts["high_noisy"])], "num_speculative_tokens": 3}
    llm = LLM(model=str(tiny_target), dtype="float32", speculative_config=spec, max_num_seqs=64)
    seen = recording_routes(llm.engine.proposer)
    base = dict(max_tokens=4, temperature=0.8, top_p=0.9, ignore_eos=True)
    low, high = [7, 8, 9, 7, 8], [200, 201, 202, 200, 201]
    n = 3000
    outs = llm.generate([low, high] * n, [SamplingParams(**base, seed=s) for s in range(2 * n)])
    assert seen[tuple(low)] == 0 and seen[tuple(high)] == 1
    for prompt, mine in ((low, outs[0::2]), (high, outs[1::2])):
        assert sum(o.spec["num_accepted_tokens"] for o in mine) > 1000
        assert sum(o.spec["num_draft_tokens"] - o.spec["num_accepted_tokens"] for o in mine) > 1000
        assert_follows(mine, *exact_marginals(llm, prompt, SamplingParams(**base)))


def test_each_drafts_traffic_and_acceptance_is_counted_in_metrics_and_bench_results(tiny_target, drafts):
    """The per-draft Prometheus counters and the bench client's per-draft totals agree with the requests'
    own stats; both drafts have their series before any request (a scraper sees 0, not nothing)."""
    spec = {"model": [str(drafts["low"]), str(drafts["high"])], "num_speculative_tokens": 4}
    llm = LLM(model=str(tiny_target), dtype="float32", speculative_config=spec)
    metrics = ServerMetrics(AsyncLLMEngine(engine=llm.engine), "tiny")
    for name in ("low", "high"):
        assert f'specserve:spec_decode_draft_requests_total{{draft="{name}",model_name="tiny"}} 0.0' in \
            metrics.render().decode()
    ps, routes = mixed_prompts(20, seed=3)
    outs = llm.generate(ps, GREEDY)
    for out in outs:
        metrics.on_output(out)
    counters = {}
    for line in metrics.render().decode().splitlines():
        if line.startswith("specserve:spec_decode_draft_"):
            name, value = line.rsplit(" ", 1)
            counters[name] = float(value)
    totals = spec_totals([o.spec for o in outs])["per_draft"]
    for route, name in enumerate(("low", "high")):
        mine = [o.spec for o, r in zip(outs, routes) if r == route]
        label = f'{{draft="{name}",model_name="tiny"}}'
        assert counters["specserve:spec_decode_draft_requests_total" + label] == len(mine) == totals[name]["requests"]
        drafts_, accepted = sum(s["num_drafts"] for s in mine), sum(s["num_accepted_tokens"] for s in mine)
        assert counters["specserve:spec_decode_draft_num_drafts_total" + label] == drafts_ > 0
        assert counters["specserve:spec_decode_draft_num_draft_tokens_total" + label] == sum(
            s["num_draft_tokens"] for s in mine)
        assert counters["specserve:spec_decode_draft_num_accepted_tokens_total" + label] == accepted > 0
        assert totals[name]["mean_acceptance_length"] == pytest.approx(1 + accepted / drafts_)


def test_routing_configuration_errors(tiny_target, tiny_draft, tiny_eagle, drafts):
    def build(models):
        LLM(model=str(tiny_target), speculative_config={"model": models, "num_speculative_tokens": 2})

    with pytest.raises(SpecServeError, match="one kind"):
        build([str(drafts["low"]), str(tiny_draft)])
    with pytest.raises(SpecServeError, match="reduced-vocabulary drafts"):
        build([str(drafts["low"]), str(tiny_eagle)])
    for bad in ([], ["x", 3]):
        with pytest.raises(SpecServeError, match="non-empty list of draft names"):
            build(bad)
