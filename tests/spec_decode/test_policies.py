"""The speculation policy protocol: a new policy is one class registered by name, it sees request ids and
draft confidences, the scheduler clamps what it asks, and greedy output stays identical whatever it does."""
import pytest

from specserve import LLM, SamplingParams
from specserve.errors import SpecServeError
from specserve.spec_decode.policies import POLICIES, Policy, register
from tests.spec_decode.policy_fixtures import BUILT_IN, cheap_drafts
from tests.spec_decode.test_speculative_engine import GREEDY, prompts


@register("test_alternating")
class Alternating(Policy):
    """Drafts greedily much on even steps, nothing on odd ones; records what it was told."""

    wants_confidences = True

    def __init__(self, max_drafts, models=None, ask=100):
        super().__init__(max_drafts, models)
        self.ask, self.steps, self.feedback = ask, 0, []

    def plan(self, batch):
        self.steps += 1
        return [self.ask if self.steps % 2 else 0] * len(batch)

    def observe(self, feedback):
        self.feedback.append(feedback)


@register("test_by_parity")
class ByParity(Policy):
    """Drafts 2 tokens for even request ids, 1 for odd ones; records what each request drafted last step."""

    def __init__(self, max_drafts, models=None):
        super().__init__(max_drafts, models)
        self.seen, self.feedback = [], []

    def plan(self, batch):
        self.seen.append({r.request_id: r.spec.last_drafted for r in batch.requests})
        return [2 if int(r.request_id) % 2 == 0 else 1 for r in batch.requests]

    def observe(self, feedback):
        self.feedback.append(feedback)


@pytest.fixture(scope="module")
def greedy_baseline(tiny_target):
    ps = prompts(12, seed=7)
    return ps, [o.token_ids for o in LLM(model=str(tiny_target), dtype="float32").generate(ps, GREEDY)]


def test_a_registered_policy_is_selected_by_name_and_clamped(tiny_target, tiny_draft, greedy_baseline):
    ps, want = greedy_baseline
    llm = LLM(model=str(tiny_target), dtype="float32", speculative_config={
        "model": str(tiny_draft), "num_speculative_tokens": 3, "policy": "test_alternating"})
    policy = llm.engine.policy
    assert isinstance(policy, Alternating) and "test_alternating" in POLICIES
    assert [o.token_ids for o in llm.generate(ps, GREEDY)] == want
    drafted = [f for f in policy.feedback if any(o.num_drafted for o in f.outcomes)]
    assert drafted and len(drafted) < len(policy.feedback)  # some steps drafted, others did not
    for f in drafted:  # asked 100, clamped to the ceiling (or less where fewer tokens were left)
        assert max(o.num_drafted for o in f.outcomes) <= 3
        for o, r in zip(f.outcomes, f.batch.requests):
            assert o.request_id == r.request_id and 0 <= o.num_accepted <= o.num_drafted
            assert o.num_drafted <= max(0, r.tokens_left - 1)
            assert len(o.confidences) == o.num_drafted and all(0 < c <= 1 for c in o.confidences)
            assert o.outcomes == [True] * o.num_accepted + [False] * (o.num_accepted < o.num_drafted)
        assert f.times.forward > 0 and f.num_verify_tokens == len(f.outcomes) + sum(o.num_drafted for o in f.outcomes)


def test_policy_options_reach_the_policy(tiny_target, tiny_draft):
    llm = LLM(model=str(tiny_target), dtype="float32", speculative_config={
        "model": str(tiny_draft), "num_speculative_tokens": 3, "policy": "test_alternating",
        "policy_options": {"ask": 1}})
    llm.generate(prompts(4), GREEDY)
    assert max(o.num_drafted for f in llm.engine.policy.feedback for o in f.outcomes) == 1


def test_planned_lengths_are_what_is_verified_and_the_view_remembers_them(tiny_target, tiny_draft, greedy_baseline):
    ps, want = greedy_baseline
    llm = LLM(model=str(tiny_target), dtype="float32", speculative_config={
        "model": str(tiny_draft), "num_speculative_tokens": 4, "policy": "test_by_parity"})
    outs = llm.generate(ps, GREEDY)
    assert [o.token_ids for o in outs] == want
    policy = llm.engine.policy
    for f in policy.feedback:  # each request drafted exactly its planned length where it could commit that much
        for o, r in zip(f.outcomes, f.batch.requests):
            assert o.num_drafted == min(2 if int(r.request_id) % 2 == 0 else 1, r.tokens_left - 1)
    for before, after in zip(policy.feedback, policy.seen[1:]):  # the next plan sees last step's lengths
        drafted = {o.request_id: o.num_drafted for o in before.outcomes}
        assert all(after[i] == drafted[i] for i in after if i in drafted)
    assert any(any(v for v in seen.values()) for seen in policy.seen)


