"""A real `specserve serve --replicas 2` (a local Ray cluster) for the scale-out tests, and a fitted model.

The server runs in its own session, so that whatever Ray starts under it can be found and, should its
own shutdown fail, killed as a group: no test leaves Ray processes behind. Startup, tests and shutdown are
each bounded in time; where Ray cannot start on this machine the tests are skipped, saying why.
"""
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from specserve.latency import model_file
from specserve.latency.fit import FitOptions, fit_runs
from specserve.latency.runs import load_runs
from tests.latency.synthetic import write_sweep

STARTUP_TIMEOUT_S = 240  # Ray itself takes 10-30 s on 2 busy cores, each replica loads torch and the model
SHUTDOWN_TIMEOUT_S = 90
URL_RE = re.compile(r"specserve serving (http://127\.0\.0\.1:\d+)/v1")
RAY_FAILED = "Ray could not start a local cluster"  # specserve/scaleout/launch.py
SMALL_KV = "0.002"


@pytest.fixture(scope="session")
def fitted_model(tmp_path_factory):
    """A latency model fitted on the synthetic sweep of tests/latency (any server's coefficients will do)."""
    d = tmp_path_factory.mktemp("scaleout-model")
    sweep = write_sweep(d)
    path = d / "model.json"
    model_file.save(fit_runs(load_runs([sweep]), FitOptions(cross_validate=False), [str(sweep)]), path)
    return path


class ScaleoutServer:
    def __init__(self, args: list[str], log_path: Path):
        self.log_path = log_path
        self._log = open(log_path, "wb")
        env = dict(os.environ, PYTHONUNBUFFERED="1", RAY_USAGE_STATS_ENABLED="0")
        env.pop("SPECSERVE_API_KEY", None)
        self.proc = subprocess.Popen([sys.executable, "-m", "specserve", "serve", "--host", "127.0.0.1",
                                      "--port", "0", *args], stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        self.root = self._wait_ready()
        self.base_url = self.root + "/v1"

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def _wait_ready(self) -> str:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                log = self.log
                self.stop()
                if RAY_FAILED in log:
                    pytest.skip(f"Ray cannot start here: {log[log.index(RAY_FAILED):].splitlines()[0]}")
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{log[-6000:]}")
            m = URL_RE.search(self.log)
            if m:
                return m.group(1)
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server not ready after {STARTUP_TIMEOUT_S} s:\n{self.log[-6000:]}")

    def health(self) -> dict:
        return httpx.get(self.root + "/health", timeout=30).json()

    def stop(self) -> int | None:
        """SIGTERM (serve and Ray shut down), then, past the deadline, SIGKILL to the whole session."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(SHUTDOWN_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # what Ray left in our session, if anything
        except ProcessLookupError:
            pass
        if self.proc.poll() is None:
            self.proc.wait(10)
        self._log.close()
        return self.proc.returncode


def leftover_processes(pgid: int) -> list[str]:
    out = subprocess.run(["ps", "-o", "pid=,pgid=,comm=", "-e"], capture_output=True, text=True).stdout
    return [line for line in out.splitlines() if line.split()[1] == str(pgid)]


@pytest.fixture(scope="module")
def cluster(tiny_target, fitted_model, tmp_path_factory):
    """Two replicas of the tiny target, one thread each, latency-aware router with a fitted model."""
    pytest.importorskip("ray.serve", reason="Ray Serve is not installed (pip install 'specserve[scaleout]')")
    server = ScaleoutServer(["--model", str(tiny_target), "--dtype", "float32", "--kv-cache-memory", SMALL_KV,
                             "--max-model-len", "1024", "--speculative-config", "none", "--num-threads", "1",
                             "--served-model-name", "tiny", "--replicas", "2", "--router", "latency",
                             "--latency-model", str(fitted_model), "--drain-timeout", "5"],
                            tmp_path_factory.mktemp("scaleout") / "serve.log")
    yield server
    pgid = server.proc.pid
    code = server.stop()
    assert code == 0, f"the server did not shut down cleanly (exit {code}):\n{server.log[-4000:]}"
    assert not leftover_processes(pgid), leftover_processes(pgid)
