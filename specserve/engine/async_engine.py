"""AsyncLLMEngine: the engine's step loop on a background thread, one async output stream per request.

torch releases the GIL inside its kernels, so the asyncio loop (HTTP handling, streaming) stays
responsive while a step runs. All engine state is touched only by the step thread; callers talk to it
through a command queue, and outputs come back through `loop.call_soon_threadsafe`.

A request that cannot be added (a bad seed that slipped past validation, anything) fails alone: the
exception goes to that request's stream and the loop goes on. A step that fails is retried once without
its newest request (`_recover`) before anything else in flight is failed. The loop's liveness is observable: it
stamps a heartbeat on every iteration (at least every 0.5 s when idle), and `health_problem()` names a
loop that died or whose current iteration has run longer than `stall_timeout` (a hung step).
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
from specserve.engine.llm_engine import LLMEngine
from specserve.engine.outputs import RequestOutput, StepStats
from specserve.engine.sampling_params import SamplingParams

log = logging.getLogger("specserve.engine")


class EngineDeadError(RuntimeError):
    pass


IDLE_WAIT_S = 0.5  # the longest the loop sleeps between heartbeats while there is nothing to do
DEFAULT_STALL_TIMEOUT_S = 60.0


class AsyncLLMEngine:
    def __init__(self, config: EngineConfig | None = None, engine: LLMEngine | None = None,
                 stall_timeout: float = DEFAULT_STALL_TIMEOUT_S):
        self.engine = engine or LLMEngine(config or EngineConfig())
        self.tokenizer = self.engine.tokenizer
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._ids = itertools.count()
        self._stop = False
        self._thread: threading.Thread | None = None
        self.step_listeners: list[Callable[[StepStats], None]] = []  # called on the step thread
        self.output_listeners: list[Callable[[RequestOutput], None]] = []
        self.stall_timeout = stall_timeout
        self._heartbeat = time.monotonic()  # when the loop last began an iteration
        self._died: BaseException | None = None  # what ended the loop, if something did
        self._recovering = False  # the last step failed and its suspect was removed

    # ---- lifecycle ----------------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="specserve-engine", daemon=True)
            self._thread.start()

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    @property
    def dead(self) -> str | None:
        """Why the step loop can take no more requests, if it died; else None (a loop not started yet
        starts with the first request)."""
        if self._died is not None:
            return f"the engine loop died: {type(self._died).__name__}: {self._died}"
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
        if stalled > self.stall_timeout:
            return f"the engine loop has not advanced for {stalled:.0f} s (a step is hung)"
        return None

    @property
    def num_requests(self) -> int:
        return len(self._streams)

    # Read from the event loop while the step thread runs: each is one read of state the step thread
    # owns, atomic under the GIL, so a scrape sees a consistent (if momentary) value.
    @property
    def num_running(self) -> int:
        """Requests holding a batch slot."""
        return self.engine.num_running

    @property
    def kv_usage(self) -> float:
        return self.engine.kv_usage

    @property
    def draft_names(self) -> list[str]:
        return self.engine.draft_names

    @property
    def policy_name(self) -> str | None:
        return self.engine.policy.name if self.engine.policy is not None else None

    @property
    def cost_model_error(self) -> float | None:
        models = self.engine.models
        return models.cost.relative_error if models.has_cost and models.cost.observed else None

    @property
    def calibration_error(self) -> float | None:
        return self.engine.models.acceptance.calibration_error

    @property
    def num_waiting(self) -> int:
        """Requests not yet admitted: queued in the scheduler, or sent and not yet picked up by the step thread."""
        return max(0, self.num_requests - self.num_running)

    # ---- requests -------------------------------------------------------------------------------
    async def generate(self, prompt: str | list[int], params: SamplingParams,
                       request_id: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yields outputs as tokens are committed; the last one has `finished=True`. Closing or
        cancelling the iterator aborts the request and frees its KV cache."""
        self.start()
        request_id = request_id or f"req-{next(self._ids)}"
        ids = self.engine.prepare(prompt, params)  # raises InvalidRequestError here, in the caller
        stream: asyncio.Queue = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), stream)
        if self._died is not None:  # checked after registering: a dying loop fails every stream it sees
            self._streams.pop(request_id, None)
            raise EngineDeadError(self.dead)
        self._commands.put(("add", (prompt, params, request_id, time.monotonic(), ids)))
        self._wake.set()
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
        self._wake.set()

    # ---- the step thread ------------------------------------------------------------------------
    def _loop(self) -> None:
        try:
            self._run()
        except BaseException as e:  # a bug outside the step guard: say so everywhere rather than hang
            self._died = e
            log.critical("the engine loop died; /health now fails", exc_info=e)
            for rid in list(self._streams):
                self._deliver(rid, EngineDeadError(f"the engine loop died: {e}"))

    def _command(self, kind: str, arg) -> None:
        """One command from the event loop. A failure belongs to that request alone: its stream gets the
        exception (InvalidRequestError becomes a 400, anything else a 500) and the loop goes on."""
        engine = self.engine
        if kind == "add":
            prompt, params, rid, arrival, ids = arg
            if rid not in self._streams:  # already cancelled by its caller
                return
            try:
                engine.add_request(prompt, params, rid, arrival, prompt_token_ids=ids)
            except Exception as e:
                log.warning("request %s could not be added: %s: %s", rid, type(e).__name__, e)
                if rid in engine.requests:  # half added: take it out again
                    engine.abort(rid)
                self._deliver(rid, e)
        else:
            try:
                engine.abort(arg)
            except Exception:
                log.exception("aborting request %s failed", arg)

    def _run(self) -> None:
        engine = self.engine
        while not self._stop:
            self._heartbeat = time.monotonic()
            while True:
                try:
                    kind, arg = self._commands.get_nowait()
                except queue.Empty:
                    break
                self._command(kind, arg)
            if not engine.has_unfinished():
                self._wake.wait(timeout=IDLE_WAIT_S)
                self._wake.clear()
                continue
            try:
                outputs = engine.step()
            except Exception as e:  # a bug must not hang clients: fail as little as possible, keep serving
                log.exception("engine step failed")
                self._recover(e)
                continue
            self._recovering = False
            for listener in self.step_listeners:
                listener(engine.last_stats)
            for out in outputs:
                for listener in self.output_listeners:
                    listener(out)
                self._deliver(out.request_id, out)

    def _recover(self, error: Exception) -> None:
        """After a failed step. The newest request of the batch is the suspect (new traffic is what changed):
        the first time, only it fails, and the others are recomputed from their tokens (a failed step may
        have left draft caches half-written) and go on. If the next step fails too, the fault was not the
        suspect's: everything in flight fails."""
        engine = self.engine
        suspect = engine.newest_running()
        if suspect is not None and not self._recovering:
            self._recovering, failed = True, [suspect]
            engine.recompute_all()
        else:
            failed = list(engine.requests)
        for rid in failed:
            engine.abort(rid)  # its abort output comes with the next step, after the error below
            self._deliver(rid, EngineDeadError(f"engine step failed: {error}"))

    def _deliver(self, request_id: str, item) -> None:
        target = self._streams.get(request_id)
        if target is not None:
            loop, stream = target
            loop.call_soon_threadsafe(stream.put_nowait, item)
