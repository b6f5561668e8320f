"""Which proposer drafts a request (spec_decode/choice.py): the highest predicted tokens per second."""
import pytest

from specserve.batch import DraftOutcome
from specserve.spec_decode.choice import DraftChoice
from specserve.spec_decode.predictors import SpeculationModels
from tests.spec_decode.policy_fixtures import FixedCost


def learned(rates: dict[str, float], k: int = 4, n: int = 400) -> SpeculationModels:
    """Models that have seen each source accepted at its rate, position by position (deterministically)."""
    models = SpeculationModels(k)
    for source, rate in rates.items():
        for i in range(n):
            accepted = 0
            while accepted < k and ((i * 7919 + accepted * 104729) % 1000) / 1000 < rate:
                accepted += 1
            models.acceptance.observe(DraftOutcome(f"other-{source}-{i}", source, k, accepted, None))
    return models


def offers(suffix=3, ngram=3, model=4, confidences=None):
    return [("suffix", suffix, confidences, 0), ("ngram", ngram, None, 0), ("code", model, None, 1)]


def test_without_models_the_first_hit_wins_and_the_model_drafts_where_none_hits():
    choice = DraftChoice()
    assert choice.pick("r", 100, offers()) == 0
    assert choice.pick("r", 100, offers(suffix=0)) == 1
    assert choice.pick("r", 100, offers(suffix=0, ngram=0)) == 2


@pytest.mark.parametrize("rates, want", [
    ({"suffix": 0.9, "ngram": 0.3, "code": 0.5}, 0),   # suffix accepted most
    ({"suffix": 0.2, "ngram": 0.8, "code": 0.5}, 1),   # lookup accepted most
    ({"suffix": 0.2, "ngram": 0.2, "code": 0.9}, 2),   # the model's drafts are worth more than weak free hits
    ({"suffix": 0.6, "ngram": 0.2, "code": 0.6}, 0),   # a tie with the model: the free draft
])
def test_without_a_cost_model_the_most_expected_tokens_win(rates, want):
    assert DraftChoice(learned(rates)).pick("r", 100, offers(model=3)) == want


def test_with_a_cost_model_a_dear_model_draft_loses_to_a_weaker_free_one():
    models = learned({"suffix": 0.5, "ngram": 0.2, "code": 0.8})
    cheap, dear = FixedCost(0.010, 1e-5, 1e-5, ["code"]), FixedCost(0.010, 1e-5, 0.004, ["code"])
    models.profile(lambda: cheap)
    assert DraftChoice(models).pick("r", 100, offers()) == 2
    models = learned({"suffix": 0.5, "ngram": 0.2, "code": 0.8})
    models.profile(lambda: dear)  # each draft forward 40 % of a step
    assert DraftChoice(models).pick("r", 100, offers()) == 0


def test_a_suffix_draft_is_priced_by_its_own_confidences():
    models = learned({"suffix": 0.5, "ngram": 0.5})
    choice = DraftChoice(models)
    sure, unsure = [0.99, 0.98, 0.97], [0.3, 0.1, 0.02]
    assert choice.pick("r", 100, offers(confidences=sure, model=0)) == 0
    assert choice.pick("r", 100, offers(confidences=unsure, model=0)) == 1
