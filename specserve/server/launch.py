"""Run the app under uvicorn on a socket we bind ourselves, with a graceful drain on SIGTERM.

Binding first lets `--port 0` pick a free port that the startup line can name, and lets a taken port
fail before the model loads. uvicorn on its own stops listening at SIGTERM and then re-raises the signal
once it has shut down (exit status 143); `DrainingServer` instead keeps answering (503 to new generation
requests, so a load balancer moves on), lets in-flight requests finish up to the drain timeout, and exits 0.

uvicorn closes idle keep-alive connections (`timeout_keep_alive`) but waits forever for the headers of a
request: a client that opens a connection and sends nothing, or half a request line, holds it
indefinitely (slowloris). `timed_protocol` closes a connection whose request headers have not all
arrived `timeout_read` seconds after it opened or after its previous response; the app bounds the time
the body may take (app._Gate).
"""
from __future__ import annotations

import logging
import socket
import time
from typing import TYPE_CHECKING

import uvicorn
from uvicorn.protocols.http.auto import AutoHTTPProtocol

from specserve.errors import SpecServeError

if TYPE_CHECKING:  # both pull in torch; `bind` must be quick so a taken port fails at once
    from specserve.engine.async_engine import AsyncLLMEngine
    from specserve.server.app import ServingState

log = logging.getLogger("specserve.server")


def bind(host: str, port: int) -> socket.socket:
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
    except OSError as e:
        raise SpecServeError(f"cannot listen on {host}:{port}: {e}") from None
    return sock


def describe(engine: AsyncLLMEngine, url: str) -> str:
    info = engine.info
    cfg, spec = info.config, info.config.speculative_config
    if spec is None:
        draft = "none"
    else:
        model = "+".join(spec.model) if isinstance(spec.model, list) else spec.model
        draft = (f"{model if spec.method == 'draft_model' else spec.method} (k={spec.num_speculative_tokens}) | "
                 f"policy {spec.policy}")
    kv = info.num_kv_blocks * cfg.block_size
    weights = f"{cfg.device} {cfg.dtype}" + (f", {cfg.quantization} weights" if cfg.quantization else "")
    return (f"specserve serving {url}/v1 | model {cfg.model} | {weights} | draft {draft} | "
            f"KV cache {kv} tokens ({info.num_kv_blocks} blocks) | max_model_len {info.max_model_len} | "
            f"max_num_seqs {cfg.max_num_seqs}")


class _HeaderTimeout:
    """Mixed into uvicorn's HTTP protocol (httptools or h11, whichever uvicorn picks): close a connection
    whose request headers are not all in `header_timeout` seconds after it opened or after its previous
    response. Both protocols make a new `cycle` once a request's headers are complete."""
    header_timeout: float = 15.0

    def connection_made(self, transport) -> None:
        self._header_timer = None
        super().connection_made(transport)
        self._arm()

    def _arm(self) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(self.header_timeout, self._headers_late)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def data_received(self, data: bytes) -> None:
        cycle = self.cycle
        super().data_received(data)
        if self.cycle is not cycle:  # a new request's headers are in
            self._disarm()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.cycle is None or self.cycle.response_complete:  # no pipelined request already under way
            self._arm()

    def connection_lost(self, exc) -> None:
        self._disarm()
        super().connection_lost(exc)

    def _headers_late(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self.transport.close()


def timed_protocol(header_timeout: float) -> type:
    """uvicorn's own choice of HTTP protocol, with a header-read timeout."""
    return type("TimedHTTPProtocol", (_HeaderTimeout, AutoHTTPProtocol), {"header_timeout": header_timeout})


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, state: ServingState, engine: AsyncLLMEngine, drain_timeout: float):
        super().__init__(config)
        self.state, self.engine, self.drain_timeout = state, engine, drain_timeout
        self._deadline: float | None = None
        self._announced = False
        self._in_flight_at_signal = 0

    def handle_exit(self, sig, frame) -> None:
        # A signal handler: only set flags here (logging could deadlock on a lock the interrupted code holds).
        if self._deadline is None:
            self.state.draining = True
            self._deadline = time.monotonic() + self.drain_timeout
            self._in_flight_at_signal = self.state.in_flight  # logged at the next tick, which may come later
        else:  # a second signal: stop now, without waiting for anyone
            self.should_exit = self.force_exit = True

    async def on_tick(self, counter: int) -> bool:
        if self.engine.fatal is not None and not self.should_exit:
            self.should_exit = True  # the engine died for good (a crash loop): exit non-zero (see run)
        if self._deadline is not None and not self.should_exit:
            if not self._announced:
                self._announced = True
                log.info("draining: %d request(s) in flight, up to %g s; new requests get 503",
                         self._in_flight_at_signal, self.drain_timeout)
            if self.state.in_flight == 0:
                self.should_exit = True
            elif time.monotonic() >= self._deadline:
                # Aborting in the engine ends each response properly (a 503 body, or an error event
                # before [DONE]), so clients learn why; uvicorn would just cut the connections.
                log.warning("drain timeout: aborting %d request(s) still in flight", self.state.in_flight)
                for rid in list(self.state.active):
                    self.engine.abort(rid)
                self.should_exit = True
        return await super().on_tick(counter)


def run(app, engine: AsyncLLMEngine, sock: socket.socket, drain_timeout: float, access_log: bool,
        timeout_keep_alive: float = 5, timeout_read: float = 15.0) -> None:
    host, port = sock.getsockname()[:2]
    sock.listen(2048)  # from here connections queue until the loop accepts them, none are refused
    log.info(describe(engine, f"http://{f'[{host}]' if ':' in host else host}:{port}"))
    # After a timed-out drain, uvicorn cuts whatever is still open one second later.
    config = uvicorn.Config(app, lifespan="on", access_log=access_log, timeout_graceful_shutdown=1,
                            log_level="info", http=timed_protocol(timeout_read),
                            timeout_keep_alive=timeout_keep_alive)
    DrainingServer(config, app.state.serving, engine, drain_timeout).run(sockets=[sock])
    if engine.fatal is not None:
        raise SpecServeError(f"the engine died and was not restarted: {engine.fatal}")
