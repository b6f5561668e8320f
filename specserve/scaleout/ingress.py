"""The one HTTP entry point: forwards each OpenAI request to an engine replica chosen by the request
router, retries elsewhere when its replica dies or is full before answering, and answers /health and
/metrics for all replicas together.

`Ingress.api()` is its FastAPI app. Two front ends serve it (docs/scaleout.md, "The HTTP front"):
`specserve serve --replicas N` runs it in its own process under uvicorn, calling the replicas through a
deployment handle (one Ray hop per request and per streamed piece); `OpenAIIngress` is the same as a Ray
Serve ingress deployment behind Ray's HTTP proxy (two Ray hops), what a Serve config file deploys.

It loads no model and imports no torch: it reads the request body only for routing hints (hints.py).
Non-streaming responses are buffered whole, so a replica that dies before finishing is retried on
another. A stream whose replica dies after sending tokens cannot be resumed elsewhere; it ends with an
OpenAI error event and `[DONE]`, which the official client raises as an APIError, instead of hanging.

Ray pickles `OpenAIIngress` by value (serve.ingress makes a new class), with copies of the globals its
methods use: so no `from __future__ import annotations` (FastAPI must see `Request` itself, not a name it
can no longer resolve), and the book the router writes is reached through its module (`book.BOOK`),
which is pickled by reference, never as a copied global.
"""
import asyncio
import contextvars
import json
import logging

import prometheus_client
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from ray import serve
from ray.exceptions import RayActorError

from specserve.scaleout import book
from specserve.scaleout.hints import RouteHints, hints_from_body, new_key, pinned
from specserve.scaleout.prometheus_merge import merge
from specserve.scaleout.settings import ScaleoutSettings

log = logging.getLogger("specserve.scaleout")

# A replica that died (ActorDiedError) or cannot be reached (ActorUnavailableError): worth another replica.
REPLICA_GONE = (RayActorError,)
DROPPED_HEADERS = {b"host", b"content-length", b"connection", b"transfer-encoding", b"keep-alive"}
FAN_OUT_TIMEOUT_S = 5.0
REPLICA_HEADER = "x-specserve-replica"
P = "specserve:scaleout_"


def error_body(status: int, message: str, code: str | None = None) -> dict:
    # The single-process server's shape (server/errors.py), without importing it (it pulls in torch).
    kind = {413: "invalid_request_error", 429: "rate_limit_exceeded", 503: "service_unavailable"}.get(
        status, "internal_server_error")
    return {"error": {"message": message, "type": kind, "param": None, "code": code}}


