"""`specserve serve --replicas N` as a child process, for tests and benchmarks: started in its own session,
ready once it prints its URL, stopped with SIGTERM (the server then shuts Serve and Ray down) and, past a
deadline, SIGKILL to the whole session, so that nothing Ray started outlives it.

SIGTERM goes to the server alone, not its group: Ray's own processes share the group, and killing them
under a server that is still shutting Serve down makes that shutdown wait for a dead cluster.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from specserve.errors import SpecServeError
from specserve.scaleout.launch import RAY_FAILED

URL_RE = re.compile(r"specserve serving (http://[^\s/]+)/v1")


class RayUnavailable(SpecServeError):
    """Ray could not start on this machine (its message is the server's line)."""


class ReplicaServer:
    def __init__(self, args: list[str], log_path: Path, startup_timeout_s: float = 240,
                 shutdown_timeout_s: float = 90, host: str = "127.0.0.1", port: int = 0, env: dict | None = None):
        """env: variables added to this environment, which the replicas and their engines inherit."""
        self.log_path, self.shutdown_timeout_s = Path(log_path), shutdown_timeout_s
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "wb")
        # RAY_memory_monitor_refresh_ms=0: Ray's memory monitor kills workers when the *machine* is at 95 %
        # of its memory, whoever uses it; on a shared test or benchmark machine that was our replicas,
        # killed for other people's jobs. The kernel's own OOM killer still guards the machine.
        env = dict(os.environ, PYTHONUNBUFFERED="1", RAY_USAGE_STATS_ENABLED="0", RAY_memory_monitor_refresh_ms="0",
                   **(env or {}))
        env.pop("SPECSERVE_API_KEY", None)  # a key is passed as --api-key, never picked up by accident
        self.proc = subprocess.Popen([sys.executable, "-m", "specserve", "serve", "--host", host, "--port", str(port),
                                      *args], stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True)
        try:
            self.root = self._wait_ready(startup_timeout_s)
        except BaseException:
            self.stop()
            raise
        self.base_url = self.root + "/v1"

    @property
    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def _wait_ready(self, timeout_s: float) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                log = self.log
                if RAY_FAILED in log:
                    raise RayUnavailable(log[log.index(RAY_FAILED):].splitlines()[0])
                raise SpecServeError(f"server exited with {self.proc.returncode}:\n{log[-6000:]}")
            m = URL_RE.search(self.log)
            if m:
                return m.group(1)
            time.sleep(0.2)
        raise SpecServeError(f"server not ready after {timeout_s:.0f} s:\n{self.log[-6000:]}")

    def health(self) -> dict:
        return httpx.get(self.root + "/health", timeout=30).json()

    def wait_healthy(self, replicas: int, timeout_s: float = 60) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            h = self.health()
            if h.get("ready_replicas") == replicas or time.monotonic() > deadline:
                return h
            time.sleep(0.5)

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(self.shutdown_timeout_s)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # whatever Ray left in our session
        except ProcessLookupError:
            pass
        if self.proc.poll() is None:
            self.proc.wait(10)
        self._log.close()
        return self.proc.returncode

    def leftovers(self) -> list[str]:
        """Processes still in the server's session (after stop(): none, or something leaked)."""
        out = subprocess.run(["ps", "-o", "pid=,sid=,comm=", "-e"], capture_output=True, text=True).stdout
        return [line for line in out.splitlines() if line.split()[1] == str(self.proc.pid)]
