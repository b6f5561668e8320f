"""Each policy's decisions on constructed batches, with cost curves and acceptance chosen by hand."""
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from specserve.step_types import BatchView, DraftOutcome, PhaseTimes, RequestView, StepFeedback
from specserve.engine.sequence import SpecStats
from specserve.spec_decode.cost_model import KNOTS, StepCostModel, _fit
from specserve.spec_decode.allocation import evaluate, survival
from specserve.spec_decode.speculation_models import SpeculationModels
from specserve.spec_decode.policies import make_policy

K = 4
LATENCY_MODEL = Path(__file__).parents[2] / "bench" / "results" / "latency20" / "model.json"


def cost_model(verify, draft) -> StepCostModel:
    """verify(rows), draft(rows): seconds; no KV term."""
    samples = lambda f: [[r, 0, f(r)] for r in KNOTS] + [[r, 1000, f(r)] for r in KNOTS]  # noqa: E731
    return StepCostModel(_fit(samples(verify)), {"d": _fit(samples(draft))})


MEMORY_BOUND = cost_model(lambda n: 0.020 + 0.0001 * max(n - 16, 0), lambda r: 0.001)  # flat to 16 rows
COMPUTE_BOUND = cost_model(lambda n: 0.002 + 0.001 * n, lambda r: 0.0005 + 0.0001 * r)  # every row costs


def batch(n, tokens_left=100, slo=None, ids=None, prefill=0) -> BatchView:
    ids = ids or [f"r{i}" for i in range(n)]
    return BatchView([RequestView(i, 200, tokens_left, SpecStats(), "d", True, slo) for i in ids], K, 512,
                     10_000, 1 if prefill else 0, prefill)


def policy(name, cost, accepted=None, **options):
    models = SpeculationModels(K)
    models.profile(lambda: cost)
    for _ in range(accepted[1] if accepted else 0):  # history of the draft: `accepted[0]` of 4 accepted each time
        models.acceptance.observe(DraftOutcome("old", "d", K, accepted[0], None))
    models.acceptance.forget("old")
    return make_policy(name, K, options, models)


def test_high_load_adaptive_drafts_nothing():
    p = policy("adaptive", COMPUTE_BOUND)
    assert p.plan(batch(64)) == [0] * 64


def thirty_percent(p):
    """A draft history whose first token is accepted 30 % of the time, the rest never."""
    for i in range(200):
        p.models.acceptance.observe(DraftOutcome("old", "d", K, int(i % 10 < 3), None))
    return p


def test_a_prefill_chunk_in_the_step_does_not_make_drafting_look_free():
    """Beside a 256-token prefill chunk (half a second here) two decodes' drafts add little to the step,
    but each drafted token still costs a row: at 30 % acceptance more than a decode-only step spends per
    token. So adaptive drafts nothing, as without the chunk; SmartSpec's rule, charging the decodes the
    whole step, drafts. With every draft accepted, adaptive drafts either way."""
    cost = cost_model(lambda n: 0.010 + 0.002 * n, lambda r: 0.0005)
    p = thirty_percent(policy("adaptive", cost))
    assert p.plan(batch(2, prefill=256)) == p.plan(batch(2)) == [0, 0]
    assert thirty_percent(policy("goodput", cost)).plan(batch(2, prefill=256)) != [0, 0]
    p = policy("adaptive", cost, accepted=(4, 200))
    assert p.plan(batch(2, prefill=256)) != [0, 0] and p.plan(batch(2)) != [0, 0]


def test_a_queue_makes_adaptive_draft_less():
    """Every second a draft adds delays the waiting requests too: the same decodes draft shorter as the
    queue grows, and not at all once it is long."""
    p = policy("adaptive", cost_model(lambda n: 0.010 + 0.002 * n, lambda r: 0.0005), accepted=(3, 200))
    lengths = []
    for waiting in (0, 2, 8, 64):
        view = batch(2)
        view = BatchView(view.requests, K, 512, 10_000, waiting)
        lengths.append(sum(p.plan(view)))
    assert lengths[0] > 0 and lengths == sorted(lengths, reverse=True) and lengths[-1] == 0, lengths


def test_light_load_and_high_acceptance_adaptive_drafts_long():
    p = policy("adaptive", MEMORY_BOUND, accepted=(4, 200))
    assert p.plan(batch(1)) == [K]