async def read_body(request: Request, limit: int) -> bytes | None:
    """The body, or None once it is larger than `limit`: the ingress buffers it, so it must not take more
    than a replica would (--max-request-bytes, server/limits.py)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        return None
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


def _sse(payload: dict | str) -> bytes:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n".encode()


def _response_headers(head: dict) -> dict[str, str]:
    headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in head["headers"]
               if k.lower() not in DROPPED_HEADERS}
    headers[REPLICA_HEADER] = head.get("replica", "")  # which replica answered: for logs, tests, affinity checks
    return headers


def _is_stream(head: dict) -> bool:
    return any(k.lower() == b"content-type" and v.startswith(b"text/event-stream") for k, v in head["headers"])


class _BookCollector:
    """What the router did, per replica, read from the shared book at scrape time."""

    def __init__(self, router: str):
        self.router = router

    def collect(self):
        routed = CounterMetricFamily(P + "requests_routed", "Requests the router sent to each replica",
                                     labels=["replica", "router"])
        for replica, n in sorted(book.BOOK.routed_counts().items()):
            routed.add_metric([replica, self.router], n)
        in_flight = GaugeMetricFamily(P + "router_in_flight", "Requests the router has in flight on each "
                                      "replica", labels=["replica"])
        for replica, n in sorted(book.BOOK.in_flight().items()):
            in_flight.add_metric([replica], n)
        replicas = GaugeMetricFamily(P + "replicas", "Replicas the router can send to")
        replicas.add_metric([], len(book.BOOK.replicas()))
        return [routed, in_flight, replicas]


class Ingress:
    def __init__(self, engine, settings: dict):
        prometheus_client.disable_created_metrics()  # one `_created` series per counter is noise (server/cli.py)
        self.engine = engine  # DeploymentHandle of EngineReplica
        self.settings = ScaleoutSettings.from_dict(settings)
        self.registry = CollectorRegistry()
        self.registry.register(_BookCollector(self.settings.router))
        self.retries = Counter(P + "retries", "Requests sent again to another replica, by reason",
                               ["reason"], registry=self.registry)
        self.broken_streams = Counter(P + "broken_streams", "Streams ended with an error event because "
                                      "their replica died mid-stream", registry=self.registry)
        for reason in ("replica_died", "queue_full"):
            self.retries.labels(reason)

    # ---- fan-out ------------------------------------------------------------------------------
    async def _replicas(self) -> list[str]:
        """The replicas the router knows. The router starts with the first call through the handle and
        learns the replicas a moment later, so a first call may have to wait for it."""
        if not book.BOOK.replicas():
            try:
                await asyncio.wait_for(self.engine.health.remote(RouteHints(new_key())), FAN_OUT_TIMEOUT_S)
            except (asyncio.TimeoutError, *REPLICA_GONE):
                pass
            for _ in range(20):
                if book.BOOK.replicas():
                    break
                await asyncio.sleep(0.1)
        return book.BOOK.replicas()

    async def _pinned(self, method: str, replica: str):
        async def call():
            return await asyncio.wait_for(getattr(self.engine, method).remote(pinned(replica)), FAN_OUT_TIMEOUT_S)

        try:
            # Calls made inside one HTTP request share its Ray request id, and Ray's router hands a chosen
            # replica to the pending call with that id: concurrent calls to different replicas would swap
            # them. An empty context gives each call an id of its own.
            return await contextvars.Context().run(asyncio.ensure_future, call())  # a task copies the context
        except Exception as e:  # noqa: BLE001 - reported per replica, never fails the whole answer
            return e

    def api(self) -> FastAPI:
        app = FastAPI(title="specserve scale-out", docs_url=None, redoc_url=None, openapi_url=None)
        app.add_api_route("/health", self.health, methods=["GET"])
        app.add_api_route("/metrics", self.metrics, methods=["GET"])
        app.add_api_route("/v1/{rest:path}", self.forward, methods=["GET", "POST"])
        for path in ("/tokenize", "/detokenize", "/version"):  # vLLM's, answered by any replica
            app.add_api_route(path, self.forward, methods=["GET", "POST"])
        return app

    async def health(self):
        replicas = await self._replicas()
        answers = await asyncio.gather(*(self._pinned("health", r) for r in replicas))
        report = {r: a if isinstance(a, dict) else {"status": "unreachable", "error": f"{type(a).__name__}: {a}"}
                  for r, a in zip(replicas, answers)}
        ready = sum(a.get("status") == "ok" for a in report.values())
        body = {"status": "ok" if ready else "unavailable", "ready_replicas": ready,
                "replicas_configured": self.settings.replicas, "router": self.settings.router, "replicas": report}
        return JSONResponse(body, status_code=200 if ready else 503)

    async def metrics(self):
        replicas = await self._replicas()
        answers = await asyncio.gather(*(self._pinned("scrape", r) for r in replicas))
        texts = dict(a for a in answers if isinstance(a, tuple))
        return Response(merge(texts) + generate_latest(self.registry).decode(), media_type=CONTENT_TYPE_LATEST)

    # ---- the OpenAI API -----------------------------------------------------------------------
    async def forward(self, request: Request, rest: str = ""):
        body = await read_body(request, self.settings.max_request_bytes)
        if body is None:
            return JSONResponse(error_body(413, f"the request body is larger than this server's limit of "
                                                f"{self.settings.max_request_bytes} bytes (--max-request-bytes)",
                                           "request_too_large"), status_code=413, headers={"Connection": "close"})
        path = request.url.path
        hints = (hints_from_body(path, body, self.settings.session_fields) if request.method == "POST"
                 else RouteHints(new_key()))
        headers = [(k, v) for k, v in request.headers.raw if k.lower() not in DROPPED_HEADERS]
        query = request.url.query.encode()
        failure, full = "no attempt made", None
        for attempt in range(self.settings.max_retries + 1):
            stream = self.engine.options(stream=True).handle.remote(hints, request.method, path, query, headers, body)
            try:
                head = await stream.__anext__()
                if _is_stream(head):
                    return StreamingResponse(self._relay(stream), status_code=head["status"],
                                             headers=_response_headers(head))
                content = b"".join([item["body"] async for item in stream])
            except REPLICA_GONE as e:
                stream.cancel()
                failed = book.BOOK.replica_of(hints.key)
                failure = f"replica {failed or '?'} failed: {type(e).__name__}"
                log.warning("request %s: %s; %s", hints.key, failure,
                            "retrying on another replica" if attempt < self.settings.max_retries else "giving up")
                self.retries.labels("replica_died").inc()
                hints = hints.retry(failed)
                continue
            except BaseException:  # the client left (cancellation) or a bug: stop the replica's work
                stream.cancel()
                raise
            response = Response(content, status_code=head["status"], headers=_response_headers(head))
            if head["status"] != 429 or len(book.BOOK.replicas()) < 2:
                return response
            # That replica's queue is full (--max-queue): another one may have room.
            full = response
            if attempt < self.settings.max_retries:
                self.retries.labels("queue_full").inc()
                hints = hints.retry(head.get("replica"))
        if full is not None:
            return full
        return JSONResponse(error_body(503, f"no replica could serve the request after "
                                            f"{self.settings.max_retries + 1} attempts ({failure})"),
                            status_code=503)

    async def _relay(self, stream):
        try:
            async for item in stream:
                yield item["body"]
        except REPLICA_GONE as e:
            self.broken_streams.inc()
            log.warning("a stream's replica died mid-stream (%s): ending it with an error event", type(e).__name__)
            yield _sse(error_body(503, "the replica serving this stream stopped before it finished; "
                                       "retry the request", "replica_failed"))
            yield _sse("[DONE]")
        finally:
            stream.cancel()  # no-op after the end; when the client left, stops the replica's request


@serve.ingress()
class OpenAIIngress(Ingress):
    """The ingress as a Ray Serve deployment, behind Ray's HTTP proxy (app.py)."""

    def __serve_build_asgi_app__(self):
        return self.api()
