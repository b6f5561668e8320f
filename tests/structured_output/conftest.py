import pytest

from specserve import LLM
from tests.spec_decode.test_speculative_engine import prompts
from tests.structured_output.guide_fixtures import guided


@pytest.fixture(scope="session")
def guided_baseline(tiny_target):
    """Plain decoding's greedy output under each kind of guide: what speculation must reproduce."""
    ps = prompts(25, seed=3)
    outs = LLM(model=str(tiny_target), dtype="float32").generate(ps, [guided(i) for i in range(len(ps))])
    return ps, outs
