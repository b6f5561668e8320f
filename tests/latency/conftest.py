"""Shared synthetic sweeps: written and fitted once per session, since every fit costs real CPU."""
import pytest

from specserve.latency.fitting.fit import FitOptions, fit_runs
from specserve.latency.records.runs import load_runs
from synthetic import Sweep, write_sweep


@pytest.fixture(scope="session")
def sweep_file(tmp_path_factory):
    """Five configurations x 8 rates at 256/128 tokens, plus three saturated runs."""
    return write_sweep(tmp_path_factory.mktemp("sweep"))


@pytest.fixture(scope="session")
def fitted(sweep_file):
    return fit_runs(load_runs([sweep_file]), FitOptions(), [str(sweep_file)])


@pytest.fixture(scope="session")
def two_length_file(tmp_path_factory):
    """The same configurations also at 32 output tokens: separates prefill (c·p) from per-cycle costs."""
    return write_sweep(tmp_path_factory.mktemp("two"), Sweep(extra_output_tokens=(32,),
                                                             load_fractions=tuple(i / 10 for i in range(1, 8))))
