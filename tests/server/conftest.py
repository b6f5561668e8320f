"""Real `specserve serve` processes on 127.0.0.1 for the server tests.

Each server binds port 0 (a free port the kernel picks) and names it in its startup line, so there is no
race for a port. Output goes to a file, not a pipe: a pipe nobody reads would block a chatty server.
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

STARTUP_TIMEOUT_S = 90
URL_RE = re.compile(r"specserve serving (http://127\.0\.0\.1:\d+)/v1")
# A fraction (< 1) of free memory, so a few tens of MB on a typical machine: room for the tests' requests
# (50 at once of under 100 tokens, or one of max_model_len 1024) and far less than a GiB.
SMALL_KV = "0.002"


class ServerProcess:
    def __init__(self, args: list[str], log_path: Path, startup_timeout: float = STARTUP_TIMEOUT_S):
        self.log_path, self.startup_timeout = log_path, startup_timeout
        self._log = open(log_path, "wb")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env.pop("SPECSERVE_API_KEY", None)
        self.proc = subprocess.Popen([sys.executable, "-m", "specserve", "serve", "--host", "127.0.0.1",
                                      "--port", "0", "--num-threads", "1", *args],
                                     stdout=self._log, stderr=subprocess.STDOUT, env=env)
        self.root = self._wait_ready()
        self.base_url = self.root + "/v1"

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def _wait_ready(self) -> str:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log}")
            m = URL_RE.search(self.log)
            if m:
                try:
                    if httpx.get(m.group(1) + "/health", timeout=5).status_code == 200:
                        return m.group(1)
                except httpx.HTTPError:
                    pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"server not ready after {self.startup_timeout} s:\n{self.log}")

    def metrics(self) -> dict[str, float]:
        """`name{labels}` -> value, labels as written (sorted by prometheus_client)."""
        text = httpx.get(self.root + "/metrics", timeout=10).text
        out = {}
        for line in text.splitlines():
            if line and not line.startswith("#"):
                key, value = line.rsplit(" ", 1)
                out[key] = float(value)
        return out

    def metric(self, name: str, **labels) -> float:
        """Sum of the series of `name` whose labels include `labels`."""
        total = 0.0
        for key, value in self.metrics().items():
            base, _, rest = key.partition("{")
            if base == name and all(f'{k}="{v}"' in rest for k, v in labels.items()):
                total += value
        return total

    def stop(self, timeout: float = 30) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        return self.proc.returncode


def wait_until(predicate, timeout: float = 20, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def tiny_args(target, *extra) -> list[str]:
    return ["--model", str(target), "--dtype", "float32", "--kv-cache-memory", SMALL_KV,
            "--max-model-len", "1024", *extra]


@pytest.fixture(scope="session")
def spec_server(tiny_target, tiny_draft, tmp_path_factory):
    """The tiny target with the tiny draft, k = 3, no API key: most tests run against it."""
    server = ServerProcess(tiny_args(tiny_target, "--speculative-config",
                                     f'{{"model": "{tiny_draft}", "num_speculative_tokens": 3}}',
                                     "--served-model-name", "tiny", "tiny-alias"),
                           tmp_path_factory.mktemp("server") / "spec.log")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def keyed_server(tiny_target, tmp_path_factory):
    """API key on, one running request at most and no queue: for 401 and 429."""
    server = ServerProcess(tiny_args(tiny_target, "--speculative-config", "none", "--api-key", "sekret",
                                     "--served-model-name", "tiny", "--max-num-seqs", "1", "--max-queue", "0"),
                           tmp_path_factory.mktemp("server") / "keyed.log")
    yield server
    server.stop()
