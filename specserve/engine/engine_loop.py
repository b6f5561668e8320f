"""The engine's step loop, wherever the engine lives: a thread of the server process, or a process of its own
(engine/async_engine.py chooses). It takes commands, steps while there is work, and emits messages:

    ("ready", EngineInfo)                  once, first (or ("died", ...) when the engine cannot be built)
    ("step", outputs, stats, gauges)       after every step
    ("failed", request_id, exception)      a request that could not be added, or a failed step's suspect
    ("heartbeat", monotonic time)          while idle, at least every IDLE_WAIT_S
    ("died", message)                      the loop itself broke; nothing follows

A request can only fail itself: an exception while adding it goes to that request. A step that fails is
retried once without its newest request, the others recomputed from their tokens (a failed step may have
left draft caches half-written); if the next step fails too, everything in flight fails.

A test hook: a loop whose `pace_s` is x sleeps x s after every step, so a request of n tokens takes at least
n*x/(k+1) s on any machine and a test can act while it provably still runs. Tests set it through the
environment of the server they start (SPECSERVE_TEST_STEP_PACE_S, read once by specserve/settings.py).
"""
from __future__ import annotations

import logging
import multiprocessing
import os
import queue
import time
from dataclasses import dataclass

from specserve.errors import SpecServeError
from specserve.settings import settings

log = logging.getLogger("specserve.engine")

IDLE_WAIT_S = 0.5  # the longest the loop waits for a command, between heartbeats, while there is nothing to do


class EngineDeadError(RuntimeError):
    pass


@dataclass(slots=True)
class Gauges:
    """The engine's state after a step, for /metrics and admission."""
    num_running: int
    kv_usage: float
    cost_model_error: float | None
    calibration_error: float | None
    drafting_cost_factor: float | None = None  # predictors.DraftingError.factor (None without a cost model)


class EngineLoop:
    def __init__(self, engine, commands, emit):
        """commands: a queue of (kind, arg); emit(message) sends one message to the client."""
        self.engine, self.commands, self.emit = engine, commands, emit
        self.stopped = False
        self._recovering = False  # the last step failed and its suspect was removed
        self.pace_s = settings.test_step_pace_s  # tests only (see above); 0: no pause

    def run(self) -> None:
        try:
            self.emit(("ready", self.engine.info()))
            while not self.stopped:
                self._take_commands(wait=not self.engine.has_unfinished())
                if self.stopped or not self.engine.has_unfinished():
                    continue
                try:
                    outputs = self.engine.step()
                except Exception as e:  # a bug must not hang clients: fail as little as possible, keep serving
                    log.exception("engine step failed")
                    self._recover(e)
                    continue
                self._recovering = False
                self.emit(("step", outputs, self.engine.last_stats, self.gauges()))
                if self.pace_s:
                    time.sleep(self.pace_s)
        except BaseException as e:  # a bug outside the step guard: say so everywhere rather than hang
            log.critical("the engine loop died", exc_info=e)
            self.emit(("died", f"the engine loop died: {type(e).__name__}: {e}"))

    def gauges(self) -> Gauges:
        engine, models = self.engine, self.engine.models
        cost = models.cost.relative_error if models.has_cost and models.cost.observed else None
        return Gauges(engine.num_running, engine.kv_usage, cost, models.acceptance.calibration_error,
                      models.drafting.factor if models.has_cost else None)

    def _take_commands(self, wait: bool) -> None:
        """Every queued command; when idle, wait for one (a heartbeat if none comes)."""
        while True:
            try:
                kind, arg = self.commands.get(timeout=IDLE_WAIT_S) if wait else self.commands.get_nowait()
            except queue.Empty:
                if wait:
                    self.emit(("heartbeat", time.monotonic()))
                return
            wait = False
            self._command(kind, arg)

    def _command(self, kind: str, arg) -> None:
        engine = self.engine
        if kind == "stop":
            self.stopped = True
        elif kind == "add":
            prompt, params, rid, arrival, ids = arg
            try:
                engine.add_request(prompt, params, rid, arrival, prompt_token_ids=ids)
            except Exception as e:
                log.warning("request %s could not be added: %s: %s", rid, type(e).__name__, e)
                if rid in engine.requests:  # half added: take it out again
                    engine.abort(rid)
                self.emit(("failed", rid, e))
        else:
            try:
                engine.abort(arg)
            except Exception:
                log.exception("aborting request %s failed", arg)

    def _recover(self, error: Exception) -> None:
        engine = self.engine
        suspect = engine.newest_running()
        if suspect is not None and not self._recovering:
            self._recovering, failed = True, [suspect]
            engine.recompute_all()
        else:
            failed = list(engine.requests)
        for rid in failed:
            engine.abort(rid)  # its abort output comes with the next step, after the error below
            self.emit(("failed", rid, EngineDeadError(f"engine step failed: {error}")))


def run_engine_process(config, commands, messages) -> None:
    """The entry point of the engine's own process: build the engine, then loop until told to stop."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl+C is the server's to handle (it drains, then stops us)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s %(name)s: %(message)s")

    parent = os.getppid()

    def emit(message) -> None:
        if os.getppid() != parent:  # the server is gone (killed): nobody reads us, stop
            os._exit(0)
        if message[0] == "failed" and not isinstance(message[2], (SpecServeError, EngineDeadError)):
            # Exceptions cross the process boundary pickled; an arbitrary one may not pickle.
            message = ("failed", message[1], EngineDeadError(f"{type(message[2]).__name__}: {message[2]}"))
        messages.put(message)

    start = time.perf_counter()
    try:
        from specserve.engine.llm_engine import LLMEngine
        if isinstance(config, dict):  # EngineConfig's arguments, resolved here (start_engine_process)
            from specserve.engine.config import EngineConfig
            config = EngineConfig(**config)
        imported = time.perf_counter()
        engine = LLMEngine(config)
    except BaseException as e:
        emit(("died", str(e) if isinstance(e, SpecServeError) else f"{type(e).__name__}: {e}"))
        return
    log.info("engine process %d ready: imports %.2f s, engine %.2f s", os.getpid(), imported - start,
             time.perf_counter() - imported)
    EngineLoop(engine, commands, emit).run()


def start_engine_process(config):
    """(process, commands queue, messages queue) of a new engine process (spawned: no fork of torch state).
    `config`: an EngineConfig, or its arguments (a dict), which the process resolves itself: then the caller
    need not import torch before the process starts."""
    ctx = multiprocessing.get_context("spawn")
    commands, messages = ctx.Queue(), ctx.Queue()
    process = ctx.Process(target=run_engine_process, args=(config, commands, messages), name="specserve-engine",
                          daemon=True)
    process.start()
    return process, commands, messages
