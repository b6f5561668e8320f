"""A server that runs at most c requests at once (equations/slots.py) and the fit that knows it."""
import math

import pytest

from specserve.errors import SpecServeError
from specserve.latency.equations.slots import check_slots, erlang_c, slot_delay, slot_saturation
from specserve.latency.fitting import model_file
from specserve.latency.fitting.fit import FitOptions, fit_runs
from specserve.latency.records.runs import load_runs
from synthetic import CONFIGS, TRUE, Sweep, write_sweep


@pytest.mark.parametrize("slots, busy, expected", [
    (1, 0.5, 0.5),        # M/M/1: an arrival waits with probability ρ
    (2, 1.0, 1 / 3),      # textbook M/M/2 at a = 1
    (3, 2.0, 4 / 9),
    (8, 0.0, 0.0),
])
def test_erlang_c_matches_closed_forms(slots, busy, expected):
    assert erlang_c(slots, busy) == pytest.approx(expected, rel=1e-12)


def test_erlang_c_stays_finite_for_a_large_batch_cap():
    assert 0.0 < erlang_c(1024, 1000.0) < 1.0


def test_no_cap_or_no_load_adds_nothing():
    assert slot_delay(5.0, 4.0, 0.5, 0.3, None) == (0.0, 0.0)
    assert slot_delay(4.0, 4.0, 0.5, 0.0, 8) == (0.0, 0.0)


def test_the_wait_grows_with_load_and_is_infinite_once_the_slots_are_all_busy():
    c1, c2, slots = 4.0, 0.9, 8
    waits = []
    for rate in (0.1, 0.3, 0.5, 0.6):
        latency = c1 / (1 - rate * c2)
        extra, wait = slot_delay(latency, c1, c2, rate, slots)
        assert extra >= wait >= 0.0
        waits.append(wait)
    assert waits == sorted(waits) and waits[0] < 1e-6 < waits[-1]
    top = slot_saturation(c1, c2, slots)
    latency = c1 / (1 - top * c2)
    assert slot_delay(latency, c1, c2, top * 1.01, slots) == (math.inf, math.inf)


def test_even_service_halves_erlangs_wait_and_burstier_arrivals_lengthen_it():
    c1, c2, rate, slots = 4.0, 0.9, 0.55, 8
    latency = c1 / (1 - rate * c2)
    even = slot_delay(latency, c1, c2, rate, slots, cv=1.0, service_cv=0.0)[1]
    memoryless = slot_delay(latency, c1, c2, rate, slots, cv=1.0, service_cv=1.0)[1]
    bursty = slot_delay(latency, c1, c2, rate, slots, cv=2.0, service_cv=0.0)[1]
    assert memoryless == pytest.approx(2 * even) and bursty == pytest.approx(4 * even)


def test_saturation_is_where_the_slots_are_all_busy():
    c1, c2, slots = 4.0, 0.9, 8
    top = slot_saturation(c1, c2, slots)
    service = min(c1 / (1 - top * c2), c1 + c2 * (slots - 1))
    assert top * service == pytest.approx(slots)
    assert top < 1 / c2


@pytest.mark.parametrize("bad", [0, -2, 2.5, True, "8"])
def test_slots_must_be_a_positive_integer(bad):
    with pytest.raises(SpecServeError, match="slots must be a positive integer"):
        check_slots(bad)


@pytest.fixture(scope="module")
def capped_file(tmp_path_factory):
    return write_sweep(tmp_path_factory.mktemp("slots"), Sweep(configs=CONFIGS[:3], slots=4, saturated=False,
                                                               rows=False, extra_output_tokens=(48,)))


def test_a_fit_that_knows_the_cap_recovers_the_demands_and_the_wait(capped_file, tmp_path):
    runs = load_runs([capped_file])
    capped = fit_runs(runs, FitOptions(slots=4, cross_validate=False)).model
    blind = fit_runs(runs, FitOptions(cross_validate=False)).model
    assert capped.e2e.coefficients.mape < 1.0
    assert capped.e2e.coefficients.mape < 0.5 * blind.e2e.coefficients.mape
    for name in ("c1p", "c1v", "c2v"):
        assert capped.e2e.coefficients[name] == pytest.approx(getattr(TRUE, name), rel=0.05)
    busiest = max(runs, key=lambda r: r.achieved_rate * r.e2e.mean)
    pred = capped.predict(busiest.achieved_rate, busiest.k, busiest.acceptance_length, busiest.output_tokens)
    wait = capped.slot_wait(busiest.achieved_rate, busiest.k, busiest.acceptance_length, busiest.output_tokens)
    assert wait > 0.05 * pred.ttft  # the cap binds at the top rate, and TTFT carries its wait
    assert pred.ttft == pytest.approx(busiest.ttft.mean, rel=0.05)
    assert pred.saturation_rate < 1 / capped.demands(busiest.k, busiest.acceptance_length, busiest.output_tokens).c2
    path = tmp_path / "model.json"
    model_file.save(fit_runs(runs, FitOptions(slots=4, cross_validate=False)), path)
    assert model_file.load(path).model.e2e.slots == 4


def test_cli_fits_with_slots_and_explains_them(capped_file, tmp_path, capsys):
    from specserve.cli import main

    out = tmp_path / "model.json"
    assert main(["latency", "fit", str(capped_file), "--slots", "4", "--no-cross-validation", "-o", str(out)]) == 0
    capsys.readouterr()
    assert main(["latency", "explain", str(out)]) == 0
    assert "at most 4 requests at once" in capsys.readouterr().out
    assert main(["latency", "fit", str(capped_file), "--slots", "0", "-o", str(out)]) == 2
    assert "slots must be a positive integer" in capsys.readouterr().err
