"""AsyncLLMEngine: the engine behind the server, one async output stream per request.

The engine runs its step loop (engine/engine_loop.py) either on a thread of this process or, with
`process=True` (what `specserve serve` does, as vLLM's EngineCore), in a process of its own: then the
HTTP side (asyncio, SSE framing, JSON, tokenization) never holds the GIL or a core's time slice that the
step loop is waiting for. Either way callers talk to it through a command queue, and its messages come
back to one receiving thread here, which hands each request's outputs to its stream
(`loop.call_soon_threadsafe`) and runs the metrics listeners.

A request that cannot be added fails alone; a failed step is retried without its newest request first
(engine_loop.py). The loop's liveness is observable: any message it sends is a heartbeat (at least every
0.5 s when idle), and `health_problem()` names a loop that died or whose current step has run longer than
`stall_timeout` (a hung step).

An engine process is supervised: when it dies (a crash, the OOM killer) or hangs (killed after
`stall_timeout`), every request in flight fails at once with EngineDeadError, and a new process starts
(`restarting` says why meanwhile; new requests are refused). More than `max_restarts` deaths within
RESTART_WINDOW_S is a crash loop: the engine gives up and sets `fatal`, and the server exits non-zero so
that its orchestrator sees it (`max_restarts=0`: give up at the first death, as vLLM does).
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from typing import AsyncIterator, Callable

from specserve.engine.config import EngineConfig
from specserve.engine.engine_loop import EngineDeadError, EngineLoop, Gauges, start_engine_process
from specserve.engine.inputs import InputProcessor
from specserve.engine.outputs import RequestOutput, StepStats
from specserve.engine.sampling_params import SamplingParams
from specserve.errors import SpecServeError

log = logging.getLogger("specserve.engine")

__all__ = ["AsyncLLMEngine", "EngineDeadError"]
DEFAULT_STALL_TIMEOUT_S = 60.0
READY_TIMEOUT_S = 3600.0  # an engine process loading (and fetching, converting, profiling) its model
DEFAULT_ENGINE_RESTARTS = 3  # engine deaths survived within RESTART_WINDOW_S; one more and the server exits
RESTART_WINDOW_S = 600.0


class AsyncLLMEngine:
    def __init__(self, config: EngineConfig | None = None, engine=None,
                 stall_timeout: float = DEFAULT_STALL_TIMEOUT_S, process: bool = False,
                 max_restarts: int = DEFAULT_ENGINE_RESTARTS, started: tuple | None = None):
        """Give a config (the engine is built here, or in its own process with `process=True`) or a built
        LLMEngine (run on a thread). `max_restarts`: see the module's docstring (engine processes only).
        `started`: what `start_engine_process(config)` returned, when the caller started the process early."""
        self.engine = None  # the LLMEngine, when it lives in this process (None with process=True)
        self._process = None
        self.config = config or EngineConfig()
        self.max_restarts = max_restarts
        self.restarts = 0                   # engine processes started after a death
        self.restarting: str | None = None  # why, while a new engine process starts
        self.fatal: str | None = None       # the engine died for good: the server should exit
        self.restart_listeners: list[Callable[[int], None]] = []  # called with the count after each restart
        self._deaths: list[float] = []      # when engine processes died, within the restart window
        if process:
            if engine is not None:
                raise ValueError("an engine built here cannot run in another process")
            self._process, self._commands, self._messages = started or start_engine_process(self.config)
        else:
            from specserve.engine.llm_engine import LLMEngine
            self.engine = engine or LLMEngine(self.config)
            self._commands = queue.SimpleQueue()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self.step_listeners: list[Callable[[StepStats], None]] = []  # called on the receiving thread
        self.output_listeners: list[Callable[[RequestOutput], None]] = []
        self.stall_timeout = stall_timeout
        self._heartbeat = time.monotonic()  # when the loop last said something
        self._died: str | None = None       # why the loop ended, if it did
        self._stopping = False              # shutdown() was called
        self.gauges = Gauges(0, 0.0, None, None)
        self.info = self.engine.info() if self.engine is not None else self._wait_ready()
        self.tokenizer = self.info.tokenizer
        self.inputs = InputProcessor(self.tokenizer, self.info.vocab_size, self.info.max_model_len)

    def _wait_ready(self, process=None, messages=None):
        process, messages = process or self._process, messages or self._messages
        try:
            kind, *payload = messages.get(timeout=READY_TIMEOUT_S)
        except queue.Empty:
            kind, payload = "died", [f"the engine process was not ready after {READY_TIMEOUT_S:g} s"]
        if kind != "ready":
            process.join(timeout=10)
            raise SpecServeError(payload[0])
        return payload[0]

    # ---- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is not None:
            return
        if self._process is None:  # the loop runs here, on its own thread, and delivers as it goes
            loop = EngineLoop(self.engine, self._commands, self._receive)
            self._thread = threading.Thread(target=loop.run, name="specserve-engine", daemon=True)
        else:
            self._thread = threading.Thread(target=self._supervise, name="specserve-engine-io", daemon=True)
        self._thread.start()

    def shutdown(self) -> None:
        self._stopping = True  # the loop's end that follows is asked for, not a death
        self._commands.put(("stop", None))
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None
        if self._process is not None:
            self._process.join(timeout=30)
            if self._process.is_alive():
                self._process.terminate()

    @property
    def dead(self) -> str | None:
        """Why the step loop can take no more requests, if it died; else None (a loop not started yet
        starts with the first request)."""
        if self._died is not None:
            return self._died
        if self._process is not None and not self._process.is_alive():
            return f"the engine process exited ({self._process.exitcode})"
        thread = self._thread
        if thread is not None and not thread.is_alive():
            return "the engine loop is not running"
        return None

    def health_problem(self) -> str | None:
        """None while the step loop is alive and advancing; else what is wrong (for /health)."""
        dead = self.dead
        if dead is not None:
            return dead
        stalled = time.monotonic() - self._heartbeat
        if self._thread is not None and stalled > self.stall_timeout:
            return f"the engine loop has not advanced for {stalled:.0f} s (a step is hung)"
        return None

    # ---- state, as of the engine's last step ---------------------------------------------------------
    @property
    def num_requests(self) -> int:
        return len(self._streams)

    @property
    def num_running(self) -> int:
        """Requests holding a batch slot."""
        return self.gauges.num_running

    @property
    def num_waiting(self) -> int:
        """Requests not yet admitted: queued in the scheduler, or sent and not yet picked up by the loop."""
        return max(0, self.num_requests - self.num_running)

    @property
    def kv_usage(self) -> float:
        return self.gauges.kv_usage

    @property
    def cost_model_error(self) -> float | None:
        return self.gauges.cost_model_error

    @property
    def calibration_error(self) -> float | None:
        return self.gauges.calibration_error

    @property
    def drafting_cost_factor(self) -> float | None:
        return self.gauges.drafting_cost_factor

    @property
    def draft_names(self) -> list[str]:
        return self.info.draft_names

    @property
    def policy_name(self) -> str | None:
        return self.info.policy_name

    @property
    def max_model_len(self) -> int:
        return self.info.max_model_len

    def prepare(self, prompt: str | list[int], params: SamplingParams) -> list[int]:
        """Tokenize and validate a request (raises InvalidRequestError); safe from any thread."""
        return self.inputs.prepare(prompt, params)

    # ---- requests -------------------------------------------------------------------------------
    async def generate(self, prompt: str | list[int], params: SamplingParams,
                       request_id: str | None = None, prepared: bool = False) -> AsyncIterator[RequestOutput]:
        """Yields outputs as tokens are committed; the last one has `finished=True`. Closing or
        cancelling the iterator aborts the request and frees its KV cache. `prepared`: `prompt` is the token
        ids `prepare` returned for these params (the server prepares each request once, and compiles its
        grammar once, before admitting it)."""
        self.start()
        request_id = request_id or f"req-{next(self._ids)}"
        ids = list(prompt) if prepared else self.prepare(prompt, params)  # raises InvalidRequestError here
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), stream)
        if self.dead is not None:  # checked after registering: a dying loop fails every stream it sees
            self._streams.pop(request_id, None)
            raise EngineDeadError(self.dead)
        self._commands.put(("add", (prompt, params, request_id, time.monotonic(), ids)))
        finished = False
        try:
            while True:
                out = await stream.get()
                if isinstance(out, BaseException):
                    raise out
                finished = out.finished
                yield out
                if finished:
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    # ---- messages from the loop, and supervision of its process ------------------------------------------
    def _supervise(self) -> None:
        while self._relay() and self._restart():
            pass

    def _relay(self) -> bool:
        """Hands the engine process's messages on until it dies (killing it if a step hangs). Returns whether
        the death was unasked for."""
        while True:
            try:
                message = self._messages.get(timeout=1.0)
            except queue.Empty:
                if not self._process.is_alive():
                    message = ("died", f"the engine process exited ({self._process.exitcode})")
                elif not self._stopping and time.monotonic() - self._heartbeat > self.stall_timeout:
                    self._process.kill()  # a hung step never ends: only a new process serves again
                    self._process.join(timeout=10)
                    message = ("died", f"the engine process hung (no step ended for {self.stall_timeout:g} s) "
                                       "and was killed")
                else:
                    continue
            except (EOFError, OSError):
                message = ("died", "the engine process is gone")
            if message[0] == "heartbeat" and not self._process.is_alive():
                message = ("died", f"the engine process exited ({self._process.exitcode})")
            self._receive(message)
            if message[0] == "died":
                return not self._stopping

    def _restart(self) -> bool:
        """Starts a new engine process after a death, unless that makes a crash loop (then `fatal`)."""
        while not self._stopping:  # (a shutdown during a restart: no new process)
            now = time.monotonic()
            self._deaths = [t for t in self._deaths if now - t < RESTART_WINDOW_S] + [now]
            if len(self._deaths) > self.max_restarts:
                self.fatal = self._died if not self.max_restarts else (
                    f"{self._died}; {len(self._deaths)} engine deaths within {RESTART_WINDOW_S:g} s, "
                    f"more than --engine-restarts {self.max_restarts}")
                log.critical("%s: giving up, the server exits", self.fatal)
                return False
            self.restarting = self._died
            self._died = f"the engine is restarting after: {self.restarting}"
            log.error("starting a new engine process (restart %d)", self.restarts + 1)
            time.sleep(min(30.0, 2.0 ** (len(self._deaths) - 1) - 1))  # 0, 1, 3, 7 ... s: a crash loop slows
            process, commands, messages = start_engine_process(self.config)
            try:
                self._wait_ready(process, messages)
            except SpecServeError as e:
                self._died = f"a new engine process failed to start: {e}"
                log.error(self._died)
                continue
            self._commands.cancel_join_thread()  # the dead process's queue: nothing may wait on it at exit
            self._process, self._commands, self._messages = process, commands, messages
            self.restarts += 1
            self._heartbeat = time.monotonic()
            self._died = self.restarting = None
            log.info("engine process %d serving again (restart %d)", process.pid, self.restarts)
            for listener in self.restart_listeners:
                listener(self.restarts)
            return True
        return False

    def _receive(self, message) -> None:
        self._heartbeat = time.monotonic()
        kind = message[0]
        if kind == "step":
            _, outputs, stats, self.gauges = message
            for listener in self.step_listeners:
                listener(stats)
            for out in outputs:
                for listener in self.output_listeners:
                    listener(out)
                self._deliver(out.request_id, out)
        elif kind == "failed":
            self._deliver(message[1], message[2])
        elif kind == "died":
            self._died = message[1]
            if self._stopping:
                log.info("engine stopped: %s", self._died)
            elif self._process is not None:
                log.error("%s; failing the %d request(s) in flight", self._died, len(self._streams))
            else:
                log.critical("%s; /health now fails", self._died)
            for rid in list(self._streams):
                self._deliver(rid, EngineDeadError(self._died))

    def _deliver(self, request_id: str, item) -> None:
        target = self._streams.get(request_id)
        if target is not None:
            loop, stream = target
            loop.call_soon_threadsafe(stream.put_nowait, item)