def test_adaptive_drafts_shorter_for_a_request_whose_own_drafts_are_rejected():
    p = policy("adaptive", cost_model(lambda n: 0.010 + 0.002 * n, lambda r: 0.0005), accepted=(3, 200))
    for _ in range(10):
        p.models.acceptance.observe(DraftOutcome("r1", "d", K, 0, None))
    lengths = p.plan(batch(2))
    assert lengths[0] > lengths[1], lengths


def test_hysteresis_holds_lengths_steady_on_a_noisy_stationary_stream():
    # Acceptance hovers where two lengths are nearly as good: without hysteresis the choice flips.
    cost = cost_model(lambda n: 0.010 + 0.0035 * n, lambda r: 0.0003)
    rng = np.random.default_rng(0)

    def changes(margin):
        p = policy("adaptive", cost, margin=margin)
        p.models.acceptance.predict_batch = lambda asked: np.clip(
            0.55 + 0.06 * rng.standard_normal((len(asked), K)), 0, 0.99)
        view, lengths = batch(4), []
        for _ in range(200):
            lengths.append(p.plan(view))
            for r, n in zip(view.requests, lengths[-1]):  # what the scheduler records after the step
                r.spec.last_drafted = n
        return sum(a != b for a, b in zip(lengths, lengths[1:]))

    free, held = changes(0.0), changes(0.05)
    assert free > 20 and held < free / 3


def test_tpot_slo_shortens_drafts_to_meet_it():
    """Half the batch drafts well, half is rejected every time: long drafts for the first half lengthen the
    step that the second half waits for while committing one token per step."""
    cost = cost_model(lambda n: 0.010 + 0.0008 * n, lambda r: 0.001)

    def planned(slo):
        p = policy("adaptive", cost, accepted=(3, 100))
        for i in range(4, 8):
            for _ in range(10):
                p.models.acceptance.observe(DraftOutcome(f"r{i}", "d", K, 0, None))
        return p, p.plan(batch(8, slo=slo))

    p, free = planned(None)
    slo = 0.02  # plain decoding's step (16.4 ms) meets it, the goodput optimum's (29 ms) does not
    _, bound = planned(slo)
    assert sum(bound) < sum(free)
    a = np.array([p.models.acceptance.predict(f"r{i}", "d") for i in range(8)])
    c, costs = survival(a), p.models.step_costs(batch(8))
    for lengths, meets in ((bound, True), (free, False)):
        step = evaluate(c, lengths, ["d"] * 8, costs)
        own = 1 + np.array([c[i, :n].sum() for i, n in enumerate(lengths)])
        assert bool(np.max(step.seconds / own) <= slo) == meets


def test_off_static_and_batch_table():
    assert policy("off", MEMORY_BOUND).plan(batch(3)) == [0, 0, 0]
    assert policy("static", MEMORY_BOUND).plan(batch(3)) == [K] * 3
    table = policy("batch_table", MEMORY_BOUND, table=[[1, 4], [4, 2], [16, 0]])
    assert [table.plan(batch(n))[0] for n in (1, 3, 4, 15, 16, 40)] == [4, 4, 2, 2, 0, 0]


def test_adaptive_prices_the_catch_up_of_a_draft_cache_left_behind():
    """A draft forward of one row per request is cheap, of hundreds of rows is not: the same request, as
    well accepted, drafts when its draft has seen its context and does not when the draft must first catch
    up on 300 positions it missed (an EAGLE draft after steps without drafting)."""
    p = policy("adaptive", cost_model(lambda n: 0.010 + 0.001 * n, lambda r: 0.0005 + 0.0002 * r), accepted=(3, 200))
    current, behind = batch(1), batch(1)
    behind = BatchView([replace(r, draft_rows=301) for r in behind.requests], K, 512, 10_000, 0)
    assert p.plan(current) != [0] and p.plan(behind) == [0]
    caught_up = evaluate(survival(np.full((1, K), 0.75)), [K], ["d"], p.models.step_costs(behind), first_rows=[301])
    assert caught_up.gain < 1 < evaluate(survival(np.full((1, K), 0.75)), [K], ["d"],
                                         p.models.step_costs(current)).gain


