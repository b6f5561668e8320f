"""Which proposer drafts a request (spec_decode/choice.py): a free hit over the model; between free hits,
the most expected accepted tokens."""
import pytest

from specserve.step_types import DraftOutcome
from specserve.spec_decode.choice import DraftChoice
from specserve.spec_decode.speculation_models import SpeculationModels


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


def offers(suffix=3, ngram=3, model=4):
    return [("suffix", suffix), ("ngram", ngram), ("code", model)]


@pytest.mark.parametrize("models", [None, "learned"])
def test_a_free_hit_wins_over_the_model_which_drafts_where_none_hits(models):
    choice = DraftChoice(learned({"suffix": 0.1, "ngram": 0.1, "code": 0.9}) if models else None)
    assert choice.pick("r", offers(ngram=0)) == 0
    assert choice.pick("r", offers(suffix=0)) == 1
    assert choice.pick("r", offers(suffix=0, ngram=0)) == 2


@pytest.mark.parametrize("rates, lengths, want", [
    ({"suffix": 0.9, "ngram": 0.3}, (3, 3), 0),   # suffix accepted most
    ({"suffix": 0.2, "ngram": 0.8}, (3, 3), 1),   # lookup accepted most
    ({"suffix": 0.6, "ngram": 0.6}, (3, 3), 0),   # a tie: the first listed
    ({"suffix": 0.6, "ngram": 0.6}, (1, 4), 1),   # the same acceptance: the longer hit
])
def test_between_free_hits_the_most_expected_tokens_win(rates, lengths, want):
    assert DraftChoice(learned(rates)).pick("r", offers(*lengths)) == want


def test_a_request_s_own_history_with_a_source_moves_the_choice():
    models = learned({"suffix": 0.5, "ngram": 0.5})
    choice = DraftChoice(models)
    for _ in range(20):  # r's suffix drafts are all accepted, its lookups rejected; t's the other way round
        for request, accepted in (("r", "suffix"), ("t", "ngram")):
            for source in ("suffix", "ngram"):
                models.acceptance.observe(DraftOutcome(request, source, 3, 3 if source == accepted else 0, None))
    assert choice.pick("r", offers()) == 0
    assert choice.pick("t", offers()) == 1
