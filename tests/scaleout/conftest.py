"""A real `specserve serve --replicas 2` (a local Ray cluster) for the scale-out tests, and a fitted model.

The server runs in its own session, so that whatever Ray starts under it can be found and, should its
own shutdown fail, killed as a group: no test leaves Ray processes behind. Startup, tests and shutdown are
each bounded in time; where Ray cannot start on this machine the tests are skipped, saying why.
"""
import pytest

from specserve.latency.fitting import model_file
from specserve.latency.fitting.fit import FitOptions, fit_runs
from specserve.latency.records.runs import load_runs
from specserve.settings import STEP_PACE_ENV
from tests.latency.synthetic import write_sweep

SMALL_KV = "0.002"


@pytest.fixture(scope="session")
def fitted_model(tmp_path_factory):
    """A latency model fitted on the synthetic sweep of tests/latency (any server's coefficients will do)."""
    d = tmp_path_factory.mktemp("scaleout-model")
    sweep = write_sweep(d)
    path = d / "model.json"
    model_file.save(fit_runs(load_runs([sweep]), FitOptions(cross_validate=False), [str(sweep)]), path)
    return path


@pytest.fixture(scope="module", params=["process", "ray"])
def cluster(request, tiny_target, fitted_model, tmp_path_factory):
    """Two replicas of the tiny target, one thread each, latency-aware router with a fitted model; HTTP
    answered by the serving process (the default) or by Ray Serve's proxy and ingress deployment."""
    pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install 'specserve[scaleout]')")
    from specserve.scaleout.process import RayUnavailable, ReplicaServer

    try:
        server = ReplicaServer(["--model", str(tiny_target), "--dtype", "float32", "--kv-cache-memory", SMALL_KV,
                                "--max-model-len", "1024", "--speculative-config", "none", "--num-threads", "1",
                                "--served-model-name", "tiny", "--replicas", "2", "--router", "latency",
                                "--latency-model", str(fitted_model), "--drain-timeout", "5",
                                "--front", request.param],
                               tmp_path_factory.mktemp("scaleout") / "serve.log",
                               env={STEP_PACE_ENV: "0.01"})  # a 900-token request runs >= 9 s on any machine
    except RayUnavailable as e:
        pytest.skip(f"Ray cannot start here: {e}")
    yield server
    code = server.stop()
    assert code == 0, f"the server did not shut down cleanly (exit {code}):\n{server.log[-4000:]}"
    assert not server.leftovers(), server.leftovers()