def test_unknown_policies_and_bad_options_are_clear_errors(tiny_target, tiny_draft):
    base = {"model": str(tiny_draft), "num_speculative_tokens": 2}
    with pytest.raises(SpecServeError, match="unknown speculation policy 'nope'.*static"):
        LLM(model=str(tiny_target), speculative_config=dict(base, policy="nope"))
    with pytest.raises(SpecServeError, match="bad policy_options"):
        LLM(model=str(tiny_target), speculative_config=dict(base, policy="static", policy_options={"k": 1}))
    with pytest.raises(SpecServeError, match="policy_options"):
        LLM(model=str(tiny_target), speculative_config=dict(base, policy_options=[1]))


@pytest.mark.parametrize("name,options", BUILT_IN, ids=[b[0] for b in BUILT_IN])
def test_greedy_output_is_identical_under_every_built_in_policy(tiny_target, tiny_draft, greedy_baseline, name,
                                                                options):
    ps, want = greedy_baseline
    llm = LLM(model=str(tiny_target), dtype="float32", max_num_seqs=5, speculative_config={
        "model": str(tiny_draft), "num_speculative_tokens": 4, "ngram_first": True, "policy": name,
        "policy_options": options})
    if llm.engine.models.has_cost:  # decisions from a fixed cost model, not from this machine's timings
        llm.engine.models._cost = cheap_drafts(llm)
    outs = llm.generate(ps, GREEDY)
    assert [o.token_ids for o in outs] == want
    drafted = sum(o.spec["num_draft_tokens"] for o in outs)
    assert (drafted == 0) == (name == "off"), drafted


def test_sampled_output_follows_the_target_under_the_adaptive_policy(tiny_target, tiny_far_draft):
    from tests.spec_decode.test_speculative_engine import assert_follows, exact_marginals
    spec = {"model": str(tiny_far_draft), "num_speculative_tokens": 3, "policy": "adaptive"}
    llm = LLM(model=str(tiny_target), dtype="float32", speculative_config=spec, max_num_seqs=64)
    # A machine where drafting is cheap (a fixed cost model, not this machine's timings): the policy then
    # speculates even with this poor draft, and its choices depend only on the acceptance it learns.
    llm.engine.models._cost = cheap_drafts(llm)
    prompt = [7, 8, 9, 7, 8]
    base = dict(max_tokens=4, temperature=0.8, top_p=0.9, ignore_eos=True)
    p1, p2 = exact_marginals(llm, prompt, SamplingParams(**base))
    outs = llm.generate([prompt] * 3000, [SamplingParams(**base, seed=s) for s in range(3000)])
    assert sum(o.spec["num_draft_tokens"] for o in outs) > 1000  # it did speculate (and mostly got rejected)
    assert_follows(outs, p1, p2)


def test_the_first_draft_forward_runs_the_rows_the_view_priced(tiny_target, tiny_eagle):
    """An EAGLE draft that skipped steps catches up in its first forward: the view told the policy how many
    rows that is (RequestView.draft_rows), and that is what the forward ran."""
    llm = LLM(model=str(tiny_target), dtype="float32", speculative_config={
        "method": "eagle", "model": str(tiny_eagle), "num_speculative_tokens": 3, "policy": "test_alternating"})
    llm.generate(prompts(4, seed=5), GREEDY)
    checked = []
    for f in llm.engine.policy.feedback:
        drafting = [r for r, o in zip(f.batch.requests, f.outcomes) if o.num_drafted]
        if drafting:
            assert f.draft_forwards[0][1] == sum(r.draft_rows for r in drafting)
            checked += [r.draft_rows for r in drafting]
    assert checked and max(checked) > 2  # whole prompts at first, a skipped step's rows later


def test_step_stats_carry_what_the_adaptive_plan_predicted(tiny_target, tiny_draft):
    """bench/adaptive_steps.py weighs each plan against its step: the expected tokens and the predicted time
    of the step without drafts reach the step's stats (and only a model-based policy's plan sets them)."""
    llm = LLM(model=str(tiny_target), dtype="float32", speculative_config={
        "model": str(tiny_draft), "num_speculative_tokens": 3, "policy": "adaptive"})
    llm.engine.models._cost = cheap_drafts(llm)
    engine = llm.engine
    for i, p in enumerate(prompts(3, seed=11)):
        engine.add_request(p, GREEDY, request_id=str(i))
    seen = []
    while engine.has_unfinished():
        engine.step()
        s = engine.last_stats
        if s.num_decodes:
            drafted = sum(s.draft_lengths)
            assert s.planned_plain_s > 0
            assert s.planned_tokens == pytest.approx(s.num_decodes) if not drafted else s.planned_tokens > s.num_decodes
            seen.append(drafted)
    assert any(seen)
    engine.policy = engine.executor.policy = Alternating(3)
    engine.add_request(prompts(1, seed=12)[0], GREEDY, request_id="x")
    while engine.has_unfinished():
        engine.step()
        assert engine.last_stats.planned_tokens is None
