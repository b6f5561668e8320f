"""A fitted model file -> the coefficients a replica exports (specserve/scaleout/coefficients.py)."""
import pytest

from specserve.latency.fitting import model_file
from specserve.latency.decisions.planning import acceptance_for
from specserve.scaleout.coefficients import from_model_file


@pytest.mark.parametrize("k", [0, 3])
def test_lines_in_output_length_reproduce_the_model(fitted_model, k):
    model_path = fitted_model
    model = model_file.load(model_path).model
    c = from_model_file(str(model_path), k)
    e = acceptance_for(model, k, None)[0]
    assert c.fitted and c.k == k and c.acceptance_length == pytest.approx(e)
    for g in (8, 128, 700):
        want = model.e2e.demands(k, e, g)
        assert c.demands(c.prompt_tokens, g) == pytest.approx((want.c1, want.c2), rel=1e-9)
    # A longer prompt adds its prefill to C1 (model.py _split), at the model's seconds per prompt token.
    shift = 100 * (model.prefill_per_token or 0.0)
    assert c.demands(c.prompt_tokens + 100, 128)[0] == pytest.approx(model.e2e.demands(k, e, 128).c1 + shift)
