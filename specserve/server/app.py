"""The FastAPI app: OpenAI routes, vLLM's /tokenize, /detokenize and /version, /health, /metrics,
/openapi.json, API-key check, request body limits, queue limit and drain gate."""
from __future__ import annotations

import asyncio
import hmac
import logging
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from specserve.engine.async_engine import AsyncLLMEngine
from specserve.server import generation_config, limits
from specserve.server.errors import APIError, error_response, install_error_handlers
from specserve.server.metrics import ServerMetrics
from specserve import __version__
from specserve.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, SamplingDefaults,
                                       TokenizeRequest)
from specserve.server.serving import Serving

GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
TOKENIZER_PATHS = ("/tokenize", "/detokenize")  # vLLM's, outside /v1 but behind the API key as well


@dataclass
class ServingState:
    in_flight: int = 0      # generation requests inside the app, streams included until their last byte
    draining: bool = False  # set on SIGTERM: refuse new generation requests, let the others finish
    active: set[str] = field(default_factory=set)  # engine request ids being served


class _Gate:
    """Pure ASGI middleware, so that it sees a streaming response through to its end (a FastAPI
    dependency returns before the stream is sent): API key on /v1 and the tokenizer routes, body size and
    read-time limits, refusal while draining, in-flight count. A generation request's body is read here,
    whole and within the limits, before it counts as in flight: a slow or huge upload holds no queue slot."""

    def __init__(self, app, state: ServingState, api_key: str | None, max_request_bytes: int,
                 timeout_read: float):
        self.app, self.state, self.api_key = app, state, api_key
        self.max_request_bytes, self.timeout_read = max_request_bytes, timeout_read

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope["path"]
        keyed = path.startswith("/v1") or path in TOKENIZER_PATHS
        if self.api_key is not None and keyed and not self._authorized(scope):
            return await error_response(401, "Incorrect or missing API key: send `Authorization: Bearer <key>`",
                                        code="invalid_api_key",
                                        headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
        if self._declared_length(scope) > self.max_request_bytes:
            return await self._too_large()(scope, receive, send)
        generation = path in GENERATION_PATHS
        if not (scope["method"] == "POST" and (generation or path in TOKENIZER_PATHS)):
            return await self.app(scope, receive, send)
        if generation and self.state.draining:
            return await error_response(503, "the server is shutting down and takes no new requests",
                                        headers={"Connection": "close"})(scope, receive, send)
        try:
            body = await limits.read_body(receive, self.max_request_bytes, self.timeout_read)
        except limits.BodyTooLarge:
            return await self._too_large()(scope, receive, send)
        except limits.BodyTimeout:
            return await error_response(408, f"the request body did not arrive within {self.timeout_read:g} s",
                                        code="request_timeout", headers={"Connection": "close"})(scope, receive, send)
        except limits.ClientGone:
            return
        if not generation:
            return await self.app(scope, limits.replay(body, receive), send)
        self.state.in_flight += 1
        try:
            await self.app(scope, limits.replay(body, receive), send)
        finally:
            self.state.in_flight -= 1

    def _too_large(self):
        return error_response(413, f"the request body is larger than this server's limit of {self.max_request_bytes} "
                                   "bytes (--max-request-bytes)", code="request_too_large",
                              headers={"Connection": "close"})

    @staticmethod
    def _declared_length(scope) -> int:
        for name, value in scope["headers"]:
            if name == b"content-length":
                try:
                    return int(value)
                except ValueError:
                    return 0  # h11 refuses a malformed Content-Length before we see it
        return 0

    def _authorized(self, scope) -> bool:
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(),
                                                                          self.api_key.encode())
        return False


def build_app(engine: AsyncLLMEngine, served_model_names: str | list[str], api_key: str | None = None,
              max_queue: int | None = None, max_request_bytes: int = limits.DEFAULT_MAX_REQUEST_BYTES,
              timeout_read: float = limits.DEFAULT_TIMEOUT_READ_S,
              sampling_defaults: SamplingDefaults | None = None, tool_call_parser: str = "auto") -> FastAPI:
    """`max_queue`: requests allowed to wait beyond the `max_num_seqs` that run; more get 429 (None: no limit).
    `max_request_bytes`: larger bodies get 413. `timeout_read`: seconds a body may take to arrive (408).
    `sampling_defaults`: for fields a request omits; None: the model's own (--generation-config auto).
    `tool_call_parser`: how tool calls are read out of replies (server/tool_parsers.py)."""
    if sampling_defaults is None:
        sampling_defaults, why = generation_config.resolve("auto", engine.info.config.model)
        logging.getLogger("specserve.server").info(why)
    names = [served_model_names] if isinstance(served_model_names, str) else list(served_model_names)
    state = ServingState()
    metrics = ServerMetrics(engine, names[0])
    capacity = None if max_queue is None else engine.info.config.max_num_seqs + max_queue
    created = int(time.time())

    def admit() -> None:
        dead = engine.dead
        if dead is not None:
            raise APIError(503, f"the server cannot take requests: {dead}", code="engine_dead")
        if capacity is not None and state.in_flight > capacity:
            raise APIError(429, f"the server's queue is full ({capacity} requests in flight); retry later",
                           code="queue_full")

    serving = Serving(engine, names, admit, state.active, sampling_defaults, tool_call_parser)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        yield
        engine.shutdown()

    app = FastAPI(title="specserve", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url="/openapi.json")
    app.state.serving = state
    app.state.metrics = metrics
    install_error_handlers(app)
    app.add_middleware(_Gate, state=state, api_key=api_key, max_request_bytes=max_request_bytes,
                       timeout_read=timeout_read)

    def model_card(name: str) -> dict:
        return {"id": name, "object": "model", "created": created, "owned_by": "specserve",
                "root": engine.info.config.model, "max_model_len": engine.max_model_len}

    @app.get("/health")
    async def health():
        """200 while the server takes requests; 503 while draining, while a new engine process starts after
        the engine died or hung (`restarting`), or when it is dead or hung (its heartbeat is older than
        --engine-stall-timeout)."""
        if state.draining:
            return error_response(503, "draining")
        if engine.restarting is not None:
            return error_response(503, f"restarting: the engine died ({engine.restarting})", code="engine_restarting")
        problem = engine.health_problem()
        if problem is not None:
            return error_response(503, problem, code="engine_unhealthy")
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(n) for n in names]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        serving.check_model(name)
        return model_card(name)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, raw: Request):
        return await serving.completion(req, raw)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, raw: Request):
        return await serving.chat(req, raw)

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        return await serving.tokenize(req)

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        return await asyncio.to_thread(serving.detokenize, req)

    @app.get("/version")
    async def version():
        return {"version": __version__}

    return app