def test_threshold_stops_before_the_first_position_predicted_below_it():
    assert policy("threshold", MEMORY_BOUND, accepted=(1, 200), threshold=0.6).plan(batch(2)) == [1, 1]
    assert policy("threshold", MEMORY_BOUND, accepted=(4, 200), threshold=0.6).plan(batch(2)) == [K, K]
    assert policy("threshold", MEMORY_BOUND, accepted=(0, 200), threshold=0.6).plan(batch(2)) == [0, 0]


def test_goodput_picks_one_batch_wide_k_from_load():
    assert policy("goodput", COMPUTE_BOUND).plan(batch(64)) == [0] * 64
    light = policy("goodput", MEMORY_BOUND, accepted=(4, 200)).plan(batch(2))
    assert light == [K, K]


def test_planned_takes_the_latency_models_best_k_for_the_measured_rate(monkeypatch):
    import specserve.spec_decode.policies.planned as planned
    p = policy("planned", MEMORY_BOUND, model=str(LATENCY_MODEL), window=10.0)
    now = [1000.0]
    monkeypatch.setattr(planned.time, "monotonic", lambda: now[0])
    ks = {}
    for rate in (0.1, 1.0):  # requests arriving at this rate, one new one per plan
        p.arrivals.clear()
        for i in range(int(rate * 10)):
            now[0] += 1 / rate
            view = batch(1, ids=[f"{rate}-{i}"])
            p.observe(StepFeedback(view, [], PhaseTimes(), 1, 0))  # a step that ran the new request
            ks[rate] = p.plan(view)[0]
    # latency20's fit: speculation pays at light load (a long draft), less and less as the rate rises
    assert ks[0.1] >= 2 and ks[1.0] < ks[0.1]
    with pytest.raises(Exception, match="needs"):
        policy("planned", MEMORY_BOUND)


def test_adaptive_prices_a_prompt_lookup_hit_as_free():
    """A model draft whose forward costs as much as a decode does not pay at 75 % acceptance; the same
    request offered a 3-token prompt-lookup hit ("ngram": no forward), accepted as often, drafts all of it."""
    p = policy("adaptive", cost_model(lambda n: 0.010 + 0.001 * n, lambda r: 0.010), accepted=(3, 200))
    for _ in range(200):
        p.models.acceptance.observe(DraftOutcome("old", "ngram", K, 3, None))
    p.models.acceptance.forget("old")
    view = batch(1)
    offered = BatchView([replace(r, draft="ngram", max_drafts=3) for r in view.requests], K, 512, 10_000, 0)
    assert p.plan(view) == [0]
    assert p.plan(offered) == [3]


def test_drafting_error_learns_the_added_time_and_forgets_it():
    """Drafting steps that add twice the predicted time: the factor approaches 2, whatever the model's bias on
    plain steps (here it predicts plain steps 10 % fast, which is not drafting's fault); then plain steps
    alone bring it back towards 1."""
    from specserve.spec_decode.speculation_models import DraftingError
    error = DraftingError()
    for _ in range(300):
        error.observe(False, 0.011, 0.010, 0.010)             # plain: measured 1.1 x predicted
        error.observe(True, 0.011 + 0.008, 0.014, 0.010)      # drafting: predicted to add 4 ms, added 8
    assert error.bias == pytest.approx(1.1) and 1.9 < error.factor <= 2.0
    for _ in range(700):
        error.observe(False, 0.011, 0.010, 0.010)
    assert error.factor < 1.05


def test_drafting_is_charged_the_sampling_of_its_verify_rows():
    """Forwards exactly as predicted, but sampling takes 1 ms a row (a sampled workload): a plain 2-request
    step samples 2 rows, a step drafting 3 tokens each 8 rows; the 6 ms those add are drafting's cost too."""
    cost = cost_model(lambda n: 0.002 + 0.001 * n, lambda r: 0.0005)  # this test's own: its observe is replaced
    cost.observe = lambda rows, kv, forward, drafts, draft_s: float(cost.verify_time(rows, 0)[0])  # learns nothing
    models = SpeculationModels(K)
    models.profile(lambda: cost)
    view = batch(2)

    def step(drafted):
        rows = 2 * (1 + drafted)
        forward = float(cost.verify_time(rows, 0)[0])
        outcomes = [DraftOutcome(r.request_id, "d", drafted, drafted, None) for r in view.requests]
        models.observe(StepFeedback(view, outcomes, PhaseTimes(forward=forward, sample=0.001 * rows), rows, 0, 0))
    for _ in range(200):
        step(0)
        step(3)
    # plain: 4 ms forward + 2 ms sampling, a bias of 1.5; drafting: 10 + 8 ms, predicted to add 6 ms, added
    # 18 - 1.5 x 4 = 12: a factor of 2 (a little less: the prior's pseudo-steps); without sampling it stays 1
    assert 1.6 < models.drafting.factor < 2.0


