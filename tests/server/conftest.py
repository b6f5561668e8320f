"""Real `specserve serve` processes on 127.0.0.1 for the server tests.

Each server binds port 0 (a free port the kernel picks) and names it in its startup line, so there is no
race for a port. Output goes to a file, not a pipe: a pipe nobody reads would block a chatty server.

No test here may depend on how fast this machine is. A test that must act while a request is still running
uses a paced server (PACED: the engine sleeps PACE_S after every step, so a request of n tokens runs at least
n * PACE_S / (k + 1) seconds on any machine), or freezes the engine process (`EngineFreeze`); a test that
waits for something polls for it with a timeout that only guards against a hang.
"""
import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import openai
import pytest
import torch

from specserve.settings import STEP_PACE_ENV

MODEL = "tiny"  # the name the tiny servers serve
STARTUP_TIMEOUT_S = 90
URL_RE = re.compile(r"specserve serving (http://127\.0\.0\.1:\d+)/v1")
# A fraction (< 1) of free memory, so a few tens of MB on a typical machine: room for the tests' requests
# (50 at once of under 100 tokens, or one of max_model_len 1024) and far less than a GiB.
SMALL_KV = "0.002"
# A floor on each engine step: 1000 tokens take >= 5 s with speculation (k = 3) and >= 20 s without, while the
# few-token requests of a test slow down by tenths of a second.
PACE_S = 0.02
PACED = {STEP_PACE_ENV: str(PACE_S)}
ENGINE_READY_RE = re.compile(r"engine process (\d+) ready")


class ServerProcess:
    def __init__(self, args: list[str], log_path: Path, startup_timeout: float = STARTUP_TIMEOUT_S,
                 env: dict[str, str] | None = None):
        self.log_path, self.startup_timeout = log_path, startup_timeout
        self._log = open(log_path, "wb")
        env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
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

    @property
    def engine_pid(self) -> int:
        """The engine's own process, the latest (the server logs its pid once it is ready, before the server
        is, and again for each new one after a restart)."""
        return int(ENGINE_READY_RE.findall(self.log)[-1])

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


class EngineFreeze:
    """`with EngineFreeze(server):` stops the engine process (SIGSTOP) and continues it on leaving: nothing
    steps meanwhile, whatever the machine's speed, while the server's HTTP side keeps answering."""

    def __init__(self, server: ServerProcess):
        self.pid = server.engine_pid

    def __enter__(self) -> "EngineFreeze":
        os.kill(self.pid, signal.SIGSTOP)
        return self

    def __exit__(self, *exc) -> None:
        os.kill(self.pid, signal.SIGCONT)


def wait_until(predicate, timeout: float = 20, interval: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


async def all_in_server(server: ServerProcess, n: int, running: int, timeout: float = 30) -> None:
    """Until the server holds all `n` requests, `running` of them running and the rest waiting (with the
    engine frozen, none runs: they wait in the server until it continues)."""
    for _ in range(int(timeout / 0.05)):
        if (server.metric("specserve:num_requests_running") == running
                and server.metric("specserve:num_requests_waiting") == n - running):
            return
        await asyncio.sleep(0.05)
    raise AssertionError(f"the server never held {n} requests ({running} running)")


def accepted_again(server: ServerProcess, headers: dict, timeout: float = 30) -> httpx.Response:
    """A 2-token completion, sent until it is not refused with 429: after a client left the request that
    held the last slot, the slot frees once the server has seen it go."""
    def send() -> httpx.Response:
        return httpx.post(server.base_url + "/completions", headers=headers, timeout=30,
                          json={"model": "tiny", "prompt": "hi", "max_tokens": 2})
    assert wait_until(lambda: send().status_code != 429, timeout=timeout)
    return send()


async def read_stream(url: str, body: dict) -> dict:
    """Read one SSE stream to its end: the text, the usage and whether [DONE] came."""
    out = {"text": "", "usage": None, "done": False}
    async with httpx.AsyncClient(timeout=60) as http:
        try:
            async with http.stream("POST", url, json=body) as resp:
                async for line in resp.aiter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        out["done"] = True
                        continue
                    chunk = json.loads(line[6:])
                    if "error" in chunk:
                        out["error"] = chunk["error"]["message"]
                    elif chunk["choices"]:
                        out["text"] += chunk["choices"][0]["text"]
                    out["usage"] = chunk.get("usage") or out["usage"]
        except httpx.HTTPError as e:  # cut off
            out["error"] = type(e).__name__
    return out


def long_body(n: int) -> dict:
    return {"prompt": "a long one", "max_tokens": n, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}


def tiny_args(target, *extra) -> list[str]:
    return ["--model", str(target), "--dtype", "float32", "--kv-cache-memory", SMALL_KV,
            "--max-model-len", "1024", *extra]


def _spec_server(tiny_target, tiny_draft, log_path: Path, env: dict[str, str] | None = None) -> ServerProcess:
    return ServerProcess(tiny_args(tiny_target, "--speculative-config",
                                   f'{{"model": "{tiny_draft}", "num_speculative_tokens": 3}}',
                                   "--served-model-name", "tiny", "tiny-alias"), log_path, env=env)


@pytest.fixture(scope="session")
def spec_server(tiny_target, tiny_draft, tmp_path_factory):
    """The tiny target with the tiny draft, k = 3, no API key: most tests run against it."""
    server = _spec_server(tiny_target, tiny_draft, tmp_path_factory.mktemp("server") / "spec.log")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def paced_server(tiny_target, tiny_draft, tmp_path_factory):
    """spec_server, paced (PACE_S a step): a long request provably still runs while a test acts on it."""
    server = _spec_server(tiny_target, tiny_draft, tmp_path_factory.mktemp("server") / "paced.log", env=PACED)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def keyed_server(tiny_target, tmp_path_factory):
    """API key on, one running request at most and no queue: for 401 and 429. Paced, so that a request
    holding the one slot provably still holds it when the next one comes."""
    server = ServerProcess(tiny_args(tiny_target, "--speculative-config", "none", "--api-key", "sekret",
                                     "--served-model-name", "tiny", "--max-num-seqs", "1", "--max-queue", "0"),
                           tmp_path_factory.mktemp("server") / "keyed.log", env=PACED)
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(spec_server):
    """The official client on spec_server."""
    with openai.OpenAI(base_url=spec_server.base_url, api_key="unused", max_retries=0, timeout=60) as c:
        yield c


@pytest.fixture(scope="session")
def reference(tiny_target):
    """The offline engine on the same model: greedy output the servers must reproduce exactly."""
    from specserve import LLM
    threads = torch.get_num_threads()
    # One thread, like the server: on two shared cores a second torch thread slows this 20x or more.
    yield LLM(model=str(tiny_target), dtype="float32", max_model_len=1024, num_kv_blocks=512, num_threads=1)
    torch.set_num_threads(threads)


def greedy(reference, prompts, max_tokens, **kw):
    """Offline greedy outputs of one prompt or a batch (texts, token ids or chat messages) and lengths."""
    from specserve import SamplingParams
    one = not isinstance(prompts, list) or not isinstance(prompts[0], (list, str))
    prompts = [prompts] if one else prompts
    lengths = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(prompts)
    inputs = [reference.tokenizer.encode_chat(p) if isinstance(p, list) and isinstance(p[0], dict) else p
              for p in prompts]
    outs = reference.generate(inputs, [SamplingParams(max_tokens=n, temperature=0, **kw) for n in lengths])
    return outs[0] if one else outs