def test_adaptive_drafts_less_once_drafting_steps_turn_out_dearer_than_predicted():
    p = policy("adaptive", cost_model(lambda n: 0.010 + 0.002 * n, lambda r: 0.0005), accepted=(3, 200))
    before = sum(p.plan(batch(2)))
    for _ in range(300):
        p.models.drafting.observe(True, 0.016 + 0.009, 0.016, 0.012)  # predicted to add 4 ms: added 13
    after = sum(p.plan(batch(2)))
    assert before > 0 and after < before, (before, after)


def test_adaptive_skips_planning_while_drafting_stays_far_from_paying():
    """A batch for which the best drafting allocation is predicted far below plain decoding: the next
    quiet_steps plans of the same batch are not computed, whatever the queue and sampled requests' offers
    (lookup hits come and go under sampling); other requests, or a greedy request's new offer, plan again."""
    p = policy("adaptive", COMPUTE_BOUND)
    calls = []
    step_costs = p.models.step_costs
    p.models.step_costs = lambda view: calls.append(1) or step_costs(view)
    view = batch(64)
    for _ in range(1 + p.quiet_steps):
        assert p.plan(view) == [0] * 64
    assert len(calls) == 1
    assert p.plan(view) == [0] * 64 and len(calls) == 2  # the quiet steps are used up: plans again
    p.plan(batch(63))
    assert len(calls) == 3  # another batch
    p.plan(BatchView(batch(63).requests, K, 512, 10_000, 5))
    assert len(calls) == 3  # a queue formed: drafting pays still less
    sampled = [replace(r, greedy=False) for r in batch(63).requests]
    p.plan(BatchView(sampled, K, 512, 10_000, 0))
    assert len(calls) == 4  # the same requests, sampled now: planned once more
    p.plan(BatchView([replace(r, draft="ngram", max_drafts=2) for r in sampled], K, 512, 10_000, 0))
    assert len(calls) == 4  # a sampled request's lookup hit
    hit = [replace(batch(63).requests[0], draft="ngram", max_drafts=2), *batch(63).requests[1:]]
    p.plan(BatchView(hit, K, 512, 10_000, 0))
    assert len(calls) == 5  # a greedy request's lookup hit
    p.plan(BatchView([replace(hit[0], max_drafts=4), *hit[1:]], K, 512, 10_000, 0))
    assert len(calls) == 6  # a longer one


def test_a_batch_with_nothing_to_draft_does_not_start_a_quiet_window():
    """No lookup hit (prompt lookup alone offers 0): nothing was found far from paying, so the step after,
    with a hit, plans (a sampled request: its offers are not in the quiet window's key)."""
    p = policy("adaptive", COMPUTE_BOUND)
    calls = []
    step_costs = p.models.step_costs
    p.models.step_costs = lambda view: calls.append(1) or step_costs(view)
    miss = [replace(r, draft="ngram", max_drafts=0, greedy=False) for r in batch(1).requests]
    assert p.plan(BatchView(miss, K, 512, 10_000, 0)) == [0]
    p.plan(BatchView([replace(miss[0], max_drafts=4)], K, 512, 10_000, 0))
    assert len(calls) == 2


def test_adaptive_plans_every_step_where_drafting_is_close_to_paying():
    p = policy("adaptive", cost_model(lambda n: 0.010 + 0.002 * n, lambda r: 0.0005), accepted=(3, 200))
    calls = []
    step_costs = p.models.step_costs
    p.models.step_costs = lambda view: calls.append(1) or step_costs(view)
    for _ in range(5):
        p.plan(batch(2))
    assert len(calls) == 5
